"""A pool of scoring processes with per-call time limits; hung workers are killed and replaced.

Why processes: reward functions are user code and symbolic math. They hang, crash, leak memory
and (math-verify) rely on ``signal.alarm``, which only works in a process's main thread. So each
task, one function called once on one batch of items (a prompt's group of completions, or a
single item), runs in a worker process, under

- a *soft* limit of ``timeout_s``: the worker's own timer interrupts the call (``_worker.py``);
- a *hard* limit of ``timeout_s + kill_grace_s``: the parent kills the worker (SIGKILL) and
  starts a replacement. Code stuck in C (``9^{9^{9^{9}}}``) is only stopped this way.

Either way every item of the task scores 0 with reason ``"timeout"``: no worker is held longer
than the hard limit, whatever the batch contains. A worker that dies (segfault, ``os._exit``,
out of memory) gives ``"error: worker died ..."`` for the items of its current task; the rest of
its chunk is queued again. Nothing a request contains can take the pool down.

One dispatcher thread owns the workers. Callers (gRPC handler threads) submit a request's tasks
and wait; tasks from all requests share one FIFO queue and go to idle workers in chunks (several
tasks per message amortise pickling and wake-ups; a batch shared by several functions is
pickled once per chunk). Workers are started with the ``forkserver`` method: the forkserver is a
clean single-threaded process with math-verify already imported, so a replacement is ready in
milliseconds and never inherits the gRPC server's threads.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import multiprocessing
import multiprocessing.connection
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from reward_service import _worker, math_accuracy
from reward_service.registry import FunctionSpec

log = logging.getLogger(__name__)

MAX_CHUNK = 16
# Send a worker its next chunk early only while its current task is young; tasks queued behind
# a task older than STEAL_AFTER_S are copied back to the queue for idle workers (first result
# wins), so a hanging item does not hold up the ones behind it until it is killed.
PREFETCH_MAX_S = 0.05
STEAL_AFTER_S = 0.25
START_TIMEOUT_S = 60.0
PRELOAD = ["reward_service._worker", "reward_service.math_accuracy", "reward_service.functions"]


UNAVAILABLE = "unavailable"  # an Outcome status: a judge could not be reached (judges.py)


@dataclass
class Outcome:
    score: float
    reason: str = ""
    status: str = "ok"  # ok | none | timeout | error | nonfinite | cancelled (scoring.OUTCOMES)
    # | UNAVAILABLE (a judge)
    seconds: float = 0.0


@dataclass
class _Batch:
    """The tasks of one ``score`` call; ``outcomes[i]`` holds task i's outcome per item."""

    outcomes: list[list[Outcome] | None]
    remaining: int
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False


@dataclass
class _Task:
    batch: _Batch
    index: int
    fn: int
    items: list[dict[str, Any]]
    copied: bool = False  # queued again while waiting behind a slow task on another worker

    @property
    def done(self) -> bool:
        return self.batch.outcomes[self.index] is not None


@dataclass
class _Worker:
    process: Any
    conn: Any
    ready: bool = False
    started: float = field(default_factory=time.monotonic)
    # Tasks sent and not answered yet, in order; the first is running now.
    inflight: collections.deque[_Task] = field(default_factory=collections.deque)
    sent: int = 0  # tasks sent so far (task ids are 0, 1, 2, ... per worker)
    answered: int = 0
    task_started: float = 0.0  # when inflight[0] started (as seen by the parent)


class WorkerPool:
    """Score ``(function index, item)`` tasks in ``workers`` processes with time limits."""

    def __init__(self, specs: Sequence[FunctionSpec], workers: int, *, kill_grace_s: float = 0.5,
                 memory_mb: int | None = None, start_method: str = "forkserver",
                 on_event: Callable[[str, str], None] | None = None):
        self.specs = list(specs)
        self.kill_grace_s = kill_grace_s
        self.memory_mb = memory_mb
        self.on_event = on_event or (lambda kind, function: None)
        self.restarts = 0
        self._ctx = multiprocessing.get_context(start_method)
        if start_method == "forkserver":
            modules = [s.name.partition(":")[0] for s in self.specs if ":" in s.name]
            if math_accuracy.configured(self.specs):
                modules.append("math_verify")  # imported on first use otherwise
            self._ctx.set_forkserver_preload(PRELOAD + modules)
        self._lock = threading.Lock()
        self._queue: collections.deque[_Task] = collections.deque()
        self._ids = itertools.count()
        self._wake_r, self._wake_w = self._ctx.Pipe(duplex=False)
        self._closed = False
        self._workers = [self._start_worker() for _ in range(workers)]
        self._wait_ready()
        self._thread = threading.Thread(target=self._run, name="reward-pool", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public

    def score(self, tasks: Sequence[tuple[int, list[dict[str, Any]]]],
              cancelled: Callable[[], bool] | None = None) -> list[list[Outcome]]:
        """Outcomes of ``(function index, items)`` tasks, one per item, in order. Blocks until
        all finish.

        ``cancelled`` is polled; once it returns True the tasks not yet started are dropped
        (status ``cancelled``), e.g. when a gRPC client has gone away.
        """
        if self._closed:
            raise RuntimeError("the worker pool is closed")
        batch = _Batch([None] * len(tasks), len(tasks))
        if not tasks:
            return []
        with self._lock:
            self._queue.extend(_Task(batch, i, fn, list(items))
                               for i, (fn, items) in enumerate(tasks))
        self._wake()
        while not batch.done.wait(0.2):
            if not self._thread.is_alive():
                raise RuntimeError("the reward pool's dispatcher thread has stopped")
            if cancelled is not None and not batch.cancelled and cancelled():
                batch.cancelled = True
                self._wake()
        return batch.outcomes  # type: ignore[return-value]

    @property
    def size(self) -> int:
        return len(self._workers)

    def close(self) -> None:
        """Stop the dispatcher and every worker (pending tasks are cancelled)."""
        if self._closed:
            return
        self._closed = True
        self._wake()
        self._thread.join(timeout=5)
        for w in self._workers:
            try:
                w.conn.send(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 2
        for w in self._workers:
            w.process.join(max(0.0, deadline - time.monotonic()))
            if w.process.is_alive():
                w.process.kill()
                w.process.join(1)
            w.conn.close()
        with self._lock:
            pending, self._queue = list(self._queue), collections.deque()
        for task in pending:
            self._finish(task, _same(task, Outcome(0.0, "cancelled", "cancelled")))

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ workers

    def _start_worker(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        # typeshed types get_context(str) as BaseContext; every concrete context has Process.
        process = self._ctx.Process(  # type: ignore[attr-defined]
            target=_worker.worker_main, args=(child, self.specs, self.memory_mb),
            name="reward-worker", daemon=True,
        )
        process.start()
        child.close()
        return _Worker(process, parent)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        for w in self._workers:
            if not w.conn.poll(max(0.0, deadline - time.monotonic())):
                self._abort_start(f"a worker did not start within {START_TIMEOUT_S:.0f} s")
            try:
                kind, detail = w.conn.recv()
            except (EOFError, OSError):
                self._abort_start(f"a worker exited at start (exit code {w.process.exitcode})")
            if kind != "ready":
                self._abort_start(f"a worker could not load the reward functions: {detail}")
            w.ready = True

    def _abort_start(self, message: str):
        for w in self._workers:
            w.process.kill()
        raise RuntimeError(message)

    def _replace(self, w: _Worker) -> None:
        if w.process.is_alive():
            w.process.kill()
        w.process.join(2)
        w.conn.close()
        self.restarts += 1
        self.on_event("restart", "")
        self._workers[self._workers.index(w)] = self._start_worker()

    # ------------------------------------------------------------------ dispatcher

    def _wake(self) -> None:
        try:
            self._wake_w.send_bytes(b"x")
        except (OSError, ValueError):
            pass

    def _finish(self, task: _Task, outcomes: list[Outcome]) -> bool:
        """Record a task's outcomes; False if it already had them (a copy finished first)."""
        batch = task.batch
        if batch.outcomes[task.index] is not None:
            return False
        batch.outcomes[task.index] = outcomes
        batch.remaining -= 1
        if batch.remaining == 0:
            batch.done.set()
        return True

    def _next_chunk(self) -> list[_Task]:
        with self._lock:
            # Drop tasks of cancelled batches, then take a fair share of what is queued.
            size = self._target_chunk()
            chunk: list[_Task] = []
            while self._queue and len(chunk) < size:
                task = self._queue.popleft()
                if task.done:
                    continue
                if task.batch.cancelled:
                    self._finish(task, _same(task, Outcome(0.0, "cancelled", "cancelled")))
                else:
                    chunk.append(task)
            return chunk

    def _assign(self) -> None:
        # A worker gets its next chunk while it still works on the current one (at most about
        # two chunks in flight), so it never waits for this thread to be scheduled.
        now = time.monotonic()
        for w in list(self._workers):
            if not w.ready or len(w.inflight) >= self._target_chunk():
                continue
            if w.inflight and now - w.task_started > PREFETCH_MAX_S:
                continue
            chunk = self._next_chunk()
            if not chunk and not w.inflight:
                self._steal(now)
                chunk = self._next_chunk()
            if not chunk:
                return
            message = [(w.sent + n, t.fn, t.items) for n, t in enumerate(chunk)]
            if not w.inflight:
                w.task_started = time.monotonic()
            w.inflight.extend(chunk)
            w.sent += len(chunk)
            try:
                w.conn.send(message)
            except (OSError, ValueError):
                self._worker_lost(w, "error: worker died before the task started")

    def _steal(self, now: float) -> None:
        for other in self._workers:
            if len(other.inflight) > 1 and now - other.task_started > STEAL_AFTER_S:
                waiting = [t for t in list(other.inflight)[1:] if not t.copied and not t.done]
                for t in waiting:
                    t.copied = True
                with self._lock:
                    self._queue.extend(waiting)

    def _target_chunk(self) -> int:
        """A worker's next chunk: with several workers, half its share of the queue (the rest
        stays to balance uneven tasks and to be stolen from a stuck one); a lone worker has
        nobody to balance with and takes the whole queue, so a Score of a few groups is one
        round trip to it instead of one per pair of groups."""
        workers = len(self._workers)
        share = len(self._queue) / (2 * workers if workers > 1 else 1)
        return min(MAX_CHUNK, max(1, math.ceil(share)))

    def _deadline(self, w: _Worker) -> float:
        spec = self.specs[w.inflight[0].fn]
        return w.task_started + spec.timeout_s + self.kill_grace_s

    def _requeue_rest(self, w: _Worker) -> None:
        rest = list(w.inflight)[1:]
        with self._lock:
            self._queue.extendleft(reversed(rest))
        w.inflight.clear()

    def _worker_lost(self, w: _Worker, reason: str, status: str = "error") -> None:
        task = w.inflight[0] if w.inflight else None
        if task is not None:
            spent = time.monotonic() - w.task_started
            if self._finish(task, _same(task, Outcome(0.0, reason, status, spent))):
                for _ in task.items:
                    self.on_event(status, self.specs[task.fn].name)
            self._requeue_rest(w)
        self._replace(w)

    def _on_message(self, w: _Worker) -> None:
        try:
            message = w.conn.recv()
        except (EOFError, OSError):
            w.process.join(1)
            code = w.process.exitcode
            log.warning("reward worker died", extra={"exit_code": code})
            self._worker_lost(w, f"error: worker died (exit code {code})")
            return
        if not w.ready:
            if message[0] == "ready":
                w.ready = True
            else:
                log.error("replacement worker failed to start", extra={"error": message[1]})
                self._replace(w)
            return
        for task_id, results, seconds in message:
            if task_id != w.answered or not w.inflight or len(results) != len(w.inflight[0].items):
                log.error("worker answered out of order",
                          extra={"got": task_id, "want": w.answered})
                self._worker_lost(w, "error: worker protocol error")
                return
            task = w.inflight.popleft()
            w.answered += 1
            outcomes = [Outcome(score, reason, status, seconds)
                        for score, reason, status in results]
            if self._finish(task, outcomes):
                for outcome in outcomes:
                    if outcome.status != "ok":
                        self.on_event(outcome.status, self.specs[task.fn].name)
        w.task_started = time.monotonic()

    def _run(self) -> None:
        while not self._closed:
            try:
                self._step()
            except Exception:  # never let the dispatcher die
                log.exception("reward pool dispatcher error")
                time.sleep(0.05)

    def _step(self) -> None:
        self._assign()
        now = time.monotonic()
        timeout = 1.0
        for w in self._workers:
            if w.inflight:
                timeout = min(timeout, self._deadline(w) - now)
            if len(w.inflight) > 1:
                timeout = min(timeout, PREFETCH_MAX_S)  # time to prefetch or steal
            elif not w.ready:
                timeout = min(timeout, w.started + START_TIMEOUT_S - now)
        conns = {w.conn: w for w in self._workers}
        ready = multiprocessing.connection.wait([self._wake_r, *conns], max(0.0, timeout))
        for conn in ready:
            if conn is self._wake_r:
                while self._wake_r.poll():
                    self._wake_r.recv_bytes()
            elif conn in conns:
                self._on_message(conns[conn])
        now = time.monotonic()
        for w in list(self._workers):
            if w.inflight and now > self._deadline(w):
                name = self.specs[w.inflight[0].fn].name
                log.warning("reward function exceeded its hard time limit; killing its worker",
                            extra={"function": name, "pid": w.process.pid})
                self._worker_lost(w, "timeout", "timeout")
            elif not w.ready and now > w.started + START_TIMEOUT_S:
                log.error("replacement worker did not start in time; retrying")
                self._replace(w)


def _same(task: _Task, outcome: Outcome) -> list[Outcome]:
    """``outcome`` for every item of ``task`` (a failed call fails for its whole batch)."""
    return [outcome] * len(task.items)
