"""Rollout groups as the trainer sees them, and the buffer between dispatch and learning.

A *work item* is one prompt handed out for rollout; it keeps a ``uid`` (prompt id + epoch) for
its whole life, through sampler deaths, re-dispatch and staleness drops, so the trainer can
prove that every prompt of a run was trained on exactly once. A *group* is what came back:
the prompt's G completions with their sampler logprobs, rewards and the weight version that
generated them.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class WorkItem:
    """One prompt to roll out. ``row`` is the data pipeline's row (id, prompt, reference...)."""

    uid: str
    row: dict[str, Any]
    attempts: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"uid": self.uid, "row": self.row, "attempts": self.attempts}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> WorkItem:
        return cls(uid=d["uid"], row=d["row"], attempts=d.get("attempts", 0))


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    reward: float
    rewards: dict[str, float]
    finish_reason: str
    text: str = ""
    # Per reward function, why it scored what it did: "timeout", "error: ...", "no score
    # (None)" or the function's own explanation (splitrl.reward_protocol.classify_reason).
    reasons: dict[str, str] = field(default_factory=dict)


@dataclass
class RolloutGroup:
    item: WorkItem
    prompt_token_ids: list[int]
    completions: list[Completion]
    weight_version: int
    sampler_id: str
    generate_s: float = 0.0
    score_s: float = 0.0
    received_at: float = field(default_factory=time.monotonic)

    @property
    def rewards(self) -> np.ndarray:
        return np.array([c.reward for c in self.completions], dtype=np.float32)

    def zero_variance(self) -> bool:
        r = self.rewards
        return bool(r.size <= 1 or np.all(r == r[0]))


class RolloutBuffer:
    """Groups waiting to be trained on, with the staleness bound and dynamic sampling.

    ``take`` blocks until ``n`` usable groups are available. A group generated with weights
    older than ``current_version - max_staleness`` is dropped and its work item handed to
    ``on_requeue`` (it will be rolled out again with fresh weights; nothing is lost). With
    ``filter_zero_variance`` a group whose completions all scored the same carries no GRPO
    signal: it is dropped, counted and its prompt is considered done (DAPO's dynamic sampling
    over-samples to keep the batch full). A group whose uid was already taken is a duplicate
    (a re-dispatched prompt whose first sampler answered after all) and is discarded.
    """

    def __init__(self, on_requeue: Callable[[WorkItem], None]):
        self._groups: list[RolloutGroup] = []
        self._cond = threading.Condition()
        self._taken: set[str] = set()
        self._on_requeue = on_requeue
        self.counts: Counter[str] = Counter()
        self._closed = False

    def put(self, group: RolloutGroup) -> None:
        with self._cond:
            if group.item.uid in self._taken or any(
                g.item.uid == group.item.uid for g in self._groups
            ):
                self.counts["duplicate"] += 1
                return
            self._groups.append(group)
            self.counts["received"] += 1
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._groups)

    def pending_items(self) -> list[WorkItem]:
        """Work items whose groups arrived but were not yet trained on (for checkpoints)."""
        with self._cond:
            return [g.item for g in self._groups]

    def mark_taken(self, uids: list[str]) -> None:
        """Record uids trained on before a restart, so late duplicates are recognised."""
        with self._cond:
            self._taken.update(uids)

    def _sweep(self, current_version: int, max_staleness: int, filter_zero_variance: bool):
        keep = []
        for g in self._groups:
            if current_version - g.weight_version > max_staleness:
                self.counts["stale_dropped"] += 1
                self._on_requeue(g.item)
            elif filter_zero_variance and g.zero_variance():
                self.counts["zero_variance_filtered"] += 1
                self._taken.add(g.item.uid)
            else:
                keep.append(g)
        self._groups = keep

    def take(
        self,
        n: int,
        current_version: int,
        max_staleness: int,
        *,
        filter_zero_variance: bool = False,
        timeout_s: float | None = None,
        should_stop: Callable[[], bool] = lambda: False,
        while_waiting: Callable[[], None] = lambda: None,
    ) -> list[RolloutGroup]:
        """The ``n`` oldest usable groups; blocks until there are that many.

        ``while_waiting`` runs between waits (the trainer tops up the prompts in flight there,
        e.g. after groups were dropped as stale or filtered).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while True:
                self._sweep(current_version, max_staleness, filter_zero_variance)
                if len(self._groups) >= n:
                    self._groups.sort(key=lambda g: (g.weight_version, g.received_at))
                    batch, self._groups = self._groups[:n], self._groups[n:]
                    self._taken.update(g.item.uid for g in batch)
                    self.counts["taken"] += len(batch)
                    return batch
                if self._closed or should_stop():
                    raise InterruptedError("rollout buffer closed while waiting for groups")
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"waited {timeout_s:.0f}s for {n} rollout groups, have {len(self._groups)}"
                    )
                self._cond.wait(timeout=0.5)
                while_waiting()
