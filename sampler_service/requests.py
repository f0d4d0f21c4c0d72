"""What a caller hands the engine and gets back: requests, their groups, finished sequences.

A `GenerationRequest` is n completions for each of its prompts. The engine's thread admits
its prompts (each with its n rows, so a prompt is prefilled once) and reports every finished
group through the request's event queue; the caller iterates `groups()` or waits for
`result()`, and may `cancel()` at any time (its queued prompts are dropped, its rows freed at
the next segment boundary).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

from sampler_service.sampling import SamplingOptions

if TYPE_CHECKING:
    from sampler_service.episodes import Trajectory


@dataclasses.dataclass(frozen=True)
class GeneratedSequence:
    """One completion: token ids (stop token included), their logprobs, why it ended, and the
    weight versions it was generated under (oldest first; more than one only when a push was
    applied between its tokens, ``update_in_flight``)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (EOS or a stop token) or "length" (max_new_tokens)
    weight_versions: tuple[int, ...] = ()


def cut_at_stop_string(seq: GeneratedSequence, tokenizer,
                       stop_strings: Sequence[str]) -> GeneratedSequence:
    """``seq`` ended at the first of ``stop_strings`` it wrote, that string's tokens kept
    (`splitrl.tokenizer.stop_string_cut`); as it is when it holds none. The engine stops on
    token ids: the text of a stop string is known only once decoded."""
    from splitrl.tokenizer import stop_string_cut

    keep = stop_string_cut(tokenizer, seq.token_ids, stop_strings) if stop_strings else None
    if keep is None:
        return seq
    return dataclasses.replace(seq, token_ids=list(seq.token_ids[:keep]),
                               logprobs=list(seq.logprobs[:keep]), finish_reason="stop")


@dataclasses.dataclass(frozen=True)
class FinishedGroup:
    """The n completions of prompt ``index``, with the seconds it waited for decode slots
    (``queue_s``) and spent generating (``generate_s``)."""

    index: int
    sequences: Sequence[GeneratedSequence | Trajectory]  # Trajectory: an episodes request's
    queue_s: float
    generate_s: float


@dataclasses.dataclass(frozen=True)
class PinnedWeights:
    """Weights a request must be generated with (``GenerationEngine.generate(state, ...)``)."""

    version: int
    state: object


class EngineClosed(RuntimeError):
    """The engine stopped before the request finished."""


class GenerationRequest:
    """A submitted request; see the module docstring. Created by `GenerationEngine.submit`."""

    def __init__(self, request_id: int, prompts: Sequence[np.ndarray], seeds: Sequence[int],
                 options: SamplingOptions, n: int, *, exclusive: bool,
                 pinned: PinnedWeights | None, sink=None):
        self.id = request_id
        self.prompts = list(prompts)
        self.seeds = list(seeds)
        self.options = options
        self.n = n
        self.exclusive = exclusive
        self.pinned = pinned
        self.submitted_at = time.perf_counter()
        self.next_prompt = 0  # prompts admitted so far (the engine thread's counter)
        self.open_groups = len(self.prompts)  # groups not yet delivered
        self._cancelled = threading.Event()
        # FinishedGroup, then None at the end, or an exception; ``sink`` (anything with
        # ``put``) receives them instead of `groups()`, to be merged with other events.
        self._events = queue.SimpleQueue() if sink is None else sink
        self._finished = threading.Event()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    def cancel(self) -> None:
        """Stop generating for this request: nothing more is delivered."""
        self._cancelled.set()

    # -- the engine thread's side -----------------------------------------------------------

    def deliver(self, group: FinishedGroup) -> None:
        self.open_groups -= 1
        self._events.put(group)
        if self.open_groups == 0:
            self.finish()

    def fail(self, error: BaseException) -> None:
        if not self._finished.is_set():
            self._events.put(error)
            self.finish()

    def finish(self) -> None:
        if not self._finished.is_set():
            self._finished.set()
            self._events.put(None)

    # -- the caller's side ------------------------------------------------------------------

    def groups(self) -> Iterator[FinishedGroup]:
        """Finished groups as they come (completion order); raises what the engine raised."""
        while True:
            event = self._events.get()
            if event is None:
                return
            if isinstance(event, BaseException):
                raise event
            yield event

    def result(self) -> list[list[GeneratedSequence]]:
        """Every prompt's completions, ``[prompt][sample]``, once all are done."""
        out: list[Sequence[GeneratedSequence | Trajectory] | None] = [None] * len(self.prompts)
        for group in self.groups():
            out[group.index] = group.sequences
        if any(g is None for g in out):
            raise EngineClosed("the request was cancelled or the engine stopped before it "
                               "finished")
        return out  # type: ignore[return-value]
