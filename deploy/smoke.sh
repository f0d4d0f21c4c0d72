#!/usr/bin/env bash
# The compose stack for real, on this machine, start to finish (not part of `make test`):
#
#   1. builds a Debian base image from Debian's packages (mmdebstrap + docker import: no registry;
#      once: an existing one is reused unless --rebuild-base, since a new base invalidates the
#      image's whole build cache) and an image holding the host's CA bundle, which only the build
#      stage reads;
#   2. builds the SplitRL image from deploy/Dockerfile (host network, so pip reaches PyPI);
#   3. run "demo": deploy/compose.yaml as is (2 samplers); the trainer must finish, record its
#      greedy accuracy before and after in summary.json, export the model into the `runs` volume
#      and train every drawn prompt exactly once, and every service must report SERVING through
#      gRPC health;
#   4. run "faults": --scale sampler=3; all three get work; one sampler container is killed
#      mid-run while it holds prompts (no prompt may be lost); the trainer container is
#      restarted mid-run and must resume from the step it checkpointed;
#   5. removes the project's containers, volumes and network (on failure too). Images stay.
#
# Usage: deploy/smoke.sh [--demo-steps N] [--fault-steps N] [--rebuild-base] [--skip-build]
#                        [--only demo|faults] [--compose "docker-compose"]
# Needs: a running Docker engine, Compose v2 (`docker compose`) or docker-compose 1.29,
# mmdebstrap (unless the base image exists) and python3.
# All traffic stays on this machine: the containers talk on the project's own network.
set -euo pipefail
cd "$(dirname "$0")/.."

DEMO_STEPS=150       # the `make demo` run, as deploy/config/splitrl.yaml says
FAULT_STEPS=60
CHECKPOINT_EVERY=5   # the faults run: checkpoints close together
REBUILD_BASE=0
BUILD=1
ONLY=""
COMPOSE_CMD=""
while [ $# -gt 0 ]; do
  case "$1" in
    --demo-steps) DEMO_STEPS=$2; shift 2 ;;
    --fault-steps) FAULT_STEPS=$2; shift 2 ;;
    --rebuild-base) REBUILD_BASE=1; shift ;;
    --skip-build) BUILD=0; shift ;;
    --only) ONLY=$2; shift 2 ;;
    --compose) COMPOSE_CMD=$2; shift 2 ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done

PROJECT=${SMOKE_PROJECT:-splitrl-smoke}
BASE_IMAGE=${SPLITRL_BASE_IMAGE:-splitrl-base:bookworm}
CA_IMAGE=splitrl-build-ca:local
CA_BUNDLE=${SPLITRL_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
export SPLITRL_IMAGE=${SPLITRL_IMAGE:-splitrl:latest}
RUN_DIR=/runs/demo          # trainer.run_dir in deploy/config/splitrl.yaml
PROMPTS_PER_STEP=16         # trainer.prompts_per_step in deploy/config/splitrl.yaml
WORK=$(mktemp -d)
SUMMARY=$WORK/summary.txt

log() { printf '[smoke %s] %s\n' "$(date +%T)" "$*"; }
die() { log "FAILED: $*"; exit 1; }
note() { printf '%s\n' "$*" | tee -a "$SUMMARY"; }

docker info >/dev/null 2>&1 || die "no Docker engine answers 'docker info' (start dockerd)"
if [ -z "$COMPOSE_CMD" ]; then
  if docker compose version >/dev/null 2>&1; then COMPOSE_CMD="docker compose"
  elif command -v docker-compose >/dev/null; then COMPOSE_CMD="docker-compose"
  else die "neither 'docker compose' (v2) nor 'docker-compose' is installed"; fi
fi
read -r -a COMPOSE_ARGV <<< "$COMPOSE_CMD"
compose() { "${COMPOSE_ARGV[@]}" -p "$PROJECT" -f deploy/compose.yaml -f "$WORK/override.yaml" "$@"; }

cleanup() {
  if [ -f "$WORK/override.yaml" ]; then
    compose down -v --remove-orphans >/dev/null 2>&1 || true
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT

note "compose: $("${COMPOSE_ARGV[@]}" version | head -1); engine: $(docker version -f '{{.Server.Version}}'); load: $(cut -d' ' -f1-3 /proc/loadavg)"

# -- 1. the local base and the CA image --------------------------------------------------------
if [ "$REBUILD_BASE" = 0 ] && docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  log "reusing base image $BASE_IMAGE"
else
  command -v mmdebstrap >/dev/null || die "mmdebstrap is not installed (apt-get install -y mmdebstrap)"
  log "building base image $BASE_IMAGE from Debian's packages (mmdebstrap)"
  t0=$(date +%s)
  mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
    bookworm "$WORK/base.tar"
  docker import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["python3"]' "$WORK/base.tar" "$BASE_IMAGE" >/dev/null
  rm -f "$WORK/base.tar"
  note "base image $BASE_IMAGE: $(( $(date +%s) - t0 )) s, $(docker image inspect -f '{{.Size}}' "$BASE_IMAGE" | awk '{printf "%.0f MB", $1/1e6}')"
fi
CA_ARG=()
if [ -f "$CA_BUNDLE" ]; then
  # Re-imported only when the bundle changed: a new image would invalidate the build's cache.
  sum=$(sha256sum < "$CA_BUNDLE" | cut -c1-64)
  if [ "$(docker image inspect -f '{{index .Config.Labels "bundle.sha256"}}' "$CA_IMAGE" 2>/dev/null)" != "$sum" ]; then
    tar -C "$(dirname "$CA_BUNDLE")" -ch --transform "s|.*|ca-certificates.crt|" \
      "$(basename "$CA_BUNDLE")" | docker import --change "LABEL bundle.sha256=$sum" - "$CA_IMAGE" >/dev/null
  fi
  CA_ARG=(--build-arg "CA_IMAGE=$CA_IMAGE")
fi

# -- 2. the image -------------------------------------------------------------------------------
if [ "$BUILD" = 1 ]; then
  log "building $SPLITRL_IMAGE (deploy/Dockerfile, base $BASE_IMAGE, host network)"
  t0=$(date +%s)
  docker build -f deploy/Dockerfile --network host --build-arg "BASE_IMAGE=$BASE_IMAGE" \
    "${CA_ARG[@]}" -t "$SPLITRL_IMAGE" . > "$WORK/build.log" 2>&1 \
    || { tail -30 "$WORK/build.log" >&2; die "docker build"; }
  note "image $SPLITRL_IMAGE: built in $(( $(date +%s) - t0 )) s, $(docker image inspect -f '{{.Size}}' "$SPLITRL_IMAGE" | awk '{printf "%.0f MB", $1/1e6}')"
fi
docker image inspect "$SPLITRL_IMAGE" >/dev/null 2>&1 || die "no image $SPLITRL_IMAGE (drop --skip-build)"
docker run --rm --entrypoint sh "$SPLITRL_IMAGE" -c \
  'test ! -e /opt/build-ca && test ! -e /etc/pip.conf' || die "the build's CA bundle is in the image"

# -- helpers for a run --------------------------------------------------------------------------
write_override() {  # steps checkpoint_every (the trainer's alone: samplers take any version)
  cat > "$WORK/override.yaml" <<EOF
services:
  trainer:
    command: ["trainer", "trainer.steps=$1", "trainer.checkpoint.every=$2"]
EOF
}

container() {  # service [index]: the container id
  local ids
  ids=$(compose ps -q "$1" | xargs -r docker inspect -f '{{.Name}} {{.Id}}' | sort -V)
  awk -v i="${2:-1}" 'NR == i {print $2}' <<< "$ids"
}

trained_steps() {  # steps the trainer has finished so far (0 when it cannot be asked)
  docker exec "$1" sh -c "cat $RUN_DIR/trained_prompts.jsonl 2>/dev/null | wc -l" 2>/dev/null \
    | grep -x '[0-9][0-9]*' || echo 0
}

wait_for_step() {  # trainer-id step timeout-s
  local deadline=$(( $(date +%s) + $3 ))
  while [ "$(trained_steps "$1")" -lt "$2" ]; do
    [ "$(date +%s)" -lt "$deadline" ] || die "the trainer did not reach step $2 within $3 s"
    [ "$(docker inspect -f '{{.State.Running}}' "$1")" = true ] || die "the trainer exited before step $2"
    sleep 2
  done
}

wait_healthy() {  # container-id timeout-s
  local deadline=$(( $(date +%s) + $2 )) state
  while true; do
    state=$(docker inspect -f '{{.State.Health.Status}}' "$1")
    [ "$state" = healthy ] && return 0
    [ "$(date +%s)" -lt "$deadline" ] || die "$(docker inspect -f '{{.Name}}' "$1") is $state after $2 s"
    sleep 2
  done
}

report_health() {  # every running service container: docker's health state + `splitrl health`
  local id name port
  for id in $(compose ps -q); do
    [ "$(docker inspect -f '{{.State.Running}}' "$id")" = true ] || continue
    name=$(docker inspect -f '{{.Name}}' "$id" | tr -d /)
    case "$name" in
      # Compose v2 names containers PROJECT-SERVICE-N, docker-compose 1.29 PROJECT_SERVICE_N.
      *[-_]reward[-_]*) port=50100 ;; *[-_]trainer[-_]*) port=50200 ;;
      *[-_]sampler[-_]*) port=50300 ;; *) continue ;;
    esac
    wait_healthy "$id" 300
    note "  health $name: docker=$(docker inspect -f '{{.State.Health.Status}}' "$id"), splitrl health 127.0.0.1:$port -> $(docker exec "$id" splitrl health "127.0.0.1:$port")"
  done
}

inflight() {  # trainer-id sampler-ip: prompts the trainer has in flight on that sampler
  docker exec "$1" python -c '
import sys, grpc
from splitrl.v1 import trainer_pb2, trainer_pb2_grpc
stub = trainer_pb2_grpc.TrainerStub(grpc.insecure_channel("127.0.0.1:50200"))
reply = stub.Status(trainer_pb2.StatusRequest(), timeout=5)
print(sum(s.inflight_prompts for s in reply.samplers if s.address.rsplit(":", 1)[0] == sys.argv[1]))
' "$2" 2>/dev/null | grep -x '[0-9][0-9]*' || echo 0  # docker's own errors are not a count
}

sampler_map() {  # NAME<TAB>IP of every sampler container, while they run
  compose ps -q sampler | xargs -r docker inspect \
    -f '{{.Name}}{{"\t"}}{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' > "$WORK/samplers.tsv"
}

collect() {  # trainer-id: its log, trained_prompts.jsonl, summary.json and the export
  docker logs "$1" > "$WORK/trainer.log" 2>&1
  docker cp "$1:$RUN_DIR/trained_prompts.jsonl" "$WORK/trained_prompts.jsonl"
  docker cp "$1:$RUN_DIR/metrics.jsonl" "$WORK/metrics.jsonl"
  docker cp "$1:$RUN_DIR/summary.json" "$WORK/summary.json"
  rm -rf "$WORK/export"
  docker cp "$1:$RUN_DIR/export" "$WORK/export"
  [ -s "$WORK/export/config.json" ] && [ -s "$WORK/export/model.safetensors" ] \
    || die "no exported model (config.json, model.safetensors) in $RUN_DIR/export"
  note "  exported model in the runs volume: $(cd "$WORK/export" && ls | tr '\n' ' ')"
  # Exactly-once across every restart: the project's own audit, run on the volume the trainer
  # wrote (in a throwaway container of the same image; the trainer container has exited).
  docker run --rm --network none --volumes-from "$1" --entrypoint splitrl \
    "$(docker inspect -f '{{.Config.Image}}' "$1")" audit "$RUN_DIR" | tee -a "$SUMMARY" \
    || die "splitrl audit: prompts lost or trained twice in $RUN_DIR"
}

finish() {  # trainer-id timeout-s: wait for the trainer to exit 0
  local code
  code=$(timeout "$2" docker wait "$1") || die "the trainer did not finish within $2 s"
  [ "$code" = 0 ] || { docker logs --tail 30 "$1" >&2; die "the trainer exited with $code"; }
}

# -- 3. the demo: compose.yaml as is, two samplers ----------------------------------------------
if [ -z "$ONLY" ] || [ "$ONLY" = demo ]; then
  note "run demo: $COMPOSE_CMD up, 2 samplers, $DEMO_STEPS steps"
  write_override "$DEMO_STEPS" 50
  compose down -v --remove-orphans >/dev/null 2>&1 || true
  t0=$(date +%s)
  compose up -d --no-build >/dev/null 2>"$WORK/up.log" || { cat "$WORK/up.log" >&2; die "compose up failed"; }
  trainer=$(container trainer)
  sampler_map
  report_health
  finish "$trainer" 3600
  note "  run time (up to trainer exit): $(( $(date +%s) - t0 )) s"
  collect "$trainer"
  expect=(--expect-samplers 2)
  [ "$DEMO_STEPS" -lt 150 ] || expect+=(--expect-accuracy)  # the full demo must learn
  if ! python3 deploy/smoke_check.py --trained "$WORK/trained_prompts.jsonl" \
      --metrics "$WORK/metrics.jsonl" --summary "$WORK/summary.json" --log "$WORK/trainer.log" \
      --steps "$DEMO_STEPS" \
      --prompts-per-step "$PROMPTS_PER_STEP" --samplers "$WORK/samplers.tsv" "${expect[@]}" \
      | tee -a "$SUMMARY"; then
    die "demo run checks"
  fi
  compose down -v --remove-orphans >/dev/null 2>&1
fi

# -- 4. faults: three samplers, one killed, the trainer restarted -------------------------------
if [ -z "$ONLY" ] || [ "$ONLY" = faults ]; then
  note "run faults: $COMPOSE_CMD up --scale sampler=3, $FAULT_STEPS steps, checkpoint every $CHECKPOINT_EVERY"
  write_override "$FAULT_STEPS" "$CHECKPOINT_EVERY"
  compose down -v --remove-orphans >/dev/null 2>&1 || true
  t0=$(date +%s)
  compose up -d --no-build --scale sampler=3 >/dev/null 2>"$WORK/up.log" \
    || { cat "$WORK/up.log" >&2; die "compose up failed"; }
  trainer=$(container trainer)
  sampler_map
  report_health
  victim=$(container sampler 3)
  victim_ip=$(docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "$victim")
  kill_at=$(( FAULT_STEPS / 3 ))
  wait_for_step "$trainer" "$kill_at" 1800
  # Kill it while it holds prompts: freeze it (docker pause), ask the trainer's Status RPC what
  # it has in flight there, thaw and retry until that is some, then kill the frozen container.
  # Until a third of the steps is left for the restart below; a trainer that finished or
  # died first fails the run here, saying so.
  held=0
  restart_at=$(( 2 * FAULT_STEPS / 3 ))
  while [ "$(trained_steps "$trainer")" -lt "$restart_at" ]; do
    [ "$(docker inspect -f '{{.State.Running}}' "$trainer")" = true ] \
      || die "the trainer exited before a sampler could be killed while holding prompts"
    # The cgroup freezer can fail under load ("unable to freeze"); runc then leaves it running.
    docker pause "$victim" >/dev/null 2>&1 || { sleep 0.5; continue; }
    held=$(inflight "$trainer" "$victim_ip")
    [ "$held" -gt 0 ] && break
    docker unpause "$victim" >/dev/null
    sleep 0.5
  done
  [ "$held" -gt 0 ] || die "$(docker inspect -f '{{.Name}}' "$victim" | tr -d /) held no prompts \
whenever it was frozen before step $restart_at"
  docker kill "$victim" >/dev/null
  note "  killed $(docker inspect -f '{{.Name}}' "$victim" | tr -d /) after step $(trained_steps "$trainer"), holding $held prompts"
  wait_for_step "$trainer" "$restart_at" 1800
  note "  restarting the trainer container at step $(trained_steps "$trainer") (SIGTERM, then start)"
  compose restart -t 120 trainer >/dev/null 2>&1
  finish "$trainer" 3600
  [ "$(docker inspect -f '{{.State.Running}}' "$victim")" = false ] || die "the killed sampler came back"
  note "  run time (up to trainer exit): $(( $(date +%s) - t0 )) s"
  collect "$trainer"
  if ! python3 deploy/smoke_check.py --trained "$WORK/trained_prompts.jsonl" \
      --metrics "$WORK/metrics.jsonl" --summary "$WORK/summary.json" --log "$WORK/trainer.log" \
      --steps "$FAULT_STEPS" \
      --prompts-per-step "$PROMPTS_PER_STEP" --samplers "$WORK/samplers.tsv" \
      --expect-samplers 3 --expect-resume | tee -a "$SUMMARY"; then
    die "faults run checks"
  fi
fi

log "summary"
cat "$SUMMARY"
log "PASSED"
