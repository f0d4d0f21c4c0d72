"""Configured reward functions + the worker pool: items in, per-function scores and totals out."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from reward_service.pool import WorkerPool
from reward_service.registry import FunctionSpec, describe, resolve
from splitrl.config import RewardConfig


class RequestError(ValueError):
    """A request names an unknown function or is otherwise malformed (names the field)."""


@dataclass
class Item:
    """One completion to score."""

    prompt: str = ""
    completion: str = ""
    reference: str = ""
    completion_tokens: int = 0
    truncated: bool = False
    metadata: dict[str, str] = field(default_factory=dict)
    item_id: str = ""

    def payload(self) -> dict:
        return {"prompt": self.prompt, "completion": self.completion,
                "reference": self.reference, "completion_tokens": self.completion_tokens,
                "truncated": self.truncated, "metadata": dict(self.metadata)}


@dataclass
class ItemResult:
    item_id: str
    scores: dict[str, float]
    total: float
    reasons: dict[str, str]
    statuses: dict[str, str]


def specs_from_config(cfg: RewardConfig) -> list[FunctionSpec]:
    """The configured functions, checked: unique names, loadable, valid options."""
    specs, seen = [], set()
    for i, f in enumerate(cfg.functions):
        if f.name in seen:
            raise ValueError(f"reward.functions[{i}].name: {f.name!r} is configured twice")
        seen.add(f.name)
        timeout = f.timeout_s if f.timeout_s is not None else cfg.timeout_s
        if timeout <= 0:
            raise ValueError(f"reward.functions[{i}].timeout_s: expected > 0, got {timeout}")
        try:
            resolve(f.name, f.options)
        except ValueError as e:
            raise ValueError(f"reward.functions[{i}]: {e}") from None
        specs.append(FunctionSpec(f.name, f.weight, float(timeout), dict(f.options)))
    if not specs:
        raise ValueError("reward.functions: expected at least one reward function")
    return specs


class RewardScorer:
    """Scores items with the configured functions in isolated workers."""

    def __init__(self, cfg: RewardConfig, *, start_method: str = "forkserver",
                 on_event: Callable[[str, str], None] | None = None):
        self.specs = specs_from_config(cfg)
        self._index = {s.name: i for i, s in enumerate(self.specs)}
        self.pool = WorkerPool(self.specs, cfg.workers, kill_grace_s=cfg.kill_grace_s,
                               memory_mb=cfg.worker_memory_mb, start_method=start_method,
                               on_event=on_event)

    def describe(self) -> list[tuple[FunctionSpec, str]]:
        return [(s, describe(s.name)) for s in self.specs]

    def select(self, names: Sequence[str]) -> list[int]:
        """Indices of the requested functions (all configured ones when ``names`` is empty)."""
        if not names:
            return list(range(len(self.specs)))
        chosen = []
        for i, name in enumerate(names):
            if name not in self._index:
                raise RequestError(f"functions[{i}]: unknown reward function {name!r} "
                                   f"(configured: {', '.join(self._index)})")
            if self._index[name] in chosen:
                raise RequestError(f"functions[{i}]: {name!r} is requested twice")
            chosen.append(self._index[name])
        return chosen

    def score(self, items: Sequence[Item], functions: Sequence[str] = (),
              cancelled: Callable[[], bool] | None = None) -> list[ItemResult]:
        chosen = self.select(functions)
        tasks = []
        for item in items:
            payload = item.payload()  # shared by the item's tasks: pickled once per chunk
            tasks.extend((fn, payload) for fn in chosen)
        outcomes = self.pool.score(tasks, cancelled)
        results = []
        for n, item in enumerate(items):
            scores, reasons, statuses, total = {}, {}, {}, 0.0
            for k, fn in enumerate(chosen):
                spec, outcome = self.specs[fn], outcomes[n * len(chosen) + k]
                scores[spec.name] = outcome.score
                statuses[spec.name] = outcome.status
                total += spec.weight * outcome.score
                if outcome.reason:
                    reasons[spec.name] = outcome.reason
            results.append(ItemResult(item.item_id, scores, total, reasons, statuses))
        return results

    def close(self) -> None:
        self.pool.close()
