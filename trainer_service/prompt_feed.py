"""The run's prompts: drawn from the data into the rollout queue, and a step's groups taken
back out of it.

Every drawn prompt becomes a work item whose ``seq`` is its draw number and whose seed is a
function of ``trainer.seed`` and its uid, so a run is a function of its config and seed. The
queue keeps ``1 + trainer.max_staleness`` steps of prompts outstanding (never beyond the last
step); a step whose prompts were filtered (dynamic sampling) or dropped (refused twice) draws
replacements, at most ``algorithm.max_extra_draws`` per step.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from splitrl.config import Config
from trainer_service.orchestration.data import PromptStream
from trainer_service.orchestration.queue import RolloutQueue
from trainer_service.orchestration.rollouts import TRAIN, RolloutGroup, WorkItem, item_seed

log = logging.getLogger(__name__)


@dataclass
class Collected:
    """One step's rollouts: the groups to train on and what became done without training."""

    groups: list[RolloutGroup]
    filtered: list[RolloutGroup] = field(default_factory=list)
    dropped: list[tuple[WorkItem, str]] = field(default_factory=list)
    extra_draws: int = 0
    short: bool = False  # the extra-draw bound or the end of the data left the batch short


class PromptFeed:
    """Draws prompts from ``data`` into ``queue`` and collects a step's groups. Owns the
    data position a checkpoint saves (:meth:`cursor`): the stream's cursor, ``drawn`` (the
    prompts drawn so far: every work item's seq and uid) and the prompts drawn but not yet
    trained on."""

    def __init__(self, cfg: Config, data: PromptStream, queue: RolloutQueue,
                 stop: threading.Event, check: Callable[[], None] | None = None):
        """``check`` runs while a step waits for its groups and may raise to give up
        (``SamplerPool.check_usable``: no sampler left)."""
        self.cfg = cfg
        self.data = data
        self.queue = queue
        self.stop = stop
        self.check = check
        self.drawn = 0

    def draw(self, count: int) -> int:
        """Draw ``count`` prompts from the data into the queue; returns how many there were."""
        if count <= 0:
            return 0
        rows = self.data.next_batch(count)
        items = []
        for row in rows:
            uid = f"{row['prompt_id']}#{self.drawn}"
            items.append(WorkItem(uid=uid, row=row, seq=self.drawn,
                                  seed=item_seed(self.cfg.trainer.seed, uid)))
            self.drawn += 1
        self.queue.add(items)
        return len(rows)

    def draw_ahead(self, step: int) -> None:
        """After ``step`` steps: keep (1 + max_staleness) steps of prompts outstanding, none
        beyond the last step."""
        tcfg = self.cfg.trainer
        steps = min(1 + tcfg.max_staleness, tcfg.steps - step)
        self.draw(steps * tcfg.prompts_per_step - self.queue.outstanding(TRAIN))

    def collect(self, n: int, step: int) -> Collected:
        """``n`` groups to train on in step ``step + 1``, earliest drawn first. Prompts that
        were filtered (dynamic sampling) or dropped (refused twice) are replaced by new draws,
        at most ``algorithm.max_extra_draws`` per step; past that, or at the end of the data,
        the step trains on what it has."""
        algorithm = self.cfg.algorithm
        limit = algorithm.max_extra_draws
        if limit is None:
            limit = 3 * self.cfg.trainer.prompts_per_step
        out = Collected([])
        self.draw_ahead(step)
        while True:
            taken = self.queue.take(TRAIN, n, stop=self.stop, check=self.check)
            if taken.groups:
                out.groups = taken.groups
                break
            drawn = self.draw(min(taken.shortfall, limit - out.extra_draws))
            out.extra_draws += drawn
            if drawn < taken.shortfall:
                if not out.short:
                    log.warning("step %d is short: %s", step + 1,
                                "the data is used up" if self.data.exhausted else
                                f"algorithm.max_extra_draws ({limit}) reached",
                                extra={"extra_draws": out.extra_draws})
                out.short = True
                n -= taken.shortfall - drawn
                if n <= 0:
                    break
        # Drained once the step has its groups: until then a stop leaves the filtered and
        # dropped items in the queue, where the checkpoint's snapshot finds them.
        events = self.queue.drain_events(TRAIN)
        out.filtered, out.dropped = events.filtered, events.dropped
        for item, reason in events.dropped:
            log.warning("prompt dropped: a sampler refused it twice",
                        extra={"uid": item.uid, "reason": reason})
        return out

    def cursor(self, holding: Collected | None = None) -> dict:
        """The data position for a checkpoint: the stream's cursor, the prompts drawn, and the
        unfinished ones (queued, in flight or buffered, and ``holding``: a step's rollouts
        taken from the queue and not yet in the audit trail), earliest drawn first."""
        unfinished = self.queue.unfinished(TRAIN)
        if holding is not None:
            unfinished = sorted(unfinished + [g.item for g in holding.groups + holding.filtered]
                                + [item for item, _ in holding.dropped], key=lambda i: i.seq)
        return {
            "stream": self.data.state_dict(),
            "drawn": self.drawn,
            "unfinished": [i.to_json() for i in unfinished],
        }

    def restore(self, cursor: dict) -> int:
        """Back to a checkpoint's data position: the stream's cursor and the prompts drawn,
        the unfinished prompts queued first; returns how many were queued again."""
        self.data.load_state_dict(cursor["stream"])
        self.drawn = int(cursor["drawn"])
        unfinished = [WorkItem.from_json(d) for d in cursor["unfinished"]]
        self.queue.add(sorted(unfinished, key=lambda i: i.seq))
        return len(unfinished)
