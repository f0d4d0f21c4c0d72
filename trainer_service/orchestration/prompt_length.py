"""Prompts longer than the samplers accept, found and handled when the data is loaded.

A sampler refuses a prompt whose tokens plus ``max_new_tokens`` exceed its
``max_sequence_length``. Sending one would fail its whole request, so every row of a split is
measured once at load time, *as the sampler will encode it* (system prompt and chat template
included, ``splitrl.tokenizer.encode_prompt``), against ``limit`` tokens. A longer row is, by
policy:

``drop``
    left out of the split (counted, logged with its prompt id);
``truncate_left``
    cut from the left: the first tokens of the prompt's own text go (for chat rows, of the
    earliest non-system message first), never the system prompt or the template, until the
    rendered prompt fits; a row whose system prompt and template alone do not fit is dropped;
``error``
    a ValueError listing the rows: the run does not start.

The result is a view over the split (:class:`FittedRows`): the kept rows in their order, with
the truncated ones replaced. Its length is what the data cursor counts, so a resumed run with
other limits is told that the data changed.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from splitrl.tasks import Row

log = logging.getLogger(__name__)

POLICIES = ("drop", "truncate_left", "error")
LOGGED_ROWS = 20  # rows logged one by one per split; the rest are counted
_CHUNK = 1024  # rows tokenized per call


@dataclass
class LengthReport:
    """What the length check found in one split."""

    split: str
    limit: int
    policy: str
    rows: int = 0
    too_long: list[tuple[str, int]] = field(default_factory=list)  # (prompt_id, tokens)
    truncated: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    longest: int = 0  # tokens of the longest prompt served (at most `limit`)

    def summary(self) -> str:
        return (f"{len(self.too_long)} of {self.rows} {self.split} prompts are longer than "
                f"{self.limit} tokens: {len(self.truncated)} truncated from the left, "
                f"{len(self.dropped)} dropped")


class FittedRows(Sequence[Row]):
    """The rows of a split that fit: ``keep`` indices of ``base``, some rows replaced."""

    def __init__(self, base: Sequence[Row], keep: list[int], replaced: dict[int, Row]):
        self._base = base
        self._keep = keep
        self._replaced = replaced

    def __len__(self) -> int:
        return len(self._keep)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        source = self._keep[index]
        return self._replaced.get(source) or self._base[source]


Counter = Callable[[list[Row]], list[int]]


def token_counter(tokenizer, format_row: Callable[[Row], Row]) -> Counter:
    """Token counts of raw rows as the sampler encodes them after ``format_row`` (the
    stream's formatting: system prompt, chat messages)."""
    from splitrl.tokenizer import render_prompt

    def count(rows: list[Row]) -> list[int]:
        texts = []
        for row in rows:
            served = format_row(row)
            texts.append(render_prompt(tokenizer, served["prompt"], served["messages"]))
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        return [len(x) for x in ids]

    return count


def fit_split(rows: Sequence[Row], *, split: str, limit: int, policy: str, count: Counter,
              tokenizer) -> tuple[Sequence[Row], LengthReport]:
    """The rows of ``split`` that fit in ``limit`` tokens under ``policy``, and the report."""
    if policy not in POLICIES:
        raise ValueError(f"data.long_prompt_policy: expected one of {list(POLICIES)}, "
                         f"got {policy!r}")
    report = LengthReport(split, limit, policy, rows=len(rows))
    long_rows: list[int] = []
    for lo in range(0, len(rows), _CHUNK):
        chunk = [rows[i] for i in range(lo, min(lo + _CHUNK, len(rows)))]
        for offset, n in enumerate(count(chunk)):
            report.longest = max(report.longest, min(n, limit))
            if n > limit:
                long_rows.append(lo + offset)
                report.too_long.append((chunk[offset]["prompt_id"], n))
    if not long_rows:
        return rows, report
    if policy == "error":
        shown = ", ".join(f"{pid} ({n} tokens)" for pid, n in report.too_long[:5])
        more = f" and {len(long_rows) - 5} more" if len(long_rows) > 5 else ""
        raise ValueError(
            f"data: {len(long_rows)} of {len(rows)} {split} prompts are longer than "
            f"{limit} tokens as the sampler encodes them (system prompt and chat template "
            f"included): {shown}{more}. data.long_prompt_policy=error refuses to start; set it "
            "to drop or truncate_left, shorten those prompts, or raise "
            "sampler.max_sequence_length (data.max_prompt_tokens)")
    replaced: dict[int, Row] = {}
    dropped: set[int] = set()
    for index, (prompt_id, n) in zip(long_rows, report.too_long, strict=True):
        cut = truncate_left(rows[index], limit, count, tokenizer) \
            if policy == "truncate_left" else None
        if cut is None:
            dropped.add(index)
            report.dropped.append(prompt_id)
            action = "dropped"
        else:
            replaced[index] = cut
            report.truncated.append(prompt_id)
            action = "truncated from the left"
        if len(report.truncated) + len(report.dropped) <= LOGGED_ROWS:
            log.warning("prompt longer than the limit: %s", action, extra={
                "prompt_id": prompt_id, "tokens": n, "limit": limit, "split": split})
    log.warning(report.summary(), extra={
        "split": split, "limit": limit, "policy": policy,
        "truncated": len(report.truncated), "dropped": len(report.dropped)})
    if len(dropped) == len(rows):
        raise ValueError(f"data: every {split} prompt is longer than {limit} tokens "
                         f"({report.summary()}); nothing is left to train on")
    keep = [i for i in range(len(rows)) if i not in dropped]
    return FittedRows(rows, keep, replaced), report


def _segments(row: Row) -> list[tuple[int | None, str]]:
    """The texts truncation may shorten, in order: (message index or None, content)."""
    if row.get("messages") is None:
        return [(None, row["prompt"])]
    return [(i, m["content"]) for i, m in enumerate(row["messages"]) if m["role"] != "system"]


def _without_first(row: Row, segments, ids: list[list[int]], k: int, tokenizer) -> Row:
    """``row`` with the first ``k`` tokens of its segments (taken in order) removed."""
    texts = []
    for segment in ids:
        drop = min(k, len(segment))
        k -= drop
        texts.append(tokenizer.decode(segment[drop:], skip_special_tokens=False)
                     .lstrip("\ufffd") if drop else None)
    out = dict(row)
    if row.get("messages") is None:
        if texts[0] is not None:
            out["prompt"] = texts[0]
        return out
    messages = [dict(m) for m in row["messages"]]
    for (index, _), text in zip(segments, texts, strict=True):
        if text is not None:
            messages[index]["content"] = text
    out["messages"] = messages
    return out


def truncate_left(row: Row, limit: int, count: Counter, tokenizer) -> Row | None:
    """``row`` with the fewest leading tokens of its text removed so that it fits in ``limit``
    (None if even the empty text does not fit). Binary search over the number removed; every
    candidate is measured as the sampler will encode it."""
    segments = _segments(row)
    ids = [list(tokenizer.encode(text, add_special_tokens=False)) for _, text in segments]
    total = sum(len(x) for x in ids)

    def fits(k: int) -> bool:
        return count([_without_first(row, segments, ids, k, tokenizer)])[0] <= limit

    if not fits(total):
        return None
    # fits is monotone in k (dropping more tokens never makes a row longer): the smallest k
    k = bisect.bisect_left(range(total + 1), True, key=fits)
    return _without_first(row, segments, ids, k, tokenizer)
