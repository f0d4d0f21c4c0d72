"""``splitrl eval MODEL_OR_CHECKPOINT``: greedy accuracy and pass@k of a model, through samplers.

MODEL_OR_CHECKPOINT is a Hugging Face directory (a run's ``export``, any checkpoint
``splitrl.models`` loads) or a trainer checkpoint (a run directory, its ``checkpoints``
directory or one step's directory), which is exported first (``splitrl export``).

The prompts are the evaluation split of the config's task (``trainer.data``; any task or data
files, with ``trainer.data.eval_split`` / ``eval_size``). Evaluation goes through the same path
as in a run: work items on the rollout queue's lanes, the dispatcher, samplers that score with
the reward service. So the greedy accuracy of a run's exported model is the run's own
``eval_after/accuracy`` (the eval lane's requests have a fixed composition; greedy decoding has
no noise). pass@k draws ``--samples`` completions per prompt with the config's sampling
settings; each prompt's noise is a function of ``trainer.seed`` and its uid.

Samplers: by default it starts a reward service and ``services.num_samplers`` samplers serving
the model, as ``splitrl up`` does (logs in ``--out``); ``--sampler HOST:PORT`` uses running
samplers instead, which must serve the model already.

The config: ``--config`` if given, else the checkpoint's own, else the ``config.yaml`` of the
run the model was exported by (``runs/x/export`` -> ``runs/x/config.yaml``), else the defaults;
overrides apply on top, and ``model.path`` is the model evaluated.
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
from pathlib import Path

from splitrl.auth import auth_metadata
from splitrl.config import Config, load_config, validate
from splitrl.retry import wait_until
from splitrl.tokenizer import load_tokenizer
from trainer_service.orchestration.dispatcher import Dispatcher, sampling_params
from trainer_service.orchestration.evaluation import (
    SAMPLED,
    accuracy_function,
    collect_lane,
    completion_records,
    eval_items,
    eval_metrics,
    pass_at_k_metrics,
    sampled_items,
    write_jsonl,
)
from trainer_service.orchestration.membership import SamplerPool
from trainer_service.orchestration.parts import lanes
from trainer_service.orchestration.queue import Lane, RolloutQueue
from trainer_service.orchestration.rollouts import EVAL


def resolve(target: str, config: str | None, overrides: list[str],
            out: Path) -> tuple[Path, Config]:
    """(the HF directory to evaluate, the config) for ``splitrl eval TARGET``."""
    path = Path(target)
    saved: dict | None = None
    if not (path / "config.json").is_file():  # a checkpoint: export it first
        from trainer_service.learning.export import export_checkpoint

        exported, step, ckpt_cfg = export_checkpoint(path, out / "model")
        print(f"exported the checkpoint of step {step} to {exported}", flush=True)
        path, saved = exported, ckpt_cfg.model_dump()
    elif config is None and (path.parent / "config.yaml").is_file():
        config = str(path.parent / "config.yaml")
        print(f"config: {config} (the run that exported {path})", flush=True)
    if config is not None or saved is None:
        cfg = load_config(config, overrides)
    else:
        from splitrl.config import merge_overrides

        cfg = validate(Config, merge_overrides(saved, overrides))
    data = cfg.model_dump()
    data["model"]["path"] = str(path)
    data["trainer"]["run_dir"] = str(out)
    data["sampler"]["register_with_trainer"] = False
    return path, validate(Config, data)


def samples_problem(samples: int, max_batch_size: int, where: str = "") -> str | None:
    """Why pass@k cannot draw ``samples`` completions per prompt from samplers whose batch is
    ``max_batch_size`` (None: it can). A prompt's completions are decoded together, in one
    sampler batch: a sampler refuses more, and the prompt would be missing from pass@k."""
    if samples <= max_batch_size:
        return None
    return (f"--samples {samples}: pass@k decodes a prompt's samples together, in one sampler "
            f"batch, but sampler.max_batch_size is {max_batch_size}{where}. Use --samples (and "
            f"--k) of at most {max_batch_size}, or sampler.max_batch_size={samples}")


def evaluate(cfg: Config, sampler_addresses: list[str], *, samples: int, ks: list[int],
             stop: threading.Event | None = None, timeout_s: float = 600.0,
             out: Path | None = None) -> dict[str, float]:
    """Greedy accuracy and (with ``samples`` > 0) pass@k on the config's evaluation rows,
    through the samplers at ``sampler_addresses``. With ``out``, what the model answered goes
    to ``out/eval_completions.jsonl`` (greedy) and ``out/sampled_completions.jsonl``
    (`completion_records`)."""
    from trainer_service.orchestration.data import PromptStream

    tokenizer = load_tokenizer(cfg.model.path, cfg.model.tokenizer_class)
    rows = PromptStream.for_run(cfg, tokenizer=tokenizer).eval_rows(cfg.trainer.data.eval_size)
    fn = accuracy_function(cfg)
    eval_lanes = [lane for lane in lanes(cfg) if lane.name == EVAL]
    if samples:
        per_request = max(1, cfg.sampler.max_batch_size // samples)
        eval_lanes.append(Lane(SAMPLED, samples, sampling_params(cfg.sampling),
                               request_size=per_request))
    queue = RolloutQueue(eval_lanes)
    services = cfg.services.model_copy(update={"sampler_addresses": sampler_addresses,
                                               "sampler_dns": None})
    pool = SamplerPool(services, max_message_bytes=2 * cfg.sampler.max_chunk_bytes + (1 << 20),
                       sync_joins=False)  # they serve what they serve: nothing is pushed
    dispatcher = Dispatcher(pool, queue, metadata=auth_metadata(cfg.services.auth),
                            rollout_timeout_s=cfg.trainer.rollout_timeout_s)
    pool.start()
    dispatcher.start()
    try:
        ready = wait_until(pool.ready, timeout_s=timeout_s, stop=stop,
                           what=f"a sampler of {sampler_addresses} ready")
        if samples:  # a sampler's batch can be smaller than configured (sampler.kv_cache_bytes)
            smallest = min(ready, key=lambda handle: handle.capacity)
            problem = samples_problem(samples, smallest.capacity,
                                      f" at the sampler {smallest.address} (its GetInfo)")
            if problem is not None:
                raise ValueError(problem)
        items = eval_items(rows)
        groups = collect_lane(queue, items, EVAL, stop=stop, check=pool.check_usable)
        result = eval_metrics(groups, fn, len(items))
        if out is not None:
            write_jsonl(out / "eval_completions.jsonl",
                        completion_records(groups, fn, tokenizer))
        if samples:
            groups = collect_lane(queue, sampled_items(rows, cfg.trainer.seed), SAMPLED,
                                  stop=stop, check=pool.check_usable)
            result.update({f"eval/{k}": v for k, v in pass_at_k_metrics(groups, fn, ks).items()})
            if out is not None:
                write_jsonl(out / "sampled_completions.jsonl",
                            completion_records(groups, fn, tokenizer))
    finally:
        dispatcher.stop()
        queue.close()
        pool.stop()
    return result


def report(result: dict[str, float], cfg: Config) -> list[str]:
    lines = [f"greedy accuracy: {result['eval/accuracy']:.3f} on "
             f"{int(result['eval/count'])} prompts ({cfg.trainer.data.task}, "
             f"{cfg.trainer.data.eval_split})"]
    if result.get("eval/dropped"):
        lines.append(f"  ({int(result['eval/dropped'])} prompts refused by the samplers)")
    passes = sorted((int(k.split("@")[1]), v) for k, v in result.items() if "pass@" in k)
    if passes:
        n = int(result["eval/samples_per_prompt"])
        lines.append(f"pass@k from {n} samples per prompt (temperature "
                     f"{cfg.sampling.temperature:g}; unbiased estimator): "
                     + ", ".join(f"pass@{k} {v:.3f}" for k, v in passes)
                     + f"; sampled accuracy {result['eval/sampled_accuracy']:.3f}")
    return lines


def main(args) -> int:
    from splitrl_app.launch.supervisor import Launcher

    ks = sorted({int(k) for k in args.k.split(",") if k.strip()})
    samples = args.samples if args.samples is not None else (max(ks) if ks else 0)
    if ks and (ks[0] < 1 or ks[-1] > samples):
        print(f"splitrl eval: --k expects values in [1, --samples = {samples}], got {ks}",
              file=sys.stderr)
        return 2
    out = Path(args.out or tempfile.mkdtemp(prefix="splitrl-eval-"))
    out.mkdir(parents=True, exist_ok=True)
    overrides = list(args.overrides)
    if args.limit is not None:
        overrides.append(f"trainer.data.eval_size={args.limit}")
    try:
        _, cfg = resolve(args.target, args.config, overrides, out)
    except (FileNotFoundError, ValueError) as e:
        print(f"splitrl eval: {e}", file=sys.stderr)
        return 2
    problem = samples_problem(samples, cfg.sampler.max_batch_size) if ks else None
    if problem is not None:
        print(f"splitrl eval: {problem}", file=sys.stderr)
        return 2
    launcher = None
    addresses = list(args.sampler or [])
    try:
        if not addresses:
            launcher = Launcher(cfg)
            print(f"starting a reward service and {cfg.services.num_samplers} sampler(s) for "
                  f"{cfg.model.path} (logs in {launcher.log_dir})", flush=True)
            launcher.start("reward", "reward", [])
            addresses = [launcher.start_sampler(i) for i in range(cfg.services.num_samplers)]
            launcher.wait_healthy("reward", launcher.reward_address)
            for i, address in enumerate(addresses):
                launcher.wait_healthy(f"sampler-{i}", address)
        result = evaluate(cfg, addresses, samples=samples if ks else 0, ks=ks, out=out)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError, ValueError) as e:
        print(f"splitrl eval: {e}", file=sys.stderr)
        return 1
    finally:
        if launcher is not None:
            launcher.stop()
    for line in report(result, cfg):
        print(line, flush=True)
    (out / "eval.json").write_text(json.dumps({"model": cfg.model.path, **result}, indent=2))
    print(f"results: {out / 'eval.json'}; what the model answered, per prompt: "
          f"{out / 'eval_completions.jsonl'}")
    return 0
