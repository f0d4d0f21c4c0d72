"""Explicit resume: a run directory with a checkpoint continues only the run that made it.

Starting a run in a directory that holds a checkpoint resumes from it. That is what a person
wants after a crash or a Ctrl-C, and never what they want after changing the loss or the data:
the run would silently go on from weights trained by another recipe. So the config saved in the
checkpoint is compared with the new one on what a resume keeps (:data:`RESUME_KEYS`: the model,
the algorithm, sampling, the reward functions, the data and the optimizer, the seed and the
batch shape); any difference refuses the start, naming each key. Everything else may change
between the two starts: more ``trainer.steps``, another mesh or number of samplers, checkpoint
and logging cadence, evaluation, trackers, addresses.

``trainer.resume: force`` (``--resume force``) resumes whatever differs (with a warning that
lists it); a new ``trainer.run_dir`` starts afresh.
"""

from __future__ import annotations

import logging
from typing import Any

from splitrl.config import Config, ConfigError, to_dict, validate

log = logging.getLogger(__name__)

RESUME_KEYS = (
    "model.path", "model.dtype",
    "algorithm",
    "sampling.temperature", "sampling.top_k", "sampling.top_p", "sampling.max_new_tokens",
    "sampling.stop_token_ids",
    "reward.functions", "reward.accuracy_function",
    "trainer.data", "trainer.optimizer", "trainer.seed", "trainer.prompts_per_step",
    "trainer.epochs_per_batch", "trainer.max_staleness",
)


class ResumeRefused(ValueError):
    """The run directory's checkpoint was made by a run with a different config."""


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: tree}


def _kept(flat: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in flat.items()
            if any(k == key or k.startswith(key + ".") for key in RESUME_KEYS)}


def config_differences(saved: dict[str, Any], current: Config) -> list[tuple[str, Any, Any]]:
    """(key, saved value, new value) for every key of :data:`RESUME_KEYS` that differs. The
    saved config is read with today's defaults for keys it predates."""
    try:
        saved_tree = to_dict(validate(Config, saved))
    except ConfigError:  # a key that no longer exists: compare what both have
        saved_tree = saved
    old, new = _kept(_flatten(saved_tree)), _kept(_flatten(to_dict(current)))
    return [(key, old.get(key), new.get(key)) for key in sorted(old.keys() | new.keys())
            if old.get(key) != new.get(key)]


def check_resume(cfg: Config, meta: dict[str, Any], where: str) -> None:
    """Raise :class:`ResumeRefused` if the checkpoint described by ``meta`` (its JSON metadata,
    saved in ``where``) belongs to a run with another config, unless ``trainer.resume`` is
    "force"."""
    saved = meta.get("config")
    step = meta.get("step")
    if not saved:
        log.warning("the checkpoint holds no config: resuming without checking it",
                    extra={"checkpoint_dir": where, "step": step})
        return
    differences = config_differences(saved, cfg)
    if not differences:
        return
    lines = [f"  {key}: {old!r} -> {new!r}" for key, old, new in differences]
    if cfg.trainer.resume == "force":
        changed = "; ".join(line.strip() for line in lines)
        log.warning(f"resuming {where} from step {step} with a different config "
                    f"(trainer.resume=force): {changed}",
                    extra={"step": step, "differences": [line.strip() for line in lines],
                           "console": True})  # on splitrl up's console, not only in the log
        return
    raise ResumeRefused(
        f"{where} holds a checkpoint at step {step} of a run with a different config:\n"
        + "\n".join(lines)
        + "\nTo continue from it anyway: --resume force (trainer.resume=force). To start afresh: "
        "another trainer.run_dir (or remove that directory).")


def resume_problem(cfg: Config) -> str | None:
    """Why the run's directory cannot be resumed with ``cfg`` (None: it can, or there is no
    checkpoint), checked before any service starts."""
    from pathlib import Path

    if cfg.trainer.resume == "force":
        return None  # nothing is refused; the trainer lists what changed when it resumes
    ckpt_cfg = cfg.trainer.checkpoint
    directory = Path(ckpt_cfg.dir or Path(cfg.trainer.run_dir) / "checkpoints")
    if not directory.is_dir():
        return None  # a new run: no jax or orbax in the launcher (bench/startup_tricks.py)
    from trainer_service.learning.checkpoints import Checkpointer

    checkpointer = Checkpointer.from_config(ckpt_cfg, cfg.trainer.run_dir)
    try:
        meta = checkpointer.newest_readable_meta()  # the trainer skips unreadable steps too
        if meta is None:
            return None
        check_resume(cfg, meta, str(cfg.trainer.run_dir))
    except ResumeRefused as e:
        return str(e)
    finally:
        checkpointer.close()
    return None
