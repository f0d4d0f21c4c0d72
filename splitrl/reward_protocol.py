"""What the trainer, the samplers and the reward service agree on about reward functions.

- **Reserved keywords**: the argument names the reward service passes itself. A dataset column
  or metadata key may not use one (it would be shadowed); the trainer refuses such data when it
  loads it, the reward service refuses such a request with INVALID_ARGUMENT.
- **Columns** travel as one JSON object per prompt (``Prompt.columns_json``,
  ``ScoreItem.columns_json``), so that a column keeps its type (an int stays an int, a list a
  list) on its way from the dataset to the reward functions. A value JSON cannot hold (a date,
  bytes) travels as its ``str``.
- **Outcomes** (``ItemScore.outcomes``, ``Completion.reward_outcomes``): how each function's
  call went for a completion, a :class:`RewardOutcome` (absent: an ordinary score). Decisions
  (the trainer's reward error policy) read the outcome.
- **Reasons** (``ItemScore.reasons``, ``Completion.reward_reasons``): the same, for people:
  ``"timeout"``, ``"error: ..."``, ``"non-finite score: ..."``, ``"no score (None)"`` or the
  function's own explanation of its score. Shown and logged, never parsed.
"""

from __future__ import annotations

import enum
import json
import math
from typing import Any

from splitrl.v1 import common_pb2

TIMEOUT = "timeout"
ERROR_PREFIX = "error: "
NONFINITE_PREFIX = "non-finite score: "
NO_SCORE = "no score (None)"

# Keyword arguments the reward service passes in some calling convention (see
# reward_service/conventions.py); columns and metadata may not use these names.
RESERVED_KEYWORDS = frozenset({
    "prompts", "completions", "references", "reference", "completion_ids", "completions_ids",
    "completion_tokens", "truncated", "trainer_state", "batch", "prompt_messages",
})


class RewardOutcome(enum.IntEnum):
    """How one reward function's call went for one completion: the wire's ``RewardOutcome``
    (its numbers come from the proto). Every outcome but ``SCORED`` scores 0."""

    SCORED = common_pb2.REWARD_OUTCOME_SCORED
    NO_SCORE = common_pb2.REWARD_OUTCOME_NO_SCORE  # declined to score (TRL's None)
    ERROR = common_pb2.REWARD_OUTCOME_ERROR
    NON_FINITE = common_pb2.REWARD_OUTCOME_NON_FINITE
    TIMEOUT = common_pb2.REWARD_OUTCOME_TIMEOUT

    @classmethod
    def from_wire(cls, value: int) -> RewardOutcome:
        """The outcome a peer sent; one this side does not know (a newer peer's) counts as an
        error: it is not an ordinary score."""
        try:
            return cls(value)
        except ValueError:
            return cls.ERROR

    @property
    def failed(self) -> bool:
        """The function failed (a wrong training signal), as opposed to scoring or declining."""
        return self in (RewardOutcome.ERROR, RewardOutcome.NON_FINITE, RewardOutcome.TIMEOUT)


def jsonable(value: Any) -> Any:
    """``value`` with everything JSON cannot hold turned into its ``str`` (numpy scalars and
    arrays into numbers and lists; NaN and infinities into strings, which JSON lacks)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    tolist = getattr(value, "tolist", None)  # numpy scalars and arrays
    if callable(tolist):
        return jsonable(tolist())
    return str(value)


def encode_columns(columns: dict[str, Any] | None) -> str:
    """The JSON carried in ``columns_json`` ("" for no columns)."""
    if not columns:
        return ""
    return json.dumps(jsonable(columns), ensure_ascii=False, separators=(",", ":"))


def decode_columns(text: str, where: str = "columns_json") -> dict[str, Any]:
    """The columns of a ``columns_json`` field; ValueError naming ``where`` if it is not a
    JSON object or uses a reserved keyword."""
    if not text:
        return {}
    try:
        columns = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(columns, dict):
        raise ValueError(f"{where}: expected a JSON object of columns, got "
                         f"{type(columns).__name__}")
    check_column_names(columns, where)
    return columns


def check_column_names(names, where: str) -> None:
    reserved = sorted(set(names) & RESERVED_KEYWORDS)
    if reserved:
        raise ValueError(f"{where}[{reserved[0]!r}]: a reserved keyword of the reward functions "
                         f"(reserved: {', '.join(sorted(RESERVED_KEYWORDS))}); rename the column")
