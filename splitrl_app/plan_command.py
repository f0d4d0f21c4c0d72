"""``splitrl plan``: arguments and entry point (JAX is imported only when it runs)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser(
        "plan", help="compile the trainer's and sampler's programs for TPU topologies (or this "
        "CPU) from config.json alone; per-device memory vs HBM; exit 1 when it does not fit",
        description="Builds the model from a Hugging Face config.json (no weights), compiles "
        "the trainer's train step, the sampler's generation program and, with reward.models, "
        "each reward model's forward for each target, and "
        "prints per-device memory by category against the chip's HBM, whether it fits and the "
        "largest batch that does. TPU targets need libtpu (pip install 'splitrl[tpu-plan]'), "
        "not a TPU. Exit 0 when everything fits, 1 when something does not, 2 on bad input.")
    p.add_argument("--model", help="a checkpoint directory or its config.json "
                   "(default: model.path of the config)")
    p.add_argument("--platform", choices=["tpu", "cpu"], default="tpu",
                   help="tpu (default): compile for --topology / --*-topology via libtpu; "
                   "cpu: this process's CPU devices")
    p.add_argument("--topology", help="one slice both services share (each takes its "
                   "mesh.device_fraction / device_offset of it), e.g. v5p:2x2x2 or v5p-16")
    p.add_argument("--trainer-topology", help="the trainer's slice, e.g. v5p:2x2x1 or v5p-8")
    p.add_argument("--sampler-topology", help="one sampler's slice, e.g. v5e:2x2")
    p.add_argument("--reward-topology", help="one reward service's slice, for its reward "
                   "models (reward.models), e.g. v5e:2x2")
    p.add_argument("--cpu-devices", type=int, default=8,
                   help="with --platform cpu: how many CPU devices to emulate (default 8, or "
                   "more when a service's mesh asks for more); a service with a fixed mesh "
                   "plans on the devices it asks for, one with a -1 axis on all of them")
    p.add_argument("--hbm-gib", type=float, help="memory per device (default: the chip's HBM; "
                   "on cpu: the host's RAM shared by the devices)")
    p.add_argument("--only", choices=["trainer", "sampler", "reward"],
                   help="plan one service (reward: the reward models of reward.models)")
    p.add_argument("--no-search", action="store_true",
                   help="compile the configured batch only (no search for the largest)")
    p.add_argument("--extrapolate-layers", action="store_true",
                   help="compile the model cut to 2 and to 3 layers and extrapolate linearly "
                   "to its depth: minutes instead of hours for 70B (parameters, optimizer "
                   "state, gradients, KV cache exact; temporaries approximate)")
    p.add_argument("--json", action="store_true", help="print the reports as JSON")
    p.add_argument("--config", help="YAML run config (default: built-in defaults)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="dotted overrides, e.g. trainer.micro_batch_size=8")
    p.set_defaults(func=run)


def _model_config(args, cfg):
    from splitrl.models import TransformerConfig

    path = Path(args.model or cfg.model.path)
    config_json = path if path.suffix == ".json" else path / "config.json"
    if not config_json.is_file():
        raise _PlanError(f"--model: no config.json at {config_json}")
    try:
        return TransformerConfig.from_hf_dict(json.loads(config_json.read_text()))
    except (ValueError, KeyError, TypeError) as e:
        raise _PlanError(f"--model: {config_json} is not a supported config: {e}") from e


class _PlanError(ValueError):
    pass


def _services(args, cfg) -> list[str]:
    """The services to plan: --only's, else the trainer, the sampler and (with reward models
    configured) the reward service."""
    if args.only:
        if args.only == "reward" and not cfg.reward.models:
            raise _PlanError("--only reward: the config has no reward.models to plan")
        return [args.only]
    return ["trainer", "sampler"] + (["reward"] if cfg.reward.models else [])


def _meshes(cfg) -> dict:
    return {"trainer": cfg.trainer.mesh, "sampler": cfg.sampler.mesh, "reward": cfg.reward.mesh}


def _cpu_devices(args, cfg) -> int:
    """The CPU devices to emulate: --cpu-devices, or more when a service's mesh needs more."""
    return max([args.cpu_devices,
                *(_meshes(cfg)[s].devices_needed() for s in _services(args, cfg))])


def _targets(args, cfg) -> dict:
    """Each service's target. On CPU one process emulates :func:`_cpu_devices` devices and each
    service gets the devices its own mesh asks for (a trainer on 4 and samplers on 2, as
    `splitrl up` starts them); a mesh with a -1 axis gets all of them."""
    import dataclasses

    from splitrl_app.planning import cpu_target, tpu_target

    hbm = None if args.hbm_gib is None else int(args.hbm_gib * 1024**3)
    services = _services(args, cfg)
    if args.platform == "cpu":
        target = cpu_target(hbm)
        meshes = _meshes(cfg)
        return {s: target if -1 in meshes[s].axes.values() else dataclasses.replace(
            target, devices=target.devices[:meshes[s].devices_needed()]) for s in services}
    named = {"trainer": args.trainer_topology or args.topology,
             "sampler": args.sampler_topology or args.topology,
             "reward": args.reward_topology or args.topology}
    missing = [s for s in services if not named[s]]
    if missing:
        raise _PlanError(f"no TPU topology for the {' and '.join(missing)}: give --topology, or "
                         f"--trainer-topology and --sampler-topology (or --platform cpu)")
    made: dict = {}
    for s in services:
        if named[s] not in made:
            made[named[s]] = tpu_target(named[s], hbm)
    return {s: made[named[s]] for s in services}


def _jax_environment(args, cfg) -> None:
    """Before jax starts: a plan runs nothing on an accelerator (TPU programs are compiled by
    libtpu's compile-only client), so the runtime is the CPU; --platform cpu emulates
    :func:`_cpu_devices` of it."""
    import os

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    if args.platform == "cpu" and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (
            f"{flags} --xla_force_host_platform_device_count={_cpu_devices(args, cfg)}").strip()


def run(args: argparse.Namespace) -> int:
    from splitrl.config import ConfigError, load_config

    overrides = list(args.overrides)
    if args.model:  # the run's model.path is the checkpoint planned
        path = Path(args.model)
        overrides.append(f"model.path={path.parent if path.suffix == '.json' else path}")
    cfg = load_config(args.config, overrides)  # no jax yet: it sizes the emulated devices
    try:
        _services(args, cfg)
    except _PlanError as e:
        print(f"splitrl plan: {e}", file=sys.stderr)
        return 2
    _jax_environment(args, cfg)
    from splitrl_app.planning import PlanError, format_reports, libtpu_installed, plan_run
    from splitrl_app.planning.targets import LIBTPU_MISSING

    if args.platform == "tpu" and not libtpu_installed():
        print(f"splitrl plan: {LIBTPU_MISSING}", file=sys.stderr)
        return 2
    try:
        # The policy's config.json (a reward model's own is read by its planner).
        model_config = (_model_config(args, cfg) if set(_services(args, cfg)) - {"reward"}
                        else None)
        targets = _targets(args, cfg)
    except (PlanError, _PlanError) as e:
        print(f"splitrl plan: {e}", file=sys.stderr)
        return 2
    reports, failures = [], []
    for service, target in targets.items():  # one service's failure keeps the other's report
        try:
            reports += plan_run(cfg, model_config, {service: target}, search=not args.no_search,
                                extrapolate_layers=args.extrapolate_layers)
        except (PlanError, ConfigError) as e:
            failures.append(f"{service}: {e}")
    if args.json:
        print(json.dumps([r.to_json() for r in reports], indent=2))
    elif reports:
        print(format_reports(reports))
    for failure in failures:
        print(f"splitrl plan: {failure}", file=sys.stderr)
    if failures:
        return 2
    return 0 if all(r.fits for r in reports) else 1
