"""The reward service through real gRPC on 127.0.0.1, with the server in its own process."""

from __future__ import annotations

import time

import grpc
import pytest
from reward_server_setup import (
    HANG_TIMEOUT_S,
    MAX_ITEMS,
    SERVER_CONFIG,
    TIMEOUT_S,
    USER_TIMEOUT_S,
)

from splitrl.reward_protocol import RewardOutcome
from splitrl.v1 import reward_pb2

P = "pathological_rewards:"
# A bound on each call, so a hang fails the test instead of stalling it; never the assertion.
HANG_GUARD_S = 60


def score(stub, items, functions=(), timeout=HANG_GUARD_S):
    request = reward_pb2.ScoreRequest(items=items, functions=list(functions))
    return stub.Score(request, timeout=timeout)


def item(completion="", reference="", **kw):
    return reward_pb2.ScoreItem(completion=completion, reference=reference, **kw)


def assert_still_correct(stub):
    reply = score(stub, [item("so the answer is \\boxed{72}", "72", item_id="ok")],
                  ["math_accuracy"])
    assert reply.scores[0].scores["math_accuracy"] == 1.0
    assert dict(reply.scores[0].reasons) == {"math_accuracy": "answer '72'"}  # full marks say why
    assert not reply.scores[0].outcomes  # an ordinary score


def test_health_and_list_reward_functions(reward_stub):
    reply = reward_stub.ListRewardFunctions(reward_pb2.ListRewardFunctionsRequest(), timeout=10)
    by_name = {f.name: f for f in reply.functions}
    assert list(by_name)[:4] == ["math_accuracy", "format", "length", "exact_answer"]
    assert by_name["format"].weight == 0.5
    assert by_name["math_accuracy"].timeout_s == TIMEOUT_S
    assert by_name[P + "sleep_forever"].timeout_s == USER_TIMEOUT_S
    assert "math-verify" in by_name["math_accuracy"].description
    assert "Never returns" in by_name[P + "sleep_forever"].description


def test_scores_carry_each_function_the_weighted_total_and_reasons(reward_stub):
    good = "<think>8 * 9 = 72</think> The answer is \\boxed{72}."
    items = [
        item(good, "72", item_id="right", completion_tokens=90),
        item("The answer is \\boxed{71}.", "72", item_id="wrong", completion_tokens=10),
        item("72", "72", item_id="bare", completion_tokens=1),
    ]
    reply = score(reward_stub, items, ["math_accuracy", "format", "length", "exact_answer"])
    right, wrong, bare = reply.scores
    assert [s.item_id for s in reply.scores] == ["right", "wrong", "bare"]
    assert dict(right.scores) == pytest.approx(
        {"math_accuracy": 1.0, "format": 1.0, "length": -0.5, "exact_answer": 0.0})
    assert right.total == pytest.approx(1.0 + 0.5 * 1.0 - 0.5 + 0.0)
    assert right.reasons["exact_answer"] == "not exactly one number"
    assert wrong.scores["math_accuracy"] == 0.0
    assert wrong.reasons["math_accuracy"] == "wrong answer '71'"
    assert wrong.reasons["format"] == "does not match the format pattern"
    assert bare.scores["math_accuracy"] == 1.0 and bare.scores["exact_answer"] == 1.0
    assert reply.seconds > 0


def test_empty_function_list_means_all_configured(reward_stub):
    # One item through every function, the misbehaving ones included: the reply still comes.
    reply = score(reward_stub, [item("3", "3", completion_tokens=1)])
    assert len(reply.scores[0].scores) == len(SERVER_CONFIG["reward"]["functions"])
    assert reply.scores[0].scores["math_accuracy"] == 1.0
    assert reply.scores[0].total == pytest.approx(2.0)  # math_accuracy + exact_answer
    assert set(reply.scores[0].reasons) >= {P + "sleep_forever", P + "raise_error"}
    assert_still_correct(reward_stub)


NESTED = "{" * 10_000 + "1" + "}" * 10_000
PATHOLOGICAL = {
    "power_tower": (item("\\boxed{9^{9^{9^{9}}}}", "5"), ["math_accuracy"], TIMEOUT_S, ""),
    "one_megabyte": (item("the answer is maybe " * 50_000, "5"), ["math_accuracy"], TIMEOUT_S,
                     "no answer found"),
    "one_megabyte_format": (item("<think>" * 150_000, "5"), ["format"], TIMEOUT_S,
                            "does not match the format pattern"),
    "invalid_utf8": (item(completion_raw=b"\xff\xfe answer \xc3\x28 \xed\xa0\x80", reference="5"),
                     ["math_accuracy"], TIMEOUT_S, "no answer found"),
    "nested_braces": (item(NESTED, "1"), ["math_accuracy"], TIMEOUT_S, ""),
    "nested_braces_boxed": (item("\\boxed{" + NESTED + "}", "1"), ["math_accuracy"], TIMEOUT_S,
                            ""),
    "sleeps_forever": (item("1", "1"), [P + "sleep_forever"], USER_TIMEOUT_S, "timeout"),
    "hangs_ignoring_alarm": (item("1", "1"), [P + "hang_ignoring_alarm"], USER_TIMEOUT_S,
                             "timeout"),
    "raises": (item("1", "1"), [P + "raise_error"], TIMEOUT_S,
               "error: RuntimeError: this reward function is broken"),
    "returns_nan": (item("1", "1"), [P + "return_nan"], TIMEOUT_S, "non-finite score: nan"),
    "exits_the_worker": (item("1", "1"), [P + "exit_process"], TIMEOUT_S,
                         "error: worker died (exit code 3)"),
}


@pytest.mark.parametrize("case", list(PATHOLOGICAL))
def test_pathological_input_scores_zero_with_a_reason_in_time(reward_stub, case):
    msg, functions, limit, reason = PATHOLOGICAL[case]
    reply = score(reward_stub, [msg], functions)  # cut at its limit: "timeout" where it hangs
    result = reply.scores[0]
    for name in functions:
        assert result.scores[name] == 0.0, (case, name, dict(result.reasons))
        assert result.reasons[name], (case, name)
        # The case's expected reason, told apart by its outcome on the wire: a cut-off call,
        # a failed one, or the function's own explanation of an ordinary 0.
        expected = (RewardOutcome.TIMEOUT if reason == "timeout" else RewardOutcome.ERROR
                    if reason.startswith("error: ") else RewardOutcome.NON_FINITE
                    if reason.startswith("non-finite") else RewardOutcome.SCORED)
        if reason:
            assert result.outcomes.get(name, RewardOutcome.SCORED) == expected, (case, name)
        if reason:
            assert result.reasons[name] == reason, (case, name, dict(result.reasons))
    assert result.total == 0.0
    assert_still_correct(reward_stub)


def test_invalid_utf8_is_decoded_with_replacement(reward_stub):
    reply = score(reward_stub, [item(completion_raw=b"\xff\xfe so \\boxed{42} \xc3\x28",
                                     reference="42")], ["math_accuracy"])
    assert reply.scores[0].scores["math_accuracy"] == 1.0


def test_a_hung_function_does_not_block_other_requests(reward_server, reward_stub):
    hung = reward_stub.Score.future(reward_pb2.ScoreRequest(
        items=[item("1", "hang")], functions=[P + "hang_when_asked"]),
        timeout=HANG_TIMEOUT_S + HANG_GUARD_S)
    deadline = time.monotonic() + HANG_GUARD_S
    while not reward_server.hang_marker.exists():  # a worker is stuck in it now
        assert time.monotonic() < deadline and not hung.done(), "the hang never started"
        time.sleep(0.01)
    items = [item(f"\\boxed{{{i}}}", str(i)) for i in range(20)]
    reply = score(reward_stub, items, ["math_accuracy"])
    assert not hung.done()  # the other worker served these while the first one hangs
    assert [s.scores["math_accuracy"] for s in reply.scores] == [1.0] * 20
    stuck = hung.result()  # then the hung call is cut at its limit, and says so
    assert stuck.scores[0].reasons[P + "hang_when_asked"] == "timeout"
    assert stuck.scores[0].outcomes[P + "hang_when_asked"] == RewardOutcome.TIMEOUT
    reward_server.hang_marker.unlink()


def _status(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def test_unknown_function_is_invalid_argument_naming_the_field(reward_stub):
    code, details = _status(lambda: score(reward_stub, [item("1", "1")],
                                          ["math_accuracy", "no_such_reward"]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "functions[1]" in details and "'no_such_reward'" in details
    assert "math_accuracy" in details  # lists what is configured


def test_reserved_metadata_key_is_invalid_argument(reward_stub):
    bad = item("1", "1", metadata={"completions": "x"})
    code, details = _status(lambda: score(reward_stub, [item("1", "1"), bad]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "items[1].metadata['completions']" in details


def test_too_many_items_is_resource_exhausted(reward_stub):
    items = [item("1", "1")] * (MAX_ITEMS + 1)
    code, details = _status(lambda: score(reward_stub, items, ["exact_answer"]))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"{MAX_ITEMS + 1} items" in details and "max_items_per_request" in details


def test_too_many_bytes_is_resource_exhausted(reward_stub):
    items = [item("x" * (1024 * 1024), "1")] * 4 + [item("x" * (512 * 1024), "1")]  # > 4 MiB
    code, details = _status(lambda: score(reward_stub, items, ["exact_answer"]))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_request_bytes" in details
    assert_still_correct(reward_stub)
