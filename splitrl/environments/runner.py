"""`ToolRunner`: an environment's episodes in isolated worker processes.

    runner = ToolRunner("lookup", {}, workers=4, timeout_s=5.0)
    runner.schemas                                    # the tools' JSON schemas
    runner.start("ep-1", {"secret": 7})               # -> Started(status, text)
    runner.call("ep-1", ToolCall("lookup"))           # -> CallResult(status, text, ...)
    runner.end("ep-1")                                # -> the environment's reward or None
    runner.start_many([("ep-2", {"secret": 1}), ("ep-3", {"secret": 2})])  # one round trip
    runner.end_many(["ep-2", "ep-3"])                 # one round trip per worker
    runner.close()

Environment code is user code: it runs in worker processes (``forkserver``: clean processes
that never inherit the sampler's threads or its devices), each with an address-space limit and
every call under a soft time limit (`splitrl.isolation`), as reward functions run. An episode
lives on one worker (its environment object is state); a worker serves one request at a time,
and episodes are spread over the workers as they start.

A call still running ``kill_grace_s`` after its time limit (code stuck in C) gets its worker
killed and replaced; that call's result is a time-out. The episodes that lived on the killed
worker are restarted on the new one when next used: ``reset`` with the same columns, then
their earlier calls replayed in order (tools are expected to be deterministic given their
inputs: see docs/environments.md), so an episode continues after a hung tool. A worker that
dies by itself (a crash) is handled the same way.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from splitrl.environments import _worker
from splitrl.environments.parsing import ToolCall

log = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0
STATUSES = ("ok", "malformed", "unknown", "error", "timeout")


@dataclass(frozen=True)
class Started:
    status: str  # ok | error | timeout
    text: str  # reset's text (appended to the prompt), or why it failed


@dataclass(frozen=True)
class CallResult:
    status: str  # one of STATUSES
    text: str  # the observation's content
    done: bool = False  # the environment ended the episode
    reward: float | None = None
    seconds: float = 0.0


@dataclass
class _Episode:
    columns: dict[str, Any]
    worker: int
    generation: int  # the worker's generation it was started on
    calls: list[ToolCall] = field(default_factory=list)  # answered calls, for a replay


class _Worker:
    def __init__(self, ctx, args: tuple):
        self.ctx, self.args = ctx, args
        self.lock = threading.Lock()
        self.generation = 0
        self.closed = False
        self.schemas: list[dict[str, Any]] = []
        self._spawn()

    def _spawn(self) -> None:
        parent, child = self.ctx.Pipe(duplex=True)
        self.process = self.ctx.Process(target=_worker.worker_main, args=(child, *self.args),
                                        name="environment-worker", daemon=True)
        self.process.start()
        child.close()
        self.conn = parent
        if not self.conn.poll(START_TIMEOUT_S):
            self.process.kill()
            raise RuntimeError(f"an environment worker did not start within "
                               f"{START_TIMEOUT_S:.0f} s")
        try:
            message = self.conn.recv()
        except (EOFError, OSError):
            raise RuntimeError(f"an environment worker exited at start (exit code "
                               f"{self.process.exitcode})") from None
        if message[0] != "ready":
            self.process.kill()
            raise RuntimeError(f"environment {self.args[0]!r} could not be loaded: {message[1]}")
        self.schemas = message[2]

    def replace(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(2)
        self.conn.close()
        self.generation += 1  # its episodes are restored on their next use
        self._spawn()

    def request(self, message: tuple, deadline_s: float) -> tuple | None:
        """The reply, or None if the worker did not answer in time or died (it is replaced);
        the caller holds ``lock``. A closed worker answers nothing and is not replaced."""
        if self.closed:
            return None
        try:
            self.conn.send(message)
            if self.conn.poll(deadline_s):
                return self.conn.recv()
        except (EOFError, OSError, ValueError):
            pass
        log.warning("environment worker killed or dead; replacing it",
                    extra={"pid": self.process.pid, "request": message[0]})
        try:
            self.replace()
        except RuntimeError as e:  # tried again at the next request (its pipe is closed)
            log.error("environment worker could not be replaced", extra={"error": str(e)})
        return None

    def close(self) -> None:
        self.closed = True
        try:
            self.conn.send(None)
        except (OSError, ValueError):
            pass
        self.process.join(2)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(1)
        self.conn.close()


def _by_worker(states: Iterable[tuple[str, _Episode | None]]) -> dict[int, list[str]]:
    """Episodes by the index of the worker each lives on (-1: unknown), in order."""
    groups: dict[int, list[str]] = {}
    for episode, state in states:
        groups.setdefault(-1 if state is None else state.worker, []).append(episode)
    return groups


class ToolRunner:
    """See the module docstring. Thread-safe: episodes are driven from many threads."""

    def __init__(self, name: str, options: dict[str, Any] | None = None, *, workers: int = 2,
                 timeout_s: float = 10.0, kill_grace_s: float = 1.0,
                 memory_mb: int | None = 2048, max_observation_chars: int = 4096,
                 start_method: str = "forkserver"):
        if workers < 1:
            raise ValueError(f"workers: expected >= 1, got {workers}")
        self.name = name
        self.timeout_s = timeout_s
        self.kill_grace_s = kill_grace_s
        ctx = multiprocessing.get_context(start_method)
        if start_method == "forkserver":
            # transformers' schema reader too: a replacement worker then starts in milliseconds.
            # The reader imports torch on every call where torch is installed (a tensor type for
            # its schemas): preloaded, a worker forks with it instead of importing it at start;
            # where torch is absent the forkserver skips it.
            modules = ["splitrl.environments._worker", "splitrl.environments.builtin",
                       "transformers.utils.chat_template_utils", "torch"]
            if ":" in name:
                modules.append(name.partition(":")[0])
            ctx.set_forkserver_preload(modules)
        args = (name, dict(options or {}), timeout_s, memory_mb, max_observation_chars)
        self._episodes: dict[str, _Episode] = {}
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        try:
            for _ in range(workers):
                self._workers.append(_Worker(ctx, args))
        except BaseException:
            self.close()
            raise
        self.schemas: list[dict[str, Any]] = self._workers[0].schemas
        self.tool_names = [s["function"]["name"] for s in self.schemas]
        self._next = itertools.count()

    @property
    def _deadline_s(self) -> float:
        return self.timeout_s + self.kill_grace_s

    @property
    def workers(self) -> int:
        """How many worker processes run the episodes."""
        return len(self._workers)

    def start(self, episode: str, columns: dict[str, Any]) -> Started:
        """Start ``episode`` from a dataset row's columns (``reset(**columns)``)."""
        return self.start_many([(episode, columns)])[0]

    def start_many(self, episodes: Sequence[tuple[str, dict[str, Any]]]) -> list[Started]:
        """Start several episodes (id, columns) on one worker, the next in turn, in one round
        trip; one `Started` per episode, in order. A sampler starts a request's episodes in a
        batch per worker (`workers` batches, spread as one by one would be). Each reset runs
        under the time limit; if the worker must be killed (one stuck past it), every start
        of the batch is a time-out."""
        if not episodes:
            return []
        with self._lock:
            if not self._workers:
                raise RuntimeError(f"the tool runner of {self.name!r} is closed")
            index = next(self._next) % len(self._workers)
            worker = self._workers[index]
        with worker.lock:
            reply = worker.request(("start", list(episodes)),
                                   len(episodes) * self.timeout_s + self.kill_grace_s)
            generation = worker.generation
        if reply is None:
            return [Started("timeout", f"reset took longer than {self.timeout_s:g} s")
                    ] * len(episodes)
        with self._lock:
            for (episode, columns), (status, _) in zip(episodes, reply, strict=True):
                if status == "ok":
                    self._episodes[episode] = _Episode(dict(columns), index, generation)
        return [Started(status, text) for status, text in reply]

    def call(self, episode: str, call: ToolCall) -> CallResult:
        """Run one tool call of a started episode; never raises for what the tool does."""
        with self._lock:
            state = self._episodes.get(episode)
            workers = self._workers
        if state is None or not workers:
            raise KeyError(f"episode {episode!r} was not started (or has ended)")
        worker = workers[state.worker]
        start = time.perf_counter()
        with worker.lock:
            if state.generation != worker.generation and not self._restore(worker, episode,
                                                                          state):
                return CallResult("error", "the environment could not be restored after its "
                                  "worker was replaced", done=True)
            reply = worker.request(("call", episode, call.name, call.arguments),
                                   self._deadline_s)
        if reply is None:
            return CallResult("timeout", f"tool {call.name or self.tool_names[0]!r} timed "
                              f"out after {self.timeout_s:g} s",
                              seconds=time.perf_counter() - start)
        status, text, done, reward, seconds = reply
        state.calls.append(call)
        return CallResult(status, text, bool(done), reward, seconds)

    def _restore(self, worker: _Worker, episode: str, state: _Episode) -> bool:
        """Start ``episode`` again on ``worker``'s new process and replay its calls (the
        caller holds the worker's lock)."""
        reply = worker.request(("start", [(episode, state.columns)]), self._deadline_s)
        if reply is None or reply[0][0] != "ok":
            return False
        for past in state.calls:
            if worker.request(("call", episode, past.name, past.arguments),
                              self._deadline_s) is None:
                return False
        state.generation = worker.generation
        return True

    def end(self, episode: str) -> float | None:
        """End ``episode``: its environment's ``reward`` attribute, if a number."""
        return self.end_many([episode])[0]

    def by_worker(self, episodes: Sequence[str]) -> list[list[str]]:
        """``episodes`` grouped by the worker each lives on (unknown ones together): each
        group is one round trip of `end_many`."""
        with self._lock:
            return list(_by_worker((e, self._episodes.get(e)) for e in episodes).values())

    def end_many(self, episodes: Sequence[str]) -> list[float | None]:
        """End several episodes: each one's environment's ``reward`` attribute if a number,
        else None (also for an unknown episode), in order; one round trip per worker they
        live on (`by_worker`)."""
        with self._lock:
            states = {e: self._episodes.pop(e, None) for e in episodes}
            workers = self._workers
        rewards: dict[str, float | None] = dict.fromkeys(episodes)
        known = {e: s for e, s in states.items() if s is not None}  # others: unknown
        groups = _by_worker(known.items()) if workers else {}  # none: the runner closed
        for index, group in groups.items():
            worker = workers[index]
            with worker.lock:
                group = [e for e in group if known[e].generation == worker.generation
                         or self._restore(worker, e, known[e])]
                reply = worker.request(("end", group), self._deadline_s) if group else None
            if reply is not None:
                rewards.update(zip(group, reply[1], strict=True))
        return [rewards[e] for e in episodes]

    def close(self) -> None:
        """Stop the workers. Episodes still being driven (a sampler shutting down) then end
        with no reward and their calls find no episode; a worker finishes the request it is
        answering first, and is never replaced once closed."""
        with self._lock:
            workers, self._workers = self._workers, []
            self._episodes.clear()
        for worker in workers:
            with worker.lock:
                worker.close()

    def __enter__(self) -> ToolRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
