"""``math_accuracy``: is the completion's final answer mathematically equal to the reference?

Both sides go through math-verify (LaTeX and plain-expression extraction, symbolic and numeric
comparison). The reference may be

- a GSM8K solution ending ``#### N`` (thousands separators stripped: ``1,080`` -> ``1080``),
- a MATH solution containing ``\\boxed{...}`` (the last box is the answer),
- or a plain value (``72``, ``\\frac{\\pi}{2}``, ``(3, \\frac{\\pi}{2})``).

In the completion the last ``\\boxed{}`` wins; failing that, the text after a final ``####``;
failing that, the last expression math-verify can extract. Only the last ``max_chars``
characters of a completion are read (the answer is at the end; a megabyte of text is not
parsed). math-verify's own ``signal.alarm`` timeouts are switched off: they would cancel the
worker's per-item timer, which enforces the time limit instead (see ``reward_service.pool``).
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Sequence

from reward_service.registry import FunctionSpec, RewardValue, register

# 1,080 or 12,345,678 but not 1,2 or 3.1,415.
_THOUSANDS = re.compile(r"(?<![\d.,])\d{1,3}(?:,\d{3})+(?![\d,])")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def strip_thousands(text: str) -> str:
    """``1,080`` -> ``1080`` wherever a number is written with thousands separators."""
    return _THOUSANDS.sub(lambda m: m.group(0).replace(",", ""), text)


@functools.cache
def _math_verify() -> tuple:
    """math-verify and our extraction settings, imported on first use: it pulls in sympy
    (seconds of CPU), which a reward service whose functions never parse math should not pay
    at every start. The worker pool preloads it when ``math_accuracy`` is configured."""
    import math_verify

    # Timeouts are enforced by the worker; do not warn about math-verify's being off.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    normalization = math_verify.LatexNormalizationConfig(
        basic_latex=True, units=True, malformed_operators=True, nits=True, boxed="last",
        equations=False,
    )
    extraction = (
        math_verify.LatexExtractionConfig(boxed_match_priority=0,
                                          normalization_config=normalization),
        math_verify.ExprExtractionConfig(),
    )
    return math_verify, extraction


def configured(specs: Sequence[FunctionSpec]) -> bool:
    """Whether ``math_accuracy`` is among the configured functions: the pool then preloads
    math-verify in its fork server and each worker warms its parsers up."""
    return any(spec.name == "math_accuracy" for spec in specs)


def warm_up() -> None:
    """Build math-verify's parsers now: their first use costs many times a later parse, and in
    a fresh worker it would count against the first scored batch's time limit (a worker that
    replaces one killed at its limit could then time out on an ordinary answer). The worker
    calls this before it reports ready."""
    _math_verify()[0].verify(_parse("\\boxed{1}"), _parse("1"), timeout_seconds=None)


def _parse(text: str) -> list:
    math_verify, extraction = _math_verify()
    return math_verify.parse(text, extraction, parsing_timeout=None)


@functools.lru_cache(maxsize=4096)
def parse_reference(reference: str) -> tuple:
    """The parsed gold answer (cached: a group of completions shares one reference)."""
    ref = reference.strip()
    if "####" in ref:
        ref = ref.rsplit("####", 1)[1].strip().replace(",", "")
        text = "\\boxed{" + ref + "}"
    elif _BOXED.search(ref):
        text = ref
    else:
        if _THOUSANDS.fullmatch(ref):
            ref = ref.replace(",", "")
        text = "\\boxed{" + ref + "}"
    if not ref:
        raise ValueError("empty reference")
    gold = _parse(text)
    if not gold:
        raise ValueError(f"cannot parse reference {ref[:80]!r}")
    return tuple(gold)


def last_boxed(text: str) -> str | None:
    """``\\boxed{...}`` of the last box whose braces close (None if there is none).

    math-verify alone would join boxes separated by a comma or "and" (``\\boxed{71}, no
    wait, \\boxed{72}`` parses as the set {71, 72}); a completion's answer is its last box.
    """
    boxes = [(m.start(), m.end()) for m in _BOXED.finditer(text)]
    if not boxes:
        return None
    # Scan each box only up to the next one: if a later box never closes, no earlier box
    # can close after it either (its brace stays open), so the whole search is linear.
    bounds = [b[0] for b in boxes[1:]] + [len(text)]
    for (_, start), bound in zip(reversed(boxes), reversed(bounds), strict=True):
        depth = 1
        for i in range(start, bound):
            ch = text[i]
            if ch == "{" and text[i - 1] != "\\":
                depth += 1
            elif ch == "}" and text[i - 1] != "\\":
                depth -= 1
                if depth == 0:
                    return "\\boxed{" + text[start:i] + "}"
    return None


def extract_answer(completion: str, max_chars: int) -> list:
    """math-verify's parse of the completion's final answer ([] when there is none)."""
    text = completion[-max_chars:]
    boxed = last_boxed(text)
    if boxed is not None:
        text = boxed
    elif "####" in text:
        text = strip_thousands(text.rsplit("####", 1)[1])
    return _parse(text)


def _shown(parsed: list) -> str:
    # parse() returns [sympy object, matched string]; never str() the sympy object (it can be
    # astronomically large, e.g. 9^{9^{9^{9}}}), show the matched text.
    text = next((p for p in reversed(parsed) if isinstance(p, str)), "?")
    return text if len(text) <= 60 else text[:57] + "..."


@register("math_accuracy", "1 if the final answer (last \\boxed{}, '#### N' or expression) "
          "equals the reference by math-verify, else 0.")
def make_math_accuracy(max_chars: int = 20_000):
    if max_chars <= 0:
        raise ValueError(f"max_chars must be > 0, got {max_chars}")

    def math_accuracy(prompts, completions, references, **_):
        scores = []
        for completion, reference in zip(completions, references, strict=True):
            gold = list(parse_reference(reference))
            pred = extract_answer(completion, max_chars)
            if not pred:
                scores.append(RewardValue.zero("no answer found"))
            elif _math_verify()[0].verify(gold, pred, timeout_seconds=None):
                scores.append(RewardValue(1.0, f"answer {_shown(pred)!r}"))
            else:
                scores.append(RewardValue.zero(f"wrong answer {_shown(pred)!r}"))
        return scores

    return math_accuracy
