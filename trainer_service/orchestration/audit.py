"""The audit trail: which prompts each step trained on, filtered or dropped.

``trained_prompts.jsonl`` has one record per step of the run's final lineage::

    {"step": 7, "trainer_version": 6, "uids": [...], "versions": [...], "samplers": [...],
     "seeds": [...], "requests": [...], "filtered": [...], "dropped": [{"uid", "reason"}]}

``trainer_version`` is the weight version the step trained from (the updates before it: a step
with nothing to train on leaves it for the next), ``versions`` the (oldest) weight versions
each group was generated with, ``seeds`` and ``requests`` what is needed to replay a group (the
noise seed of its prompt and the request that carried it). A trainer that resumes from the
checkpoint of step s moves the records of steps after s (which the restarted run repeats) to
``trained_prompts.rolled_back.jsonl``, each marked with the step it was rolled back to, so the
main file lists every trained prompt of the final lineage exactly once and the rolled-back work
stays visible.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitrl.jsonl import JsonlAppender, read_jsonl
from trainer_service.orchestration.rollouts import RolloutGroup, WorkItem

TRAINED = "trained_prompts.jsonl"
ROLLED_BACK = "trained_prompts.rolled_back.jsonl"


class AuditLog:
    """Appends one record per step; rolls back to a checkpoint's step on resume."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / TRAINED
        self.rolled_back_path = Path(run_dir) / ROLLED_BACK
        self._file: JsonlAppender | None = None

    def record(self, step: int, trainer_version: int, groups: list[RolloutGroup], *,
               filtered: Sequence[RolloutGroup] = (),
               dropped: Sequence[tuple[WorkItem, str]] = ()) -> dict[str, Any]:
        record = {
            "step": step,
            "trainer_version": trainer_version,
            "uids": [g.item.uid for g in groups],
            "versions": [g.weight_version for g in groups],
            "samplers": [g.sampler_id for g in groups],
            "seeds": [g.item.seed for g in groups],
            "requests": [g.request_id for g in groups],
            "filtered": [g.item.uid for g in filtered],
            "dropped": [{"uid": item.uid, "reason": reason} for item, reason in dropped],
        }
        if self._file is None:
            self._file = JsonlAppender(self.path)
        self._file.write(record)
        return record

    def roll_back_to(self, step: int) -> int:
        """Keep the records of steps <= ``step``; move later ones to the rolled-back file.
        Returns how many records moved."""
        self.close()  # the file is replaced below: later records go to the new one
        if not self.path.exists():
            return 0
        keep: list[dict[str, Any]] = []
        moved: list[dict[str, Any]] = []
        for record in read_jsonl(self.path):
            (keep if record["step"] <= step else moved).append(record)
        if moved:
            out = JsonlAppender(self.rolled_back_path)
            try:
                for record in moved:
                    out.write({**record, "rolled_back_to": step})
            finally:
                out.close()
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
        tmp.replace(self.path)
        return len(moved)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


@dataclass
class AuditReport:
    """What ``splitrl audit RUN_DIR`` prints: every drawn prompt accounted for, or not."""

    steps: list[int]
    rolled_back: int
    checkpoint_step: int | None
    drawn: int
    trained: int
    filtered: int
    dropped: int
    unfinished: int
    twice: list[str]
    lost: list[int]

    @property
    def ok(self) -> bool:
        return not self.twice and not self.lost

    def lines(self) -> list[str]:
        steps = (f"{len(self.steps)} ({self.steps[0]}-{self.steps[-1]})" if self.steps
                 else "none")
        checkpoint = ("no checkpoint" if self.checkpoint_step is None
                      else f"the last checkpoint, step {self.checkpoint_step}")
        return [
            f"steps recorded: {steps}; rolled back and repeated: {self.rolled_back} record(s)",
            f"drawn (by {checkpoint}): {self.drawn}",
            f"trained: {self.trained}  filtered: {self.filtered}  dropped: {self.dropped}  "
            f"unfinished at the checkpoint: {self.unfinished}",
            f"trained twice: {len(self.twice)}" + (f" e.g. {self.twice[:5]}" if self.twice
                                                   else ""),
            f"lost: {len(self.lost)}" + (f" e.g. draw numbers {self.lost[:5]}" if self.lost
                                         else ""),
        ]


def audit_run(run_dir: str | Path) -> AuditReport:
    """Account for every prompt a run drew, across restarts: trained, filtered (dynamic
    sampling), dropped (refused twice) or still unfinished at the last checkpoint, once each.

    ``drawn`` is the draw count saved with the last checkpoint, the point a resume continues
    from (prompts drawn after it are drawn again by a resume, so they are not lost)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"no run directory at {run_dir}")
    records = read_jsonl(run_dir / TRAINED)
    rolled_back = read_jsonl(run_dir / ROLLED_BACK)
    step, cursor = _last_checkpoint(run_dir)
    trained = [u for r in records for u in r["uids"]]
    filtered = [u for r in records for u in r.get("filtered", [])]
    dropped = [d["uid"] for r in records for d in r.get("dropped", [])]
    unfinished = [item["uid"] for item in (cursor or {}).get("unfinished", [])]
    done = trained + filtered + dropped
    counts: dict[str, int] = {}
    for uid in done:
        counts[uid] = counts.get(uid, 0) + 1
    twice = sorted(u for u, n in counts.items() if n > 1)
    drawn = int((cursor or {}).get("drawn", 0))
    accounted = {_draw_number(u) for u in done + unfinished}
    lost = [n for n in range(drawn) if n not in accounted]
    return AuditReport([r["step"] for r in records], len(rolled_back), step, drawn,
                       len(trained), len(filtered), len(dropped), len(unfinished), twice, lost)


def _draw_number(uid: str) -> int:
    return int(uid.rsplit("#", 1)[1])


def _last_checkpoint(run_dir: Path) -> tuple[int | None, dict | None]:
    """(step, data cursor) of the newest complete checkpoint whose JSON metadata reads (no JAX
    needed; a trainer resuming skips an unreadable step the same way). Checkpoints live in
    <run_dir>/checkpoints unless the run's config.yaml names another directory."""
    directory = run_dir / "checkpoints"
    config = run_dir / "config.yaml"
    if config.exists():
        import yaml

        configured = (yaml.safe_load(config.read_text()) or {}).get("trainer", {}) \
            .get("checkpoint", {}).get("dir")
        if configured:
            directory = Path(configured)
    steps = sorted((int(p.name) for p in directory.glob("*") if p.name.isdigit()
                    and (p / "meta" / "metadata").exists()), reverse=True) \
        if directory.is_dir() else []
    for step in steps:
        try:
            meta = json.loads((directory / str(step) / "meta" / "metadata").read_text())
            return int(meta["step"]), meta.get("data_cursor")
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None, None
