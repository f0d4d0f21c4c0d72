"""The audit trail: which prompts each step trained on, filtered or dropped.

``trained_prompts.jsonl`` has one record per step of the run's final lineage::

    {"step": 7, "trainer_version": 6, "uids": [...], "versions": [...], "samplers": [...],
     "seeds": [...], "requests": [...], "filtered": [...], "dropped": [{"uid", "reason"}]}

``versions`` are the (oldest) weight versions each group was generated with, ``seeds`` and
``requests`` what is needed to replay a group (the noise seed of its prompt and the request
that carried it). A trainer that resumes from the checkpoint of step s moves the records of
steps after s (which the restarted run repeats) to ``trained_prompts.rolled_back.jsonl``, each
marked with the step it was rolled back to, so the main file lists every trained prompt of the
final lineage exactly once and the rolled-back work stays visible.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any

from trainer_service.orchestration.rollouts import RolloutGroup, WorkItem

TRAINED = "trained_prompts.jsonl"
ROLLED_BACK = "trained_prompts.rolled_back.jsonl"


class AuditLog:
    """Appends one record per step; rolls back to a checkpoint's step on resume."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / TRAINED
        self.rolled_back_path = Path(run_dir) / ROLLED_BACK
        self._file: IO[str] | None = None

    def record(self, step: int, trainer_version: int, groups: list[RolloutGroup], *,
               filtered: list[RolloutGroup] = (),
               dropped: list[tuple[WorkItem, str]] = ()) -> dict[str, Any]:
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
            self._file = self.path.open("a")
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        return record

    def roll_back_to(self, step: int) -> int:
        """Keep the records of steps <= ``step``; move later ones to the rolled-back file.
        Returns how many records moved."""
        if not self.path.exists():
            return 0
        keep, moved = [], []
        for line in self.path.read_text().splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            (keep if record["step"] <= step else moved).append(record)
        if moved:
            with self.rolled_back_path.open("a") as out:
                for record in moved:
                    out.write(json.dumps({**record, "rolled_back_to": step}) + "\n")
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
        tmp.replace(self.path)
        return len(moved)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_records(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
