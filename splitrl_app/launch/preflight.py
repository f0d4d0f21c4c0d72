"""What stops a local run before any service starts: a model path with no model, unusable data
(paths, fields, splits, prompts too long for the samplers), a run directory whose checkpoint
belongs to another config, a tracker that is not installed, a launch that cannot fit in the
host's memory."""

from __future__ import annotations

import os

from splitrl.config import Config
from splitrl_app.launch.console import say


def preflight(cfg: Config, memory_bytes: int | None = None) -> str | None:
    """What stops the run before any service starts: a model path with no model, unusable
    data, a run directory whose checkpoint belongs to another config, a tracker that cannot
    be used, a launch that cannot fit in memory (:func:`check_memory`, against
    ``memory_bytes``; default the host's)."""
    from splitrl.model_path import model_problem
    from trainer_service.resume import resume_problem
    from trainer_service.tracking import missing_trackers

    problem = model_problem(cfg.model.path)
    if problem is not None:
        return f"the model cannot be used: {problem}"
    problem = check_data(cfg)
    if problem is not None:
        return f"the data cannot be used: {problem}"
    problem = resume_problem(cfg)
    if problem is not None:
        return f"will not resume: {problem}"
    return missing_trackers(cfg.trainer.report_to) or check_memory(cfg, memory_bytes)


def check_data(cfg: Config) -> str | None:
    """The run's data as the trainer will load it (paths, fields, splits, prompt lengths),
    before any service starts: None if it loads, else why not. Prints what the prompt length
    check dropped or truncated; the trainer checks the lengths itself and acts on them."""
    import logging

    from splitrl.tokenizer import load_tokenizer
    from trainer_service.orchestration.data import PromptStream

    quiet = logging.getLogger("trainer_service.orchestration.prompt_length")
    level, quiet.level = quiet.level, logging.ERROR  # the summary below says it once
    try:
        tokenizer = load_tokenizer(cfg.model.path, cfg.model.tokenizer_class)
        stream = PromptStream.for_run(cfg, tokenizer=tokenizer)
    except (ValueError, OSError) as e:
        return str(e)
    finally:
        quiet.setLevel(level)
    for report in stream.length_reports.values():
        if report.too_long:
            ids = ", ".join(pid for pid, _ in report.too_long[:5])
            more = ", ..." if len(report.too_long) > 5 else ""
            print(f"data: {report.summary()} (data.long_prompt_policy={report.policy}): "
                  f"{ids}{more}", flush=True)
    return None


def check_memory(cfg: Config, memory_bytes: int | None = None) -> str | None:
    """The launch's processes, estimated (`splitrl_app.planning.estimate`: arithmetic on the
    model's config.json, no compile) against the host's memory, since every service of a local
    launch runs on this host's CPU: None when it fits; when it does not and
    ``trainer.micro_batch_size`` is unset, the largest micro-batch that fits is set in ``cfg``
    (and said); else why not, with the numbers and the setting to change. Services on an
    accelerator (``JAX_PLATFORMS`` other than cpu) or a model on a hub (no config.json here)
    are not estimated: ``splitrl plan`` compiles for them."""
    from splitrl_app.planning.estimate import ModelShape, host_memory_bytes, plan_launch

    if os.environ.get("JAX_PLATFORMS", "cpu") != "cpu":
        return None
    model = ModelShape.from_model_dir(cfg.model.path)
    if model is None:
        return None
    devices = {"trainer": cfg.trainer.mesh.devices_needed(),
               "sampler": cfg.sampler.mesh.devices_needed()}
    memory = host_memory_bytes() if memory_bytes is None else memory_bytes
    plan = plan_launch(cfg, model, devices, memory, _eval_prompts(cfg))
    configured, fitting = plan.configured, plan.fitting
    if configured.fits:
        return None
    if fitting is not None and cfg.trainer.micro_batch_size is None:
        cfg.trainer.micro_batch_size = fitting.micro_batch
        say(f"memory: trainer.micro_batch_size={fitting.micro_batch} chosen: the whole batch "
            f"at once ({configured.micro_batch} rows) would need {configured.describe()}; in "
            f"micro-batches of {fitting.micro_batch} rows the launch needs about "
            f"{fitting.total / 2**30:.2f} GiB (set trainer.micro_batch_size to choose)")
        return None
    if fitting is not None:
        return (f"out of memory: this launch would need {configured.describe()}. Set "
                f"trainer.micro_batch_size={fitting.micro_batch} (about "
                f"{fitting.total / 2**30:.2f} GiB) or smaller")
    return (f"out of memory: this launch would need {configured.describe()}, and does not fit "
            f"at the smallest micro-batch either. Use less memory with a smaller "
            f"sampler.max_batch_size or a sampler.kv_cache_bytes budget, fewer "
            f"services.num_samplers, a shorter sampler.max_sequence_length or "
            f"model.dtype=bfloat16")


def _eval_prompts(cfg: Config) -> int:
    """The prompts one evaluation sends at once (0 without evaluations): a sampler may get
    all of them, up to its batch."""
    t = cfg.trainer
    if t.data.eval_split is None or not (t.eval_before or t.eval_after or t.eval_every):
        return 0
    from trainer_service.orchestration.data import PromptStream

    try:
        return len(PromptStream.from_config(t.data).eval_rows())
    except (ValueError, OSError):  # check_data said it loads; the trainer reports otherwise
        return 0
