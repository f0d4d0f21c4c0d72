"""The trainer's optax optimizer: AdamW with global-norm clipping and a warmup + decay schedule."""

from __future__ import annotations

import functools

import optax

from splitrl.config import OptimizerConfig


def make_schedule(cfg: OptimizerConfig, updates_per_step: int = 1) -> optax.Schedule:
    """Learning rate as a function of the optimizer's update count.

    Linear warmup from 0 to cfg.lr over `warmup_steps` train steps, then
      constant: cfg.lr
      linear:   cfg.lr -> 0 at `total_steps`
      cosine:   cfg.lr -> 0 at `total_steps` (half cosine)
    Steps are train steps; a train step makes `updates_per_step` optimizer updates (one per
    epoch over the batch), which all use that step's learning rate.
    """
    lr, warmup = cfg.lr, cfg.warmup_steps
    if cfg.schedule == "constant":
        decay = optax.constant_schedule(lr)
    else:
        if cfg.total_steps is None or cfg.total_steps <= warmup:
            raise ValueError(
                f"optimizer.schedule={cfg.schedule!r} needs optimizer.total_steps > warmup_steps "
                f"({warmup}); got {cfg.total_steps}"
            )
        decay_steps = cfg.total_steps - warmup
        if cfg.schedule == "linear":
            decay = optax.linear_schedule(lr, 0.0, decay_steps)
        elif cfg.schedule == "cosine":
            decay = optax.cosine_decay_schedule(lr, decay_steps)
        else:
            raise ValueError(f"unknown optimizer.schedule {cfg.schedule!r}")
    if warmup > 0:
        schedule = optax.join_schedules(
            [optax.linear_schedule(0.0, lr, warmup), decay], boundaries=[warmup]
        )
    else:
        schedule = decay
    if updates_per_step == 1:
        return schedule
    return lambda count: schedule(count // updates_per_step)


def make_optimizer(
    cfg: OptimizerConfig, updates_per_step: int = 1
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(clip_by_global_norm(max_grad_norm) -> adamw(schedule), schedule).

    Equal configs return the same objects, so jitted updates that take the transformation as
    a static argument are compiled once per configuration, not once per learner.
    """
    return _make_optimizer(tuple(cfg.model_dump().items()), updates_per_step)


@functools.lru_cache(maxsize=64)
def _make_optimizer(fields: tuple, updates_per_step: int):
    cfg = OptimizerConfig(**dict(fields))
    schedule = make_schedule(cfg, updates_per_step)
    parts = []
    if cfg.max_grad_norm is not None:
        parts.append(optax.clip_by_global_norm(cfg.max_grad_norm))
    parts.append(
        optax.adamw(
            schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay
        )
    )
    return optax.chain(*parts), schedule
