"""What the trainer, the samplers and the reward service agree on about reward functions.

- **Reserved keywords**: the argument names the reward service passes itself. A dataset column
  or metadata key may not use one (it would be shadowed); the trainer refuses such data when it
  loads it, the reward service refuses such a request with INVALID_ARGUMENT.
- **Columns** travel as one JSON object per prompt (``Prompt.columns_json``,
  ``ScoreItem.columns_json``), so that a column keeps its type (an int stays an int, a list a
  list) on its way from the dataset to the reward functions. A value JSON cannot hold (a date,
  bytes) travels as its ``str``.
- **Reasons** (``ItemScore.reasons``, ``Completion.reward_reasons``): a failed call says so with
  ``"timeout"``, ``"error: ..."`` or ``"non-finite score: ..."``; ``"no score (None)"`` is a
  function declining to score (TRL's ``None``); any other reason is the function's explanation
  of an ordinary score. :func:`classify_reason` is the one reading of that vocabulary.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

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

Outcome = Literal["ok", "none", "error", "timeout"]


def classify_reason(reason: str) -> Outcome:
    """What a reason says about a score: a failure (``error``, ``timeout``), no score
    (``none``) or an ordinary score, explained or not (``ok``)."""
    if not reason:
        return "ok"
    if reason == TIMEOUT:
        return "timeout"
    if reason.startswith((ERROR_PREFIX, NONFINITE_PREFIX)):
        return "error"
    if reason == NO_SCORE:
        return "none"
    return "ok"


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
