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
