"""Work items and rollout groups as the trainer sees them.

A *work item* is one prompt handed out for rollout. It keeps, for its whole life (through
sampler deaths, re-dispatch, staleness drops and trainer restarts):

- ``uid``: prompt id + draw number, unique in a run (what the audit counts);
- ``seq``: its draw number, the run's deterministic order (batches are assembled by it);
- ``seed``: the noise of its completions, a function of the run seed and the uid alone
  (:func:`item_seed`), so a sample does not depend on which request or sampler carried it.

A *group* is what came back: the prompt's G completions with their sampler logprobs, rewards
and the weight versions that generated them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from splitrl.reward_protocol import RewardOutcome

TRAIN, EVAL = "train", "eval"


def item_seed(run_seed: int, uid: str) -> int:
    """The 63-bit noise seed of work item ``uid`` in a run seeded ``run_seed``."""
    digest = hashlib.sha256(f"{int(run_seed)}\x00{uid}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@dataclass
class WorkItem:
    """One prompt to roll out. ``row`` is the data pipeline's row (id, prompt, reference...)."""

    uid: str
    row: dict[str, Any]
    seq: int = 0
    seed: int = 0
    lane: str = TRAIN
    attempts: int = 0  # times it was handed out again after a failure or a staleness drop
    refusals: int = 0  # times a sampler refused it as invalid (dropped at the second)
    # A reproducible lane's request unit: the draw number of the unit's first item. Saved with
    # a checkpoint so a resumed run sends the same requests (None: not cut into a unit yet).
    unit: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"uid": self.uid, "row": self.row, "seq": self.seq, "seed": self.seed,
                "lane": self.lane, "attempts": self.attempts, "refusals": self.refusals,
                "unit": self.unit}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> WorkItem:
        return cls(uid=d["uid"], row=d["row"], seq=int(d["seq"]), seed=int(d["seed"]),
                   lane=d["lane"], attempts=int(d["attempts"]), refusals=int(d["refusals"]),
                   unit=None if d["unit"] is None else int(d["unit"]))


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    reward: float
    rewards: dict[str, float]
    finish_reason: str
    text: str = ""
    # Per reward function, why it scored what it did, for people: "timeout", "error: ...",
    # "no score (None)" or the function's own explanation.
    reasons: dict[str, str] = field(default_factory=dict)
    # Per reward function whose call was not an ordinary score: how it went (decisions read
    # this, never the reasons).
    outcomes: dict[str, RewardOutcome] = field(default_factory=dict)
    # The weight versions it was generated under, oldest first (several when the sampler
    # applied a push between its tokens).
    weight_versions: list[int] = field(default_factory=list)
    # A multi-turn episode: per token, True where the model generated it, False on the
    # observation tokens the environment inserted (masked out of the loss). None: every token
    # is the model's.
    model_token_mask: list[bool] | None = None
    # Per turn: generated and observation token counts and the statuses of its tool calls.
    turns: list[dict[str, Any]] = field(default_factory=list)
    episode_end: str = ""  # why an episode ended ("" for a single-turn completion)


@dataclass
class RolloutGroup:
    item: WorkItem
    prompt_token_ids: list[int]
    completions: list[Completion]
    weight_version: int  # the oldest version any of its tokens was generated with
    sampler_id: str
    request_id: str = ""
    generate_s: float = 0.0
    score_s: float = 0.0

    @property
    def rewards(self) -> np.ndarray:
        return np.array([c.reward for c in self.completions], dtype=np.float32)

    def zero_variance(self) -> bool:
        """Every completion scored exactly the same: no GRPO signal (advantages are 0)."""
        r = self.rewards
        return bool(r.size <= 1 or np.all(r == r[0]))
