"""Environments for the tests, loaded by name (``tests.splitrl.environment_fixtures:NAME``) in
the runner's worker processes.

``TrlWordCounter`` is written the way TRL's ``environment_factory`` documentation writes an
environment (a plain class: ``reset(**kwargs)`` gets the dataset row, public methods with
Google-style docstrings are the tools, ``reward`` / ``done`` attributes); nothing in it knows
SplitRL.
"""

from __future__ import annotations

import signal
import time


class TrlWordCounter:
    def __init__(self):
        self.reward = 0.0
        self.done = False
        self.counts: dict[str, int] = {}

    def reset(self, **kwargs) -> str | None:
        self.reward = 0.0
        self.done = False
        self.counts = {}
        return f"Target word: {kwargs.get('word', 'none')}"

    def add(self, word: str, times: int = 1) -> str:
        """
        Add a word to the tally.

        Args:
            word: The word to add.
            times: How many times to add it.

        Returns:
            The word's new count.
        """
        self.counts[word] = self.counts.get(word, 0) + times
        return str(self.counts[word])

    def finish(self) -> str:
        """
        End the episode.

        Returns:
            A goodbye message.
        """
        self.done = True
        self.reward = float(sum(self.counts.values()))
        return "bye"


class Misbehaving:
    """Tools that raise, sleep past the limit, or hang where the soft limit cannot reach."""

    def __init__(self):
        self.calls = 0

    def reset(self, **columns) -> None:
        self.calls = 0

    def count(self) -> str:
        """How many calls this episode has answered (its state, to see it survive)."""
        self.calls += 1
        return str(self.calls)

    def fail(self) -> str:
        """Raise an error."""
        raise ValueError("no luck")

    def sleep(self) -> str:
        """Sleep far longer than any time limit (the soft limit interrupts it)."""
        time.sleep(600)
        return "woke"

    def hang(self) -> str:
        """Ignore the soft limit's signal and sleep: only a kill ends it."""
        signal.signal(signal.SIGALRM, signal.SIG_IGN)
        time.sleep(600)
        return "woke"


class DelayedLookup:
    """`lookup` answering after a delay that differs from episode to episode (``latency_s``
    times 1 to 3, by the secret), so tool calls return in another order than they were made."""

    def __init__(self, latency_s: float = 0.0):
        self.latency_s = latency_s
        self.secret = 0

    def reset(self, **columns) -> None:
        self.secret = int(columns["secret"])

    def lookup(self) -> str:
        """The value stored for this episode's key."""
        time.sleep(self.latency_s * (1 + self.secret % 3))
        return str(self.secret)
