"""The ``splitrl`` command.

Every service subcommand takes ``--config FILE`` (or the ``SPLITRL_CONFIG`` environment variable)
and any number of ``a.b.c=value`` overrides, so the same file drives the local launcher,
docker compose and Kubernetes. Service modules are imported lazily: ``splitrl health`` in a
container probe must not pay for importing JAX.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence

from splitrl.config import AuthConfig, Config, ConfigError, dump_config, load_config
from splitrl.platforms import prefer_cpu_without_tpu
from splitrl.user_code import add_config_dir
from splitrl_app import plan_command


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        default=os.environ.get("SPLITRL_CONFIG"),
        help="YAML config file (default: $SPLITRL_CONFIG, else built-in defaults)",
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. trainer.steps=5"
    )


def _add_resume_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--resume", choices=["check", "force"], default=None,
        help="a run dir with a checkpoint resumes only with the same model, algorithm and data "
             "(check, the default); force resumes whatever changed (trainer.resume)")


def _overrides(args: argparse.Namespace) -> list[str]:
    resume = getattr(args, "resume", None)
    return [*args.overrides, *([f"trainer.resume={resume}"] if resume else [])]


def _config(args: argparse.Namespace) -> Config:
    return load_config(args.config, _overrides(args))


def _call(target: str) -> Callable:
    module, func = target.split(":")
    return getattr(importlib.import_module(module), func)


def _service(target: str) -> Callable[[argparse.Namespace], int | None]:
    def run(args: argparse.Namespace) -> int | None:
        from splitrl import compile_lock
        from splitrl.serving import stop_with_launcher

        stop_with_launcher()
        compile_lock.install()  # a launch's services compile a program they share once
        return _call(target)(_config(args))

    return run


def _init_model(args: argparse.Namespace) -> int:
    from splitrl.init_model import init_model

    path = init_model(
        args.out,
        family=args.family,
        preset=args.preset,
        vocab=args.vocab,
        vocab_size=args.vocab_size,
        seed=args.seed,
        dtype=args.dtype,
        overwrite=args.overwrite,
        score_labels=args.score_labels,
    )
    kind = "reward model" if args.score_labels else "checkpoint"
    print(f"wrote a random {args.family} {kind} ({args.preset}) and tokenizer to {path}")
    return 0


def _health_auth(args: argparse.Namespace) -> AuthConfig:
    """``services.auth`` of ``--config`` (default $SPLITRL_CONFIG: a container's probe uses the
    credentials of the service it probes), with the --tls-* flags on top."""
    auth = load_config(args.config).services.auth if args.config else AuthConfig()
    flags = {"tls_ca": args.tls_ca, "tls_cert": args.tls_cert, "tls_key": args.tls_key,
             "tls_server_name": args.tls_server_name}
    return AuthConfig(**{**auth.model_dump(), **{k: v for k, v in flags.items() if v is not None}})


def _health(args: argparse.Namespace) -> int:
    """Exit 0 when SERVING, 1 when a server answered otherwise (or failed the call), 3 when
    nothing accepts connections at the address, 2 when the credentials cannot be read."""
    from splitrl.serving import UNREACHABLE, health_status

    try:
        status, detail = health_status(args.address, args.service, timeout_s=args.timeout,
                                       auth=_health_auth(args))
    except OSError as e:  # a token_file or certificate that is not there
        print(f"splitrl health: {e}", file=sys.stderr)
        return 2
    if status == UNREACHABLE:
        print(f"{status}: nothing accepts connections at {args.address} ({detail})")
        return 3
    print(status if not detail else f"{status}: {detail}")
    return 0 if status == "SERVING" else 1


def _show_config(args: argparse.Namespace) -> int:
    import json
    import tempfile

    if args.schema:
        from splitrl.config import json_schema

        print(json.dumps(json_schema(), indent=2))
        return 0
    cfg = _config(args)
    with tempfile.NamedTemporaryFile("r", suffix=".yaml") as f:
        dump_config(cfg, f.name)
        sys.stdout.write(open(f.name).read())
    return 0


def _demo(args: argparse.Namespace) -> int | None:
    from splitrl_app.launch.demo import demo, demo_config_path

    return demo(load_config(args.config or demo_config_path(), _overrides(args)))


def _list_rewards(args: argparse.Namespace) -> int:
    import inspect
    import textwrap

    from reward_service.registry import builtin_names, builtin_options, describe

    print("Built-in reward functions (reward.functions[].name; options go in .options):")
    names = builtin_names()
    indent = " " * (4 + max(map(len, names)))  # the longest name, then two spaces
    for name in names:
        options = [k if v is inspect.Parameter.empty else f"{k}={v!r}"
                   for k, v in builtin_options(name).items()]
        for text, first in ((describe(name), f"  {name}".ljust(len(indent))),
                            (f"options: {', '.join(options) or '(none)'}", indent)):
            print(textwrap.fill(text, 100, initial_indent=first, subsequent_indent=indent,
                                break_long_words=False, break_on_hyphens=False))
    print("\nYour own: name: 'module:function' (a module beside the config file, in the current")
    print("directory or installed), in any of")
    print("  TRL's      f(completions, **kwargs)   keywords: prompts, completions, completion_ids,")
    print("             trainer_state, reference and every dataset column")
    print("  EasyDeL's  f(prompts, completions, batch, **kwargs)")
    print("  ours       f(prompts, completions, references, **kwargs)")
    print("returning one float (or None) per completion. See docs/rewards.md.")
    if not args.config and not args.overrides:
        return 0
    from reward_service.scoring import load_config_functions

    cfg = _config(args)
    where = (args.config or "the default config") + (" + overrides" if args.overrides else "")
    print(f"\nConfigured (reward.functions) in {where}:")
    try:
        loaded = load_config_functions(cfg.reward)
    except ValueError as e:
        print(f"  cannot load: {e}", file=sys.stderr)
        return 2
    served = {m.name: f"reward model {m.path}" for m in cfg.reward.models} | {
        j.name: f"judge {j.model} at {j.base_url}" for j in cfg.reward.judges}
    for spec, fn in loaded:
        kind = fn.signature.describe() if fn else served[spec.name]
        print(f"  {spec.name}  weight {spec.weight:g}, timeout {spec.timeout_s:g} s, {kind}")
    return 0


def _list_tasks(args: argparse.Namespace) -> int:
    from splitrl.tasks import describe_task, list_tasks

    print("Tasks (trainer.data.task; options go in trainer.data.options, the data path in "
          "trainer.data.path):")
    for name in list_tasks():
        info = describe_task(name)
        print(f"\n  {name}: {info['description']}")
        options = [f"{k}={v!r}" for k, v in info["options"].items()]
        print(f"    options: {', '.join(options)}")
        splits = ", ".join(info["splits"]) or "train (one file) or train, test (a folder)"
        print(f"    splits: {splits}")
        print(f"    reward functions it is meant for: {', '.join(info['reward_functions'])}")
    print("\nSee docs/data.md (file layouts, columns, chat templates, prompt length).")
    return 0


def _list_environments(args: argparse.Namespace) -> int:
    import textwrap

    from splitrl.environments import ENVIRONMENTS, describe

    def show(name: str, options: dict) -> None:
        info = describe(name, options)
        print()
        print(textwrap.fill(f"{name}: {info.description}", 100, initial_indent="  ",
                            subsequent_indent="    "))
        for tool in info.tools:
            fn = tool["function"]
            params = ", ".join(fn["parameters"].get("properties", {}))
            print(textwrap.fill(f"{fn['name']}({params}): {fn.get('description', '')}", 100,
                                initial_indent="    tool ", subsequent_indent=" " * 9))

    print("Built-in environments (environment.name; options go in environment.options):")
    for name in sorted(ENVIRONMENTS):
        show(name, {})
    print("\nYour own: name: 'module:Class', written as TRL's environment_factory takes it: "
          "reset(**columns),\npublic methods with docstrings are the tools. See "
          "docs/environments.md.")
    if not args.config and not args.overrides:
        return 0
    env = _config(args).environment
    if env is None:
        print("\nConfigured: none (environment is not set: one completion per prompt)")
        return 0
    print("\nConfigured (environment):")
    try:
        show(env.name, env.options)
    except (ValueError, ImportError, TypeError) as e:
        print(f"  cannot load {env.name!r}: {e}", file=sys.stderr)
        return 2
    return 0


def _list(args: argparse.Namespace) -> int:
    return {"rewards": _list_rewards, "tasks": _list_tasks,
            "environments": _list_environments}[args.what](args)


def _audit(args: argparse.Namespace) -> int:
    from trainer_service.orchestration.audit import audit_run

    try:
        report = audit_run(args.run_dir)
    except FileNotFoundError as e:
        print(f"splitrl audit: {e}", file=sys.stderr)
        return 2
    print(f"run: {args.run_dir}")
    print("\n".join(report.lines()))
    return 0 if report.ok else 1


def _plot(args: argparse.Namespace) -> int:
    return _call("splitrl_app.plots:main")(args.run_dir)


def _export(args: argparse.Namespace) -> int:
    from trainer_service.learning.export import export_checkpoint

    try:
        out, step, _ = export_checkpoint(args.checkpoint, args.out, step=args.step,
                                         base_model=args.base_model)
    except (FileNotFoundError, ValueError) as e:
        print(f"splitrl export: {e}", file=sys.stderr)
        return 2
    print(f"exported the policy of step {step} to {out} (a Hugging Face directory)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splitrl",
        description="Disaggregated GRPO/GSPO post-training: sampler, reward and trainer services.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    services = {
        "sampler": ("sampler_service.server:main", "run a sampler service"),
        "reward": ("reward_service.server:main", "run the reward service"),
        "trainer": ("trainer_service.server:main", "run the trainer service"),
        "up": (
            "splitrl_app.launch.up:main",
            "start reward, samplers and trainer as local processes and run training",
        ),
    }
    for name, (target, help_text) in services.items():
        p = sub.add_parser(name, help=help_text)
        _add_config_args(p)
        if name in ("trainer", "up"):
            _add_resume_arg(p)
        p.set_defaults(func=_service(target))

    p = sub.add_parser(
        "demo", help="the built-in tiny run: create the model if missing, then `up` it"
    )
    _add_config_args(p)
    _add_resume_arg(p)
    p.set_defaults(func=_demo)

    p = sub.add_parser("config", help="print the resolved config (file + overrides), or with "
                       "--schema the JSON schema of a config file")
    _add_config_args(p)
    p.add_argument("--schema", action="store_true",
                   help="print the JSON schema of the config (for editors) and exit")
    p.set_defaults(func=_show_config)

    p = sub.add_parser("init-model", help="write a tiny random HF checkpoint and a tokenizer")
    p.add_argument("out", help="output directory")
    p.add_argument("--family", default="qwen2", choices=["llama", "qwen2", "qwen3"])
    p.add_argument("--preset", default="tiny", help="tiny | small | bench")
    p.add_argument(
        "--vocab",
        default="default",
        help="tokenizer training text: default (arithmetic + GSM8K), arithmetic, lookup (the "
             "tool task, with its tiny chat template), or a file",
    )
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--score-labels", type=int, default=0, metavar="N",
                   help="write a reward model: the family's sequence classifier with a random "
                   "score head of N labels (1: a scalar reward) instead of a causal LM")
    p.set_defaults(func=_init_model)

    p = sub.add_parser("health", help="standard gRPC health check; exit 0 when SERVING, 1 "
                       "when not, 3 when the address is unreachable")
    p.add_argument("address", help="host:port")
    p.add_argument("--service", default="", help="service name (default: the whole server)")
    p.add_argument("--timeout", type=float, default=3.0)
    p.add_argument(
        "--config",
        default=os.environ.get("SPLITRL_CONFIG"),
        help="YAML config whose services.auth (token, TLS) to use (default: $SPLITRL_CONFIG)",
    )
    p.add_argument("--tls-ca", default=None, help="CA certificate: check over TLS")
    p.add_argument("--tls-cert", default=None, help="client certificate (mutual TLS)")
    p.add_argument("--tls-key", default=None, help="client private key (mutual TLS)")
    p.add_argument("--tls-server-name", default=None,
                   help="name expected in the server's certificate (default: the host)")
    p.set_defaults(func=_health)

    p = sub.add_parser("list", help="built-in reward functions (and, with --config, the "
                       "configured ones and their calling style), tasks or environments")
    p.add_argument("what", choices=["rewards", "tasks", "environments"])
    _add_config_args(p)
    p.set_defaults(func=_list)

    p = sub.add_parser("eval", help="greedy accuracy and pass@k of a model or checkpoint, "
                       "through samplers it starts (or --sampler)")
    p.add_argument("target", metavar="MODEL_OR_CHECKPOINT",
                   help="a Hugging Face directory, or a run / checkpoints / step directory")
    _add_config_args(p)
    p.add_argument("--k", default="1,4,16",
                   help="comma-separated k of pass@k (default 1,4,16; empty: greedy only)")
    p.add_argument("--samples", type=int, default=None,
                   help="sampled completions per prompt for pass@k (default: the largest k)")
    p.add_argument("--sampler", action="append", metavar="HOST:PORT",
                   help="use this running sampler (repeatable) instead of starting services")
    p.add_argument("--limit", type=int, default=None, help="evaluate the first N prompts")
    p.add_argument("--out", default=None,
                   help="directory for eval.json, the services' logs and an exported checkpoint "
                        "(default: a new temporary directory)")
    p.set_defaults(func=lambda a: _call("splitrl_app.evaluate:main")(a))

    p = sub.add_parser("export", help="write a trainer checkpoint's policy as a Hugging Face "
                       "directory that transformers loads")
    p.add_argument("checkpoint", metavar="CHECKPOINT_DIR",
                   help="a run directory (its latest checkpoint), its checkpoints directory, or "
                        "one step's directory (runs/x/checkpoints/50)")
    p.add_argument("out", metavar="OUT", help="output directory")
    p.add_argument("--step", type=int, default=None, help="the step to export (default: latest)")
    p.add_argument("--base-model", default=None,
                   help="the model the run started from, if not at its model.path")
    p.set_defaults(func=_export)

    p = sub.add_parser("audit", help="account for every prompt a run drew: trained once, "
                       "filtered, dropped, unfinished; exit 1 if any was trained twice or lost")
    p.add_argument("run_dir")
    p.set_defaults(func=_audit)

    p = sub.add_parser("plot", help="draw a run's curves (reward, accuracy, KL, ...) to PNG")
    p.add_argument("run_dir")
    p.set_defaults(func=_plot)

    plan_command.add_parser(sub)

    p = sub.add_parser("k8s", help="render, apply, scale or inspect the Kubernetes deployment")
    p.add_argument("k8s_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=lambda a: _call("splitrl_app.k8s:main")(a.k8s_args))
    return parser


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Arguments, with ``a.b=c`` overrides accepted after options too (``splitrl eval MODEL
    --k 1,4 trainer.data.eval_size=10``: argparse alone takes positionals in one run)."""
    args, extra = parser.parse_known_args(argv)
    if extra and (not hasattr(args, "overrides")
                  or any(a.startswith("-") or "=" not in a for a in extra)):
        parser.parse_args(argv)  # argparse's own error for what it does not know
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    return _run(_parse(build_parser(), argv))


def _run(args: argparse.Namespace) -> int:
    if getattr(args, "config", None):  # user modules (module:function) beside the config
        add_config_dir(args.config)
    try:
        result = args.func(args)
    except ConfigError as e:
        print(f"splitrl: config error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return int(result or 0)


# Commands whose process has closed everything it owns when the command returns (checkpoints
# written, exports and metrics flushed, trackers finished, servers stopped, the services a
# launcher started waited for): the process then leaves without the interpreter's teardown
# (`splitrl.serving.exit_without_teardown`), which delays every `splitrl up`, which waits for
# each service.
NO_TEARDOWN = frozenset({"trainer", "sampler", "up", "demo"})


def entry() -> None:
    """The ``splitrl`` executable and ``python -m splitrl`` (the launcher starts services so).
    In-process callers use :func:`main`, which returns."""
    prefer_cpu_without_tpu()  # before anything imports jax: no TPU probe noise on a CPU machine
    # SplitRL runs its models in JAX: transformers' "PyTorch was not found. Models won't be
    # available" advice (`make demo` installs no torch) is about models it never asks for.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    args = _parse(build_parser(), None)
    code = _run(args)
    if args.command in NO_TEARDOWN:
        from splitrl.serving import exit_without_teardown

        exit_without_teardown(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
