"""The image: one entrypoint for every service, CPU by default and TPU by a build argument,
a non-root user, and a build context (.dockerignore) that holds what the COPYs need.

No Docker engine runs here, so the Dockerfile is checked as text against the repository."""

from __future__ import annotations

import fnmatch
import json
import re
import tomllib

from deploy_helpers import DEPLOY, REPO

from splitrl.config import Config, load_config
from splitrl_app.cli import build_parser

DOCKERFILE = DEPLOY / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def final_stage() -> list[tuple[str, str]]:
    ins = instructions()
    last_from = max(i for i, (op, _) in enumerate(ins) if op == "FROM")
    return ins[last_from:]


def image_user() -> tuple[int, int]:
    users = [rest for op, rest in final_stage() if op == "USER"]
    uid, gid = users[-1].split(":")
    return int(uid), int(gid)


def dockerignore() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [x.strip() for x in lines if x.strip() and not x.startswith("#")]


def ignored(path: str) -> bool:
    """Docker's rule: a path is out if it or one of its parent directories matches."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    return any(
        fnmatch.fnmatch(p, pat) or fnmatch.fnmatch(p, pat.removeprefix("**/"))
        for pat in dockerignore()
        for p in prefixes
    )


def test_entrypoint_is_the_splitrl_cli_and_the_default_command_parses():
    final = final_stage()
    entry = json.loads(next(rest for op, rest in final if op == "ENTRYPOINT"))
    cmd = json.loads(next(rest for op, rest in final if op == "CMD"))
    assert entry == ["splitrl"]
    assert cmd == ["--help"]
    # The executable the image runs is the same entry as ``python -m splitrl`` (the launcher's).
    assert tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"][
        "splitrl"
    ] == "splitrl_app.cli:entry"
    assert "from splitrl_app.cli import entry" in (REPO / "splitrl" / "__main__.py").read_text()


def test_runs_as_a_fixed_non_root_user_that_owns_the_volume_mount_points():
    uid, gid = image_user()
    assert uid >= 1000 and gid >= 1000
    runs = " ".join(rest for op, rest in final_stage() if op == "RUN")
    assert f"--uid {uid}" in runs and f"--gid {gid}" in runs
    cfg = load_config(DEPLOY / "config" / "splitrl.yaml")
    for path in (cfg.model.path, cfg.trainer.run_dir):
        top = "/" + path.strip("/").split("/")[0]
        assert re.search(rf"chown \S+ [^&]*{re.escape(top)}\b", runs), top


def test_accelerator_build_arg_defaults_to_cpu_and_selects_the_jax_extra():
    ins = instructions()
    args = [rest for op, rest in ins if op == "ARG" and rest.startswith("ACCELERATOR")]
    assert args and all(a == "ACCELERATOR=cpu" for a in args)
    installs = " ".join(rest for op, rest in ins if op == "RUN" and "pip install" in rest)
    assert '"jax[${ACCELERATOR}]"' in installs
    assert "cpu|tpu)" in " ".join(rest for op, rest in ins if op == "RUN")
    env = " ".join(rest for op, rest in final_stage() if op == "ENV")
    assert "JAX_PLATFORMS=${ACCELERATOR}" in env


def test_every_copied_path_exists_and_is_in_the_build_context():
    copies = [rest for op, rest in instructions() if op == "COPY" and "--from" not in rest]
    sources = [s for rest in copies for s in rest.split()[:-1]]
    for src in sources:
        assert (REPO / src).exists(), f"COPY {src}: not in the repository"
        assert not ignored(src), f"COPY {src}: excluded by .dockerignore"
    # Every package that pyproject installs is copied.
    include = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"
    ]["find"]["include"]
    packages = {p.rstrip("*") for p in include}
    assert packages <= set(sources), packages - set(sources)
    assert "pyproject.toml" in sources and "README.md" in sources


def test_dockerignore_keeps_local_state_and_secrets_out():
    for path in (".git", ".venv", "runs", "models", "checkpoints", "deploy/k8s/base/auth/token"):
        assert ignored(path), path
    assert not ignored("splitrl/models"), "the models package must stay in the context"


def test_data_is_an_optional_named_build_context():
    ins = instructions()
    assert ("FROM", "scratch AS data") in ins
    assert any(op == "COPY" and rest.startswith("--from=data ") for op, rest in final_stage())
    assert "--build-context data=" in DOCKERFILE.read_text()


def test_exposed_ports_are_the_configured_ones():
    exposed = {
        int(p) for op, rest in final_stage() if op == "EXPOSE" for p in rest.split()
    }
    cfg = load_config(DEPLOY / "config" / "splitrl.yaml")
    s = cfg.services
    wanted = {
        int(s.reward_address.rsplit(":", 1)[1]),
        int(s.trainer_address.rsplit(":", 1)[1]),
        s.sampler_port,
        s.metrics_port,
    }
    assert wanted <= exposed
    defaults = Config().services
    assert defaults.sampler_port == s.sampler_port  # same ports as a local `splitrl up`


def test_the_usage_lines_in_the_dockerfile_header_parse():
    header = [x for x in DOCKERFILE.read_text().splitlines() if x.startswith("#   docker run")]
    assert header
    roles = re.search(r"IMAGE (\S+)", header[0]).group(1).split("|")
    for role in roles:
        assert build_parser().parse_args([role]).command == role


def stages() -> list[list[tuple[str, str]]]:
    """The instructions of each stage (a FROM starts one)."""
    out: list[list[tuple[str, str]]] = []
    for op, rest in instructions():
        if op == "FROM":
            out.append([])
        if out:
            out[-1].append((op, rest))
    return out


def test_builds_with_the_legacy_builder_and_any_buildkit_offline():
    first = DOCKERFILE.read_text().splitlines()[0]
    # A parser directive (first line only) would make BuildKit pull that frontend image.
    assert not re.match(r"#\s*syntax\s*=", first), first
    runs = " ".join(rest for op, rest in instructions() if op == "RUN")
    assert "--mount" not in runs  # the legacy builder refuses RUN --mount
    assert "python -m venv" not in runs  # Debian's python3 package has no `python` command
    assert "python3 -m venv" in runs


def test_the_base_image_is_a_build_arg_used_by_the_build_and_final_stages():
    ins = instructions()
    first_from = next(i for i, (op, _) in enumerate(ins) if op == "FROM")
    global_args = dict(rest.split("=", 1) for op, rest in ins[:first_from] if op == "ARG")
    assert global_args["BASE_IMAGE"] == "python:3.11-slim"
    froms = [rest for op, rest in ins if op == "FROM"]
    assert "${BASE_IMAGE} AS build" in froms
    assert froms[-1] == "${BASE_IMAGE}"  # the venv's interpreter link points into this image


def test_the_ca_bundle_reaches_the_build_stage_only():
    ins = instructions()
    first_from = next(i for i, (op, _) in enumerate(ins) if op == "FROM")
    global_args = dict(rest.split("=", 1) for op, rest in ins[:first_from] if op == "ARG")
    assert global_args["CA_IMAGE"] == "scratch"  # no bundle unless one is given
    by_name = {st[0][1].split(" AS ")[-1]: st for st in stages() if " AS " in st[0][1]}
    assert by_name["ca"][0] == ("FROM", "${CA_IMAGE} AS ca")
    build = " ".join(rest for _, rest in by_name["build"])
    assert "--from=ca / /opt/build-ca/" in build
    assert "cert = /opt/build-ca/ca-certificates.crt" in build and "/etc/pip.conf" in build
    final = " ".join(rest for _, rest in final_stage())
    assert "--from=ca" not in final and "build-ca" not in final and "pip.conf" not in final
    # Only the venv and the data come over from other stages.
    copies = [rest for op, rest in final_stage() if op == "COPY"]
    assert copies == ["--from=build /opt/venv /opt/venv", "--from=data / /opt/splitrl/data/"]


def test_no_test_extra_in_the_image():
    """torch (and the other test tools) stay out: the image installs the runtime dependencies
    read from pyproject.toml with the CLI's extras (plots, k8s), plus jax's accelerator extra,
    and the package with --no-deps."""
    installs = [rest for op, rest in instructions() if op == "RUN" and "pip install" in rest]
    joined = " ".join(installs)
    assert "[test]" not in joined and "torch" not in joined and "['test']" not in joined
    assert "p['dependencies']" in joined
    assert all(f"['optional-dependencies']['{extra}']" in joined for extra in ("plots", "k8s"))
    assert "pip install --no-deps ." in joined
