"""The trainer's reward error policy: failing reward functions are loud, counted, and stop a run.

A reward function *fails* on a completion when the reward service reports so in the
completion's outcomes (``splitrl.reward_protocol.RewardOutcome``): an error (it raised, returned
the wrong number of scores or a non-number, or its worker died), a non-finite score or a
timeout; its reason (for people) is logged. Such a completion scores
0 for that function, which is a wrong training signal, not a neutral one, so:

- every step, each function with failures is logged at error level (timeouts alone: warning)
  with its name, how many of the step's completions failed and the first message;
- :meth:`RewardChecks.observe` returns ``reward/<name>/mean`` (over the completions it scored;
  ``None`` and failures excluded, as TRL's nanmean), ``reward/<name>/errors`` and
  ``reward/<name>/timeouts`` for ``metrics.jsonl``;
- the run stops (:class:`RewardFunctionFailed`, before training on the batch) when a function
  fails on more than ``max_error_fraction`` of a step's completions, or, on the run's first
  batch, when its *errors* exceed ``first_batch_max_error_fraction`` (default 0: a function
  that is broken, e.g. called with the wrong signature, fails on every completion, and there is
  no point in training a single step on its zeros). Timeouts count only toward the first rule:
  one pathological completion should not end a run.

Pure bookkeeping over :class:`~trainer_service.orchestration.rollouts.RolloutGroup` lists: no
I/O but logging, so the loop decides what to do with the exception.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from splitrl.config import RewardConfig
from splitrl.reward_protocol import RewardOutcome
from trainer_service.orchestration.rollouts import RolloutGroup

log = logging.getLogger(__name__)


class RewardFunctionFailed(RuntimeError):
    """A reward function failed on more completions than the policy allows; the run stops.
    ``metrics`` holds the step's reward metrics (for ``metrics.jsonl``)."""

    def __init__(self, message: str, metrics: dict[str, float]):
        super().__init__(message)
        self.metrics = metrics


@dataclass
class FunctionTally:
    """One function over one batch."""

    completions: int = 0
    errors: int = 0
    timeouts: int = 0
    scored: int = 0
    total: float = 0.0
    first_failure: str = ""

    @property
    def failures(self) -> int:
        return self.errors + self.timeouts


@dataclass
class RewardChecks:
    """Counts failures per function and applies the stop policy (see the module docstring)."""

    functions: Sequence[str] = ()
    max_error_fraction: float = 0.1
    first_batch_max_error_fraction: float = 0.0
    batches: int = 0
    failed_total: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg: RewardConfig) -> RewardChecks:
        return cls([f.name for f in cfg.functions], cfg.max_error_fraction,
                   cfg.first_batch_max_error_fraction)

    def tally(self, groups: Sequence[RolloutGroup]) -> dict[str, FunctionTally]:
        tallies = {name: FunctionTally() for name in self.functions}
        for group in groups:
            for completion in group.completions:
                for name in dict.fromkeys([*completion.rewards, *completion.outcomes]):
                    t = tallies.setdefault(name, FunctionTally())
                    t.completions += 1
                    outcome = completion.outcomes.get(name, RewardOutcome.SCORED)
                    if outcome.failed:
                        t.errors += outcome != RewardOutcome.TIMEOUT
                        t.timeouts += outcome == RewardOutcome.TIMEOUT
                        t.first_failure = (t.first_failure or completion.reasons.get(name)
                                           or outcome.name.lower())
                    elif outcome == RewardOutcome.SCORED:
                        t.scored += 1
                        t.total += completion.rewards.get(name, 0.0)
        return tallies

    def observe(self, groups: Sequence[RolloutGroup]) -> dict[str, float]:
        """The batch's reward metrics; raises :class:`RewardFunctionFailed` past the policy's
        thresholds. Call once per batch, before training on it."""
        tallies = self.tally(groups)
        if not any(t.completions for t in tallies.values()):
            return {}  # an empty step (everything filtered) is not the first batch
        first = self.batches == 0
        self.batches += 1
        metrics: dict[str, float] = {}
        stops = []
        for name, t in tallies.items():
            metrics[f"reward/{name}/errors"] = float(t.errors)
            metrics[f"reward/{name}/timeouts"] = float(t.timeouts)
            if t.scored:
                metrics[f"reward/{name}/mean"] = t.total / t.scored
            if not t.failures:
                continue
            self.failed_total[name] = self.failed_total.get(name, 0) + t.failures
            what = _failures(t)
            level = logging.ERROR if t.errors else logging.WARNING
            log.log(level, "reward function %r failed on %s of %d completions: %s",
                    name, what, t.completions, t.first_failure,
                    extra={"function": name, "errors": t.errors, "timeouts": t.timeouts,
                           "completions": t.completions, "first_failure": t.first_failure})
            if first and t.errors > self.first_batch_max_error_fraction * t.completions:
                stops.append(
                    f"reward function {name!r} failed on {what} of {t.completions} completions "
                    f"of the first batch ({t.first_failure}); "
                    f"reward.first_batch_max_error_fraction={self.first_batch_max_error_fraction}")
            elif t.failures > self.max_error_fraction * t.completions:
                stops.append(
                    f"reward function {name!r} failed on {what} of {t.completions} completions "
                    f"of a batch ({t.first_failure}); "
                    f"reward.max_error_fraction={self.max_error_fraction}")
        if stops:
            message = ("stopping the run: " + "; ".join(stops) + ". Its scores would train "
                       "the policy on zeros; see docs/rewards.md (signatures, error policy)")
            log.error(message)
            raise RewardFunctionFailed(message, metrics)
        return metrics


def _failures(t: FunctionTally) -> str:
    """"16 (16 errors)", "5 (3 errors, 2 timeouts)"."""
    parts = [f"{n} {what}" for n, what in ((t.errors, "errors"), (t.timeouts, "timeouts")) if n]
    return f"{t.failures} ({', '.join(parts)})"
