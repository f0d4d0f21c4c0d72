"""Built-in reward functions besides ``math_accuracy``: ``format``, ``length``, ``exact_answer``."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from reward_service.registry import RewardValue, register

# <think>reasoning</think> then a non-empty answer, with no further think tags.
DEFAULT_FORMAT = r"\s*<think>(?:(?!</?think>).)*</think>\s*(?:(?!</?think>)\S)(?:(?!</?think>).)*"


@register("format", "1 if the completion matches a regular expression (default: "
          "<think>...</think> then an answer), else 0.")
def make_format(pattern: str = DEFAULT_FORMAT, dotall: bool = True, fullmatch: bool = True):
    try:
        regex = re.compile(pattern, re.DOTALL if dotall else 0)
    except re.error as e:
        raise ValueError(f"format: invalid pattern {pattern!r}: {e}") from None
    match = regex.fullmatch if fullmatch else regex.search

    def format_reward(prompts, completions, references, **_):
        return [1.0 if match(c) else RewardValue.zero("does not match the format pattern")
                for c in completions]

    return format_reward


@register("overlong_penalty", "DAPO's soft overlong punishment in tokens (also registered as "
          "'length'): 0 up to max_tokens - buffer, then linearly down to -penalty at "
          "max_tokens, -penalty beyond.")
@register("length", "DAPO overlong penalty in tokens: 0 up to max_tokens - buffer, then linearly "
          "down to -1 at max_tokens, -1 beyond.")
def make_length(max_tokens: int, buffer: int = 0, penalty: float = 1.0,
                tokenizer: str | None = None):
    """Soft overlong punishment (DAPO, Yu et al. 2025, eq. 13) counted in completion tokens.

    With L the completion's length, L_max = ``max_tokens`` and L_cache = ``buffer``::

        R(L) =  0                              L <= L_max - L_cache
                ((L_max - L_cache) - L) / L_cache   L_max - L_cache < L <= L_max
                -1                             L > L_max

    times ``penalty``. DAPO adds it to the correctness reward (give both functions in
    ``reward.functions``) with L_max the generation budget and L_cache its overlong buffer.
    Token counts come from the item's ``completion_tokens``; when a client does not send them
    (0 for a non-empty completion) the optional ``tokenizer`` (a local Hugging Face tokenizer
    directory) counts them, else the item errors.
    """
    if max_tokens <= 0 or not 0 <= buffer <= max_tokens:
        raise ValueError(f"length: expected max_tokens > 0 and 0 <= buffer <= max_tokens, "
                         f"got max_tokens={max_tokens}, buffer={buffer}")
    expected = max_tokens - buffer

    def count(completion: str, sent: int) -> int:
        if sent > 0 or not completion:
            return sent
        if tokenizer is None:
            raise ValueError("completion_tokens is 0 for a non-empty completion: send the "
                             "token count or set options.tokenizer")
        return len(_tokenizer(tokenizer)(completion, add_special_tokens=False)["input_ids"])

    def length_penalty(prompts, completions, references, completion_tokens=None, **_):
        tokens = completion_tokens or [0] * len(completions)
        scores = []
        for completion, sent in zip(completions, tokens, strict=True):
            n = count(completion, int(sent))
            if n <= expected:
                scores.append(0.0)
            elif n <= max_tokens:
                scores.append(penalty * (expected - n) / buffer)
            else:
                scores.append(-penalty)
        return scores

    return length_penalty


_TOKENIZERS: dict = {}


def _tokenizer(path: str):
    if path not in _TOKENIZERS:
        from transformers import AutoTokenizer

        _TOKENIZERS[path] = AutoTokenizer.from_pretrained(path)
    return _TOKENIZERS[path]


_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")


def _as_number(text: str) -> Decimal | None:
    if not _NUMBER.fullmatch(text):
        return None
    try:
        return Decimal(text)
    except InvalidOperation:
        return None


@register("exact_answer", "1 if the whole completion (stripped) is exactly one number equal to "
          "the reference (or, for a non-numeric reference, exactly the reference text), else 0.")
def make_exact_answer(case_sensitive: bool = True):
    def exact_answer(prompts, completions, references, **_):
        scores = []
        for completion, reference in zip(completions, references, strict=True):
            ref = reference.strip()
            if "####" in ref:
                ref = ref.rsplit("####", 1)[1].strip()
            text = completion.strip()
            gold = _as_number(ref.replace(",", ""))
            if gold is not None:
                value = _as_number(text)
                if value is None:
                    scores.append(RewardValue.zero("not exactly one number"))
                else:
                    scores.append(1.0 if value == gold else RewardValue.zero("wrong number"))
            elif not ref:
                raise ValueError("empty reference")
            else:
                same = text == ref if case_sensitive else text.casefold() == ref.casefold()
                scores.append(1.0 if same else RewardValue.zero("not exactly the reference"))
        return scores

    return exact_answer
