"""Built-in reward functions and the registry, called in-process (no workers)."""

from __future__ import annotations

import math

import pytest

from reward_service import RewardValue, resolve
from reward_service._worker import check_result
from reward_service.scoring import specs_from_config
from splitrl.config import RewardConfig, RewardFunctionConfig


def one(name, completion, reference="", options=None, **metadata):
    fn = resolve(name, options)
    out = fn(["prompt"], [completion], [reference], **{k: [v] for k, v in metadata.items()})
    assert len(out) == 1
    return out[0]


@pytest.mark.parametrize("completion,reference,expected", [
    ("so it is \\boxed{72}", "72", 1.0),
    ("\\boxed{71} no wait, \\boxed{72}", "72", 1.0),  # the last box wins
    ("\\boxed{72} no wait, \\boxed{71}", "72", 0.0),
    ("Step 1 ... 1,080 in total\n#### 1,080", "1080", 1.0),  # GSM8K style, thousands commas
    ("#### 1080", "Some solution\n#### 1,080", 1.0),  # reference given as a GSM8K solution
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("The answer is $\\frac{\\pi}{2}$", "\\frac{\\pi}{2}", 1.0),
    ("\\boxed{(3, \\frac{\\pi}{2})}", "(3,\\frac{\\pi}{2})", 1.0),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    ("\\boxed{5}", "We find ... so $x = \\boxed{5}$.", 1.0),  # reference: a MATH solution
    ("I think 41 and then 42", "42", 1.0),  # no box: the last expression
])
def test_math_accuracy(completion, reference, expected):
    assert one("math_accuracy", completion, reference) == expected


def test_math_accuracy_explains_every_score():
    assert one("math_accuracy", "no idea", "42").reason == "no answer found"
    assert one("math_accuracy", "\\boxed{41}", "42").reason == "wrong answer '41'"
    assert one("math_accuracy", "\\boxed{42}", "42").reason == "answer '42'"
    with pytest.raises(ValueError, match="empty reference"):
        one("math_accuracy", "\\boxed{41}", "  ")


def test_math_accuracy_reads_only_the_tail_of_long_completions():
    long = "\\boxed{1} " + "filler " * 5000 + "\\boxed{2}"
    assert one("math_accuracy", long, "2", {"max_chars": 1000}) == 1.0
    assert one("math_accuracy", "\\boxed{1} " + "filler " * 5000, "1", {"max_chars": 1000}) == 0


@pytest.mark.parametrize("completion,reference,expected", [
    ("4", "4", 1.0),
    (" 4\n", "4", 1.0),
    ("4.0", "4", 1.0),
    ("04", "4", 1.0),
    ("-3", "-3", 1.0),
    ("5", "4", 0.0),
    ("3 4", "4", 0.0),  # listing several numbers earns nothing
    ("4 4", "4", 0.0),
    ("4, 5", "4", 0.0),
    ("4+0", "4", 0.0),
    ("The answer is 4", "4", 0.0),
    ("\\boxed{4}", "4", 0.0),
    ("", "4", 0.0),
    ("1080", "1,080", 1.0),
    ("1080", "blah\n#### 1,080", 1.0),
    ("Paris", "Paris", 1.0),  # short non-numeric answers: exact text
    ("paris", "Paris", 0.0),
])
def test_exact_answer(completion, reference, expected):
    assert one("exact_answer", completion, reference) == expected


def test_exact_answer_reasons_and_options():
    assert one("exact_answer", "3 4", "4").reason == "not exactly one number"
    assert one("exact_answer", "5", "4").reason == "wrong number"
    assert one("exact_answer", "paris", "Paris", {"case_sensitive": False}) == 1.0


@pytest.mark.parametrize("completion,expected", [
    ("<think>reasoning</think> 42", 1.0),
    ("\n<think>a\nb</think>\n\\boxed{42}\n", 1.0),
    ("<think>reasoning</think>", 0.0),  # no answer after the thinking
    ("42", 0.0),
    ("<think>a</think> 42 <think>b</think> 43", 0.0),
    ("<think><think>a</think></think> 42", 0.0),
    ("preamble <think>a</think> 42", 0.0),
])
def test_format_default_pattern(completion, expected):
    assert one("format", completion) == expected


def test_format_custom_pattern_and_bad_pattern():
    assert one("format", "Answer: 7", options={"pattern": r"Answer: \d+"}) == 1.0
    assert one("format", "x Answer: 7", options={"pattern": r"Answer: \d+",
                                                 "fullmatch": False}) == 1.0
    with pytest.raises(ValueError, match="invalid pattern"):
        resolve("format", {"pattern": "("})


@pytest.mark.parametrize("name", ["overlong_penalty", "length"])
@pytest.mark.parametrize("tokens,expected", [
    (1, 0.0), (80, 0.0), (81, -1 / 20), (90, -0.5), (100, -1.0), (101, -1.0), (5000, -1.0),
])
def test_dapo_overlong_penalty(name, tokens, expected):
    # max_tokens 100, buffer 20: free up to 80, then linear down to -1 at 100 (DAPO eq. 13).
    score = one(name, "x", options={"max_tokens": 100, "buffer": 20},
                completion_tokens=tokens)
    assert score == pytest.approx(expected)


def test_length_needs_token_counts():
    with pytest.raises(ValueError, match="completion_tokens is 0"):
        one("length", "some text", options={"max_tokens": 10}, completion_tokens=0)
    assert one("length", "", options={"max_tokens": 10}, completion_tokens=0) == 0.0
    with pytest.raises(ValueError, match="max_tokens"):
        resolve("length", {"max_tokens": 10, "buffer": 11})
    with pytest.raises(ValueError, match="bad options"):
        resolve("length", {})


def test_user_function_from_module_path_with_options():
    # No **kwargs in its signature: it only receives the keywords it names.
    assert one("pathological_rewards:completion_length", "abc", options={"scale": 2.0},
               completion_tokens=3, anything="x") == 6.0


def test_unknown_functions_fail_with_the_name():
    with pytest.raises(ValueError, match="built-in name .*math_accuracy.* or 'module:function'"):
        resolve("no_such_reward")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
        resolve("no_such_module:f")
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        resolve("pathological_rewards:nope")


def test_config_is_checked_at_start():
    dup = RewardConfig(functions=[RewardFunctionConfig(name="format"),
                                  RewardFunctionConfig(name="format")])
    with pytest.raises(ValueError, match=r"reward.functions\[1\].name: 'format' is configured"):
        specs_from_config(dup)
    bad = RewardConfig(functions=[RewardFunctionConfig(name="length", options={"max_tokenz": 3})])
    with pytest.raises(ValueError, match=r"reward.functions\[0\]: .*max_tokenz"):
        specs_from_config(bad)
    specs = specs_from_config(RewardConfig(timeout_s=3.0, functions=[
        RewardFunctionConfig(name="format", weight=0.5),
        RewardFunctionConfig(name="exact_answer", timeout_s=1.0)]))
    assert [(s.name, s.weight, s.timeout_s) for s in specs] == [
        ("format", 0.5, 3.0), ("exact_answer", 1.0, 1.0)]


@pytest.mark.parametrize("out,expected", [
    ([0.5], (0.5, "", "ok")),
    ([RewardValue.zero("why")], (0.0, "why", "ok")),
    ([True], (1.0, "", "ok")),
    ([None], (0.0, "no score (None)", "none")),
    ([math.nan], (0.0, "non-finite score: nan", "nonfinite")),
    ([-math.inf], (0.0, "non-finite score: -inf", "nonfinite")),
    ([1.0, 2.0], (0.0, "error: returned 2 scores for 1 completion", "error")),
    (0.5, (0.0, "error: expected a list with one score, got float", "error")),
    ("1", (0.0, "error: expected a list with one score, got str", "error")),
    (["x"], (0.0, "error: score is not a number: str", "error")),
])
def test_results_are_checked(out, expected):
    assert check_result(out) == expected
