"""The trainer's reward error policy, on rollout groups as the dispatcher builds them."""

from __future__ import annotations

import logging

import pytest

from splitrl.config import ConfigError, RewardConfig, RewardFunctionConfig, load_config
from splitrl.reward_protocol import RewardOutcome
from splitrl.v1 import common_pb2, sampler_pb2
from trainer_service.orchestration.dispatcher import group_from_wire
from trainer_service.orchestration.reward_checks import RewardChecks, RewardFunctionFailed
from trainer_service.orchestration.rollouts import WorkItem

BROKEN = "error: TypeError: think_format() takes 1 positional argument but 3 were given"


ERROR, TIMEOUT = RewardOutcome.ERROR, RewardOutcome.TIMEOUT


def group(uid, rewards_and_reasons):
    """A ScoredGroup off the wire: one completion per {function: (score, reason[, outcome])}
    dict (no outcome: an ordinary score)."""
    completions = []
    for per_function in rewards_and_reasons:
        c = common_pb2.Completion(token_ids=[1], logprobs=[-0.1], text="x")
        for name, (score, reason, *outcome) in per_function.items():
            c.rewards[name] = score
            if reason:
                c.reward_reasons[name] = reason
            if outcome:
                c.reward_outcomes[name] = outcome[0]
        completions.append(c)
    msg = sampler_pb2.ScoredGroup(prompt_id=uid, completions=completions, weight_version=0)
    return group_from_wire(WorkItem(uid, {}), msg)


def checks(**kw):
    return RewardChecks(["exact", "think_format"], **kw)


def test_reasons_reach_the_trainers_completions():
    g = group("u", [{"exact": (1.0, ""), "think_format": (0.0, BROKEN, ERROR)}])
    assert g.completions[0].reasons == {"think_format": BROKEN}
    assert g.completions[0].outcomes == {"think_format": ERROR}
    assert g.completions[0].rewards == {"exact": 1.0, "think_format": 0.0}


def test_a_function_failing_on_the_first_batch_stops_the_run_with_its_name_and_message(caplog):
    batch = [group(f"u{i}", [{"exact": (1.0, ""), "think_format": (0.0, BROKEN, ERROR)}] * 4)
             for i in range(2)]
    with caplog.at_level(logging.ERROR), pytest.raises(RewardFunctionFailed) as info:
        checks().observe(batch)
    message = str(info.value)
    assert "'think_format' failed on 8 (8 errors) of 8 completions of the first batch" in message
    assert BROKEN in message and "docs/rewards.md" in message
    assert info.value.metrics["reward/think_format/errors"] == 8.0
    assert info.value.metrics["reward/exact/mean"] == 1.0
    assert "reward/think_format/mean" not in info.value.metrics  # nothing it scored
    logged = [r for r in caplog.records if getattr(r, "function", None) == "think_format"]
    assert logged and logged[0].levelno == logging.ERROR and BROKEN in logged[0].getMessage()


@pytest.mark.parametrize("reason, outcome", [
    ("error: returned 2 scores for 4 completions", ERROR),
    ("error: score is not a number: str", ERROR),
    ("non-finite score: nan", RewardOutcome.NON_FINITE),
    ("", ERROR),  # no reason at all: the outcome decides
    ("", 99),  # an outcome from a newer reward service: not a score
])
def test_wrong_length_and_non_numbers_are_errors_too(reason, outcome):
    batch = [group("u", [{"exact": (1.0, ""), "think_format": (0.0, reason, outcome)}])]
    with pytest.raises(RewardFunctionFailed, match="think_format"):
        checks().observe(batch)


def test_after_the_first_batch_more_than_the_fraction_stops():
    rc = checks(max_error_fraction=0.1)
    ok = {"exact": (1.0, ""), "think_format": (1.0, "")}
    bad = {"exact": (1.0, ""), "think_format": (0.0, BROKEN, ERROR)}
    metrics = rc.observe([group("a", [ok] * 10)])
    assert metrics["reward/think_format/errors"] == 0.0
    assert metrics["reward/think_format/mean"] == 1.0
    metrics = rc.observe([group("b", [ok] * 9 + [bad])])  # 10%: allowed
    assert metrics["reward/think_format/errors"] == 1.0
    assert metrics["reward/think_format/mean"] == 1.0  # over what it scored
    with pytest.raises(RewardFunctionFailed, match=r"2 \(2 errors\) of 10 completions of a "
                                                   r"batch .*max_error_fraction=0.1"):
        rc.observe([group("c", [ok] * 8 + [bad] * 2)])


def test_timeouts_count_toward_the_fraction_not_the_first_batch_rule(caplog):
    slow = {"exact": (0.0, "timeout", TIMEOUT), "think_format": (1.0, "")}
    ok = {"exact": (1.0, ""), "think_format": (1.0, "")}
    rc = checks()
    with caplog.at_level(logging.WARNING):
        metrics = rc.observe([group("a", [slow] + [ok] * 19)])  # 5% timeouts, first batch
    assert metrics["reward/exact/timeouts"] == 1.0 and metrics["reward/exact/errors"] == 0.0
    assert any(r.levelno == logging.WARNING and getattr(r, "function", "") == "exact"
               for r in caplog.records)
    with pytest.raises(RewardFunctionFailed, match="'exact' failed on 3 \\(3 timeouts\\)"):
        rc.observe([group("b", [slow] * 3 + [ok] * 7)])


def test_none_is_no_score_not_a_failure():
    declined = {"exact": (1.0, ""),
                "think_format": (0.0, "no score (None)", RewardOutcome.NO_SCORE)}
    explained = {"exact": (0.0, "error: the number is wrong"), "think_format": (1.0, "")}
    metrics = checks().observe([group("a", [declined, explained])])
    assert metrics["reward/think_format/errors"] == 0.0
    assert metrics["reward/think_format/mean"] == 1.0  # the None is left out, as TRL's nanmean
    # An explained 0 is a score, whatever its words say: only the outcome is read.
    assert metrics["reward/exact/errors"] == 0.0 and metrics["reward/exact/mean"] == 0.5


def test_the_policy_is_configurable_and_checked():
    cfg = RewardConfig(functions=[RewardFunctionConfig(name="exact")], max_error_fraction=0.5,
                       first_batch_max_error_fraction=0.5)
    rc = RewardChecks.from_config(cfg)
    bad = {"exact": (0.0, BROKEN, ERROR)}
    ok = {"exact": (1.0, "")}
    rc.observe([group("a", [bad] * 4 + [ok] * 6)])  # 40%: under both thresholds
    with pytest.raises(ConfigError, match="reward.max_error_fraction: expected a fraction"):
        load_config(None, ["reward.max_error_fraction=1.5"])
