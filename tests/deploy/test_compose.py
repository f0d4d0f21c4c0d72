"""deploy/compose.yaml: valid against the compose spec and free of what only one of Compose v2
and docker-compose 1.29 reads; every service's command, health check and mounted config are
accepted by the real CLI; samplers scale with no address written anywhere.

(`deploy/smoke.sh` runs the file for real with both, where a Docker engine runs.)"""

from __future__ import annotations

import shlex
import subprocess

import pytest
import yaml
from deploy_helpers import DEPLOY, REPO, host_of, interpolate_compose, port_of, venv_tool

from splitrl.config import load_config
from splitrl_app.cli import build_parser

COMPOSE = DEPLOY / "compose.yaml"
SERVICES = ("reward", "sampler", "trainer")
CONTAINER_IP = "172.18.0.5"  # what `hostname -i` prints in a container on the project network


def compose() -> dict:
    """The compose file as compose sees it with no variables set (anchors and merges applied)."""
    return yaml.safe_load(interpolate_compose(COMPOSE.read_text()))


def argv(service: dict) -> list[str]:
    """The `splitrl` arguments a service runs (``sh -c '... exec splitrl ARGS'`` included)."""
    entry = service.get("entrypoint")
    command = service.get("command", [])
    if entry is None:  # the image's ENTRYPOINT ["splitrl"]
        return list(command)
    assert entry == ["sh", "-c"], entry
    # Compose turns $$ into $; then the shell substitutes the container's address.
    script = command[0].replace("$$", "$").replace("$(hostname -i)", CONTAINER_IP)
    assert "$" not in script, script
    words = shlex.split(script)
    assert "exec" in words and words[words.index("exec") + 1] == "splitrl", script
    return words[words.index("exec") + 2 :]


def mounts(service: dict) -> dict[str, str]:
    """Container path -> host path (relative to deploy/) or volume name."""
    out = {}
    for spec in service.get("volumes", []):
        source, target = spec.split(":")[:2]
        out[target] = source
    return out


def test_compose_file_validates_against_the_compose_spec():
    exe = venv_tool("check-jsonschema")
    if exe is None:
        pytest.skip("check-jsonschema is not installed")
    proc = subprocess.run(
        [exe, "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _service_config(name: str, monkeypatch):
    svc = compose()["services"][name]
    env = {k: "" if v is None else str(v) for k, v in svc.get("environment", {}).items()}
    monkeypatch.delenv("SPLITRL_CONFIG", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    parsed = build_parser().parse_args(argv(svc))
    host_file = mounts(svc)[parsed.config]
    cfg = load_config(DEPLOY / host_file, parsed.overrides)
    return svc, parsed, cfg


@pytest.mark.parametrize("name", SERVICES)
def test_each_service_command_is_accepted_with_its_mounted_config(name, monkeypatch):
    svc, parsed, cfg = _service_config(name, monkeypatch)
    assert parsed.command == name
    assert cfg.services.host == "0.0.0.0"
    assert svc["build"]["dockerfile"] == "deploy/Dockerfile"
    assert (DEPLOY / svc["build"]["context"] / svc["build"]["dockerfile"]).resolve() == (
        DEPLOY / "Dockerfile"
    ).resolve()


@pytest.mark.parametrize("name", SERVICES)
def test_health_checks_call_splitrl_health_on_the_port_the_service_listens_on(
    name, monkeypatch
):
    svc, _, cfg = _service_config(name, monkeypatch)
    test = svc["healthcheck"]["test"]
    assert test[:2] == ["CMD", "splitrl"]  # exec'd directly, not through the entrypoint
    parsed = build_parser().parse_args(test[2:])
    assert parsed.command == "health"
    port = {
        "reward": port_of(cfg.services.reward_address),
        "trainer": port_of(cfg.services.trainer_address),
        "sampler": cfg.services.sampler_port,
    }[name]
    assert parsed.address == f"127.0.0.1:{port}"


def test_addresses_in_the_config_are_the_compose_service_names(monkeypatch):
    services = compose()["services"]
    _, _, cfg = _service_config("trainer", monkeypatch)
    assert host_of(cfg.services.reward_address) in services
    assert host_of(cfg.services.trainer_address) in services
    dns_name, dns_port = cfg.services.sampler_dns.rsplit(":", 1)
    assert dns_name == "sampler" and int(dns_port) == cfg.services.sampler_port
    assert cfg.services.sampler_addresses == []


def test_samplers_can_be_scaled_no_fixed_name_port_or_address():
    sampler = compose()["services"]["sampler"]
    assert "container_name" not in sampler and "hostname" not in sampler
    assert "ports" not in sampler  # published host ports would collide at --scale sampler=3
    assert sampler["deploy"]["replicas"] == 2  # as many as `make demo` (1.29 reads it too)
    assert "sampler_addresses" not in COMPOSE.read_text()


def test_each_sampler_advertises_the_address_the_trainers_dns_lookup_returns(monkeypatch):
    """Registration and DNS must name a sampler by the same address, else the trainer's pool
    holds it twice (two weight pushes collide, its capacity counts double): each replica
    advertises its own address on the project network, read when it starts."""
    _, parsed, cfg = _service_config("sampler", monkeypatch)
    assert parsed.command == "sampler"
    assert cfg.services.advertise_host == CONTAINER_IP
    script = compose()["services"]["sampler"]["command"][0]
    assert "services.advertise_host=$$(hostname -i)" in script  # $$: not a compose variable


def test_no_top_level_name_the_project_name_comes_from_the_env_file():
    """docker-compose 1.29 rejects a top-level `name:` (Compose v2 only); both read
    COMPOSE_PROJECT_NAME from the .env file beside the compose file."""
    assert "name" not in compose()
    env = dict(
        line.split("=", 1)
        for line in (DEPLOY / ".env").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    )
    assert env == {"COMPOSE_PROJECT_NAME": "splitrl"}


def test_build_args_name_the_dockerfiles_args_and_default_to_the_registry_path():
    build = compose()["services"]["trainer"]["build"]
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    for arg in build["args"]:
        assert f"ARG {arg}=" in dockerfile, arg
    assert build["args"]["BASE_IMAGE"] == "python:3.11-slim"  # interpolated with nothing set
    assert build["args"]["CA_IMAGE"] == "scratch"
    assert build["network"] == "default"
    local = yaml.safe_load(interpolate_compose(COMPOSE.read_text(), {
        "SPLITRL_BASE_IMAGE": "splitrl-base:bookworm", "SPLITRL_BUILD_NETWORK": "host"}))
    assert local["services"]["trainer"]["build"]["args"]["BASE_IMAGE"] == "splitrl-base:bookworm"
    assert local["services"]["trainer"]["build"]["network"] == "host"


def test_a_stopped_trainer_gets_time_to_checkpoint_its_step():
    grace = compose()["services"]["trainer"]["stop_grace_period"]
    assert grace.endswith("s") and int(grace[:-1]) >= 60


def test_init_model_writes_the_model_the_services_load_into_a_shared_volume(monkeypatch):
    services = compose()["services"]
    init_args = build_parser().parse_args(argv(services["init-model"]))
    assert init_args.command == "init-model"
    script = services["init-model"]["command"][0]
    assert f"test -f {init_args.out}/config.json ||" in script  # only if the model is missing
    for name in ("sampler", "trainer"):
        svc, _, cfg = _service_config(name, monkeypatch)
        assert cfg.model.path == init_args.out
        deps = svc["depends_on"]
        assert deps["init-model"]["condition"] == "service_completed_successfully"
        model_mount = next(p for p in mounts(svc) if init_args.out.startswith(p + "/"))
        assert mounts(svc)[model_mount] == mounts(services["init-model"])[model_mount]
        assert mounts(svc)[model_mount] in compose()["volumes"]


def test_trainer_run_dir_is_a_named_volume_and_restarts_resume(monkeypatch):
    svc, _, cfg = _service_config("trainer", monkeypatch)
    run_mount = next(p for p in mounts(svc) if cfg.trainer.run_dir.startswith(p + "/"))
    assert mounts(svc)[run_mount] in compose()["volumes"]
    assert svc["restart"] == "on-failure"
    published = {p.split(":")[-1] for p in svc["ports"]}
    assert {str(port_of(cfg.services.trainer_address)), str(cfg.services.metrics_port)} <= (
        published
    )


def test_auth_token_comes_from_the_environment_the_config_names(monkeypatch):
    for name in SERVICES:
        svc, _, cfg = _service_config(name, monkeypatch)
        assert cfg.services.auth.token_env in svc["environment"]
    assert "${SPLITRL_AUTH_TOKEN:-}" in COMPOSE.read_text()


def test_the_config_file_is_inside_the_repo_and_shared_with_kubernetes():
    kust = yaml.safe_load((DEPLOY / "config" / "kustomization.yaml").read_text())
    files = kust["configMapGenerator"][0]["files"]
    assert files == ["splitrl.yaml"]
    sources = {mounts(s).get("/etc/splitrl/splitrl.yaml") for s in compose()["services"].values()}
    assert sources == {"./config/splitrl.yaml"}
    assert (REPO / "deploy" / "config" / "splitrl.yaml").is_file()
