"""User reward functions that misbehave, loaded by the tests as ``pathological_rewards:NAME``."""

from __future__ import annotations

import os
import signal
import time


def sleep_forever(prompts, completions, references, **kwargs):
    """Never returns (interruptible: the worker's soft time limit stops it)."""
    while True:
        time.sleep(3600)


def hang_ignoring_alarm(prompts, completions, references, **kwargs):
    """Never returns and ignores SIGALRM: only killing the worker stops it."""
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    while True:
        time.sleep(3600)


def hang_when_asked(prompts, completions, references, marker: str = "", **kwargs):
    """Scores 0, except for a reference of "hang": then it writes ``marker`` (so a test knows
    a worker is stuck in it) and hangs, ignoring SIGALRM, until its worker is killed."""
    if references and references[0] == "hang":
        signal.signal(signal.SIGALRM, signal.SIG_IGN)
        with open(marker, "w") as f:
            f.write(str(os.getpid()))
        while True:
            time.sleep(3600)
    return [0.0 for _ in completions]


def raise_error(prompts, completions, references, **kwargs):
    raise RuntimeError("this reward function is broken")


def return_nan(prompts, completions, references, **kwargs):
    return [float("nan") for _ in completions]


def exit_process(prompts, completions, references, **kwargs):
    os._exit(3)


def wrong_length(prompts, completions, references, **kwargs):
    return [1.0, 2.0]


def completion_length(prompts, completions, references, scale=1.0):
    """len(completion) * scale: a well-behaved function without **kwargs."""
    return [scale * len(c) for c in completions]


def batch_size(completions, **kwargs):
    """TRL style: every completion scores the size of the batch it was called with."""
    return [float(len(completions))] * len(completions)


def typed_columns(completions, difficulty, tags, **kwargs):
    """TRL style, columns with their JSON types: difficulty (an int) + the number of tags (a
    list); a TypeError if either arrived as text."""
    return [float(d + len(t)) for d, t in zip(difficulty, tags, strict=True)]
