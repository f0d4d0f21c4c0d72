"""Configured reward functions + the worker pool: items in, per-function scores and totals out.

Items that share a ``group_id`` (a prompt's completions) are scored in one call of each
function, as TRL and EasyDeL call reward functions; an item without one is a call of its own.
A function entry named like a ``reward.models`` entry scores with that reward model
(``reward_models.py``), one named like a ``reward.judges`` entry with that judge
(``judges.py``): both are served in this process, alongside the workers' calls.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from reward_service.pool import WorkerPool
from reward_service.registry import FunctionSpec, RewardFunction, describe, resolve
from splitrl.config import RewardConfig
from splitrl.reward_protocol import RewardOutcome

log = logging.getLogger(__name__)


def group_items(items: Sequence[Item]) -> list[list[int]]:
    """Indices of the items scored together: one list per non-empty ``group_id`` (in order of
    first appearance, items in request order), one list per item without a group."""
    groups: dict[str, list[int]] = {}
    out: list[list[int]] = []
    for i, item in enumerate(items):
        if not item.group_id:
            out.append([i])
        elif item.group_id in groups:
            groups[item.group_id].append(i)
        else:
            groups[item.group_id] = [i]
            out.append(groups[item.group_id])
    return out


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
    columns: dict[str, Any] = field(default_factory=dict)  # dataset columns, typed
    prompt_messages: list[dict[str, str]] | None = None  # conversational prompt
    group_id: str = ""  # items of one prompt: scored in one call per function
    completion_ids: list[int] = field(default_factory=list)
    weight_version: int = 0
    # A multi-turn episode's conversation after the prompt (docs/environments.md); then
    # `completion` is its final assistant turn.
    completion_messages: list[dict[str, Any]] | None = None

    def payload(self) -> dict:
        return {"prompt": self.prompt, "completion": self.completion,
                "reference": self.reference, "completion_tokens": self.completion_tokens,
                "truncated": self.truncated, "metadata": dict(self.metadata),
                "columns": dict(self.columns), "prompt_messages": self.prompt_messages,
                "completion_ids": list(self.completion_ids),
                "weight_version": self.weight_version,
                "completion_messages": self.completion_messages}


@dataclass
class ItemResult:
    item_id: str
    scores: dict[str, float]
    total: float
    reasons: dict[str, str]  # for people
    statuses: dict[str, str]  # the worker pool's status of each call (metric labels)

    @property
    def outcomes(self) -> dict[str, RewardOutcome]:
        """How each call went, for the functions whose call was not an ordinary score."""
        outcomes = {name: OUTCOMES[status] for name, status in self.statuses.items()}
        return {name: o for name, o in outcomes.items() if o != RewardOutcome.SCORED}


# The worker pool's statuses (reward_service.pool.Outcome.status) as the wire's outcomes; a
# cancelled call's reply is never sent, and would not be a score.
OUTCOMES = {"ok": RewardOutcome.SCORED, "none": RewardOutcome.NO_SCORE,
            "error": RewardOutcome.ERROR, "nonfinite": RewardOutcome.NON_FINITE,
            "timeout": RewardOutcome.TIMEOUT, "cancelled": RewardOutcome.ERROR}


def specs_from_config(cfg: RewardConfig) -> list[FunctionSpec]:
    """The configured functions, checked: unique names, loadable, valid options."""
    return [spec for spec, _ in load_config_functions(cfg)]


def load_config_functions(cfg: RewardConfig
                          ) -> list[tuple[FunctionSpec, RewardFunction | None]]:
    """Each configured function's spec and loaded function (with its detected calling
    convention; None for a reward model's or judge's entry, which ``RewardScorer`` serves
    itself); ValueError naming the entry that is wrong."""
    served = {m.name: "reward model" for m in cfg.models} | {
        j.name: "judge" for j in cfg.judges}
    specs: list[tuple[FunctionSpec, RewardFunction | None]] = []
    seen = set()
    for i, f in enumerate(cfg.functions):
        if f.name in seen:
            raise ValueError(f"reward.functions[{i}].name: {f.name!r} is configured twice")
        seen.add(f.name)
        timeout = f.timeout_s if f.timeout_s is not None else cfg.timeout_s
        if timeout <= 0:
            raise ValueError(f"reward.functions[{i}].timeout_s: expected > 0, got {timeout}")
        if f.name in served:
            if f.options:
                raise ValueError(f"reward.functions[{i}].options: {f.name!r} is a "
                                 f"{served[f.name]}; its settings go in its own entry")
            specs.append((FunctionSpec(f.name, f.weight, float(timeout), {}), None))
            continue
        try:
            fn = resolve(f.name, f.options)
        except ValueError as e:
            raise ValueError(f"reward.functions[{i}]: {e}") from None
        specs.append((FunctionSpec(f.name, f.weight, float(timeout), dict(f.options)), fn))
    if not specs:
        raise ValueError("reward.functions: expected at least one reward function")
    return specs


class RewardScorer:
    """Scores items with the configured functions in isolated workers, and with the
    configured reward models and judges in this process."""

    def __init__(self, cfg: RewardConfig, *, start_method: str = "forkserver",
                 on_event: Callable[[str, str], None] | None = None):
        loaded = load_config_functions(cfg)
        self.specs = [spec for spec, _ in loaded]
        kinds = {m.name: "model" for m in cfg.models} | {j.name: "judge" for j in cfg.judges}
        self.styles = {spec.name: fn.signature.style if fn else kinds[spec.name]
                       for spec, fn in loaded}
        for spec, fn in loaded:
            log.info("reward function loaded", extra={
                "function": spec.name, "style": self.styles[spec.name],
                "signature": fn.signature.text if fn else "", "weight": spec.weight,
                "timeout_s": spec.timeout_s})
        self._index = {s.name: i for i, s in enumerate(self.specs)}
        pooled = [spec for spec, fn in loaded if fn is not None]
        self._pool_index = {spec.name: i for i, spec in enumerate(pooled)}
        # Workers first: the forkserver must start before JAX and gRPC create their threads.
        self.pool = WorkerPool(pooled, cfg.workers, kill_grace_s=cfg.kill_grace_s,
                               memory_mb=cfg.worker_memory_mb, start_method=start_method,
                               on_event=on_event) if pooled else None
        # Reward models and judges by name: each has score(payloads, cancelled) -> outcomes.
        self.served: dict[str, Any] = {}
        self._judge_loop = None
        try:
            if cfg.models:
                from reward_service.reward_models import RewardModel

                for m in cfg.models:
                    self.served[m.name] = RewardModel(m, cfg.mesh)
                    log.info("reward model loaded", extra={"model": m.name, "path": m.path})
            if cfg.judges:
                from reward_service.judges import Judge, JudgeLoop

                self._judge_loop = JudgeLoop()
                for j in cfg.judges:
                    self.served[j.name] = Judge(j, self._judge_loop.loop)
        except BaseException:
            self.close()
            raise
        self._served_calls = ThreadPoolExecutor(max(1, len(self.served)) * 4,
                                                thread_name_prefix="reward-served-call")

    def describe(self) -> list[tuple[FunctionSpec, str, str]]:
        """(spec, description, calling convention) of each configured function."""
        return [(s, self.served[s.name].description if s.name in self.served
                 else describe(s.name), self.styles[s.name]) for s in self.specs]

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
        payloads = [item.payload() for item in items]  # shared: pickled once per chunk
        outcome_of: dict[tuple[int, int], Any] = {}
        by_model = {fn: self._served_calls.submit(
                        self.served[self.specs[fn].name].score, payloads, cancelled)
                    for fn in chosen if self.specs[fn].name in self.served}
        pooled = [fn for fn in chosen if fn not in by_model]
        groups = group_items(items)
        tasks: list[tuple[int, list[dict[str, Any]]]] = []
        for members in groups:
            batch = [payloads[i] for i in members]
            tasks.extend((self._pool_index[self.specs[fn].name], batch) for fn in pooled)
        results_per_task = self.pool.score(tasks, cancelled) if tasks and self.pool else []
        for g, members in enumerate(groups):
            for k, fn in enumerate(pooled):
                for item_index, outcome in zip(members, results_per_task[g * len(pooled) + k],
                                               strict=True):
                    outcome_of[item_index, fn] = outcome
        for fn, future in by_model.items():
            for item_index, outcome in enumerate(future.result()):
                outcome_of[item_index, fn] = outcome
        results = []
        for n, item in enumerate(items):
            scores, reasons, statuses, total = {}, {}, {}, 0.0
            for fn in chosen:
                spec, outcome = self.specs[fn], outcome_of[n, fn]
                scores[spec.name] = outcome.score
                statuses[spec.name] = outcome.status
                total += spec.weight * outcome.score
                if outcome.reason:
                    reasons[spec.name] = outcome.reason
            results.append(ItemResult(item.item_id, scores, total, reasons, statuses))
        return results

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        for served in self.served.values():
            served.close()
        if self._judge_loop is not None:
            self._judge_loop.close()
        if hasattr(self, "_served_calls"):
            self._served_calls.shutdown(wait=False)
