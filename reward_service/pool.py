"""A pool of scoring processes with per-item time limits; hung workers are killed and replaced.

Why processes: reward functions are user code and symbolic math. They hang, crash, leak memory
and (math-verify) rely on ``signal.alarm``, which only works in a process's main thread. So each
(item, function) task runs in a worker process, under

- a *soft* limit of ``timeout_s``: the worker's own timer interrupts the call (``_worker.py``);
- a *hard* limit of ``timeout_s + kill_grace_s``: the parent kills the worker (SIGKILL) and
  starts a replacement. Code stuck in C (``9^{9^{9^{9}}}``) is only stopped this way.

Either way the task scores 0 with reason ``"timeout"``. A worker that dies (segfault, ``os._exit``,
out of memory) gives ``"error: worker died ..."`` for its current task; the rest of its chunk is
queued again. Nothing a request contains can take the pool down.

One dispatcher thread owns the workers. Callers (gRPC handler threads) submit a batch of tasks
and wait; tasks from all batches share one FIFO queue and go to idle workers in chunks (several
tasks per message amortise pickling and wake-ups; an item shared by several functions is
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

from reward_service import _worker
from reward_service.registry import FunctionSpec

log = logging.getLogger(__name__)

MAX_CHUNK = 16
START_TIMEOUT_S = 60.0
PRELOAD = ["reward_service._worker", "reward_service.math_accuracy", "reward_service.functions"]


@dataclass
class Outcome:
    score: float
    reason: str = ""
    status: str = "ok"  # ok | timeout | error | nonfinite | cancelled
    seconds: float = 0.0


@dataclass
class _Batch:
    outcomes: list[Outcome | None]
    remaining: int
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False


@dataclass
class _Task:
    batch: _Batch
    index: int
    fn: int
    item: dict[str, Any]


@dataclass
class _Worker:
    process: Any
    conn: Any
    ready: bool = False
    started: float = field(default_factory=time.monotonic)
    chunk: list[_Task] = field(default_factory=list)
    position: int = 0  # index in chunk of the task running now
    task_started: float = 0.0


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

    def score(self, tasks: Sequence[tuple[int, dict[str, Any]]],
              cancelled: Callable[[], bool] | None = None) -> list[Outcome]:
        """Outcomes of ``(function index, item)`` tasks, in order. Blocks until all finish.

        ``cancelled`` is polled; once it returns True the tasks not yet started are dropped
        (status ``cancelled``), e.g. when a gRPC client has gone away.
        """
        if self._closed:
            raise RuntimeError("the worker pool is closed")
        batch = _Batch([None] * len(tasks), len(tasks))
        if not tasks:
            return []
        with self._lock:
            self._queue.extend(_Task(batch, i, fn, item) for i, (fn, item) in enumerate(tasks))
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
            self._finish(task, Outcome(0.0, "cancelled", "cancelled"))

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ workers

    def _start_worker(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
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

    def _finish(self, task: _Task, outcome: Outcome) -> None:
        batch = task.batch
        if batch.outcomes[task.index] is not None:
            return
        batch.outcomes[task.index] = outcome
        batch.remaining -= 1
        if batch.remaining == 0:
            batch.done.set()

    def _next_chunk(self) -> list[_Task]:
        with self._lock:
            # Drop tasks of cancelled batches, then take a fair share of what is queued.
            while self._queue and self._queue[0].batch.cancelled:
                self._finish(self._queue.popleft(), Outcome(0.0, "cancelled", "cancelled"))
            size = min(MAX_CHUNK, max(1, math.ceil(len(self._queue) / (2 * len(self._workers)))))
            chunk = []
            while self._queue and len(chunk) < size:
                task = self._queue.popleft()
                if task.batch.cancelled:
                    self._finish(task, Outcome(0.0, "cancelled", "cancelled"))
                else:
                    chunk.append(task)
            return chunk

    def _assign(self) -> None:
        for w in list(self._workers):
            if not w.ready or w.chunk:
                continue
            chunk = self._next_chunk()
            if not chunk:
                return
            message = [(n, t.fn, t.item) for n, t in enumerate(chunk)]
            w.chunk, w.position, w.task_started = chunk, 0, time.monotonic()
            try:
                w.conn.send(message)
            except (OSError, ValueError):
                self._worker_lost(w, "error: worker died before the task started")

    def _deadline(self, w: _Worker) -> float:
        spec = self.specs[w.chunk[w.position].fn]
        return w.task_started + spec.timeout_s + self.kill_grace_s

    def _requeue_rest(self, w: _Worker) -> None:
        rest = w.chunk[w.position + 1:]
        with self._lock:
            self._queue.extendleft(reversed(rest))
        w.chunk = []

    def _worker_lost(self, w: _Worker, reason: str, status: str = "error") -> None:
        task = w.chunk[w.position] if w.chunk else None
        if task is not None:
            spent = time.monotonic() - w.task_started
            self._finish(task, Outcome(0.0, reason, status, spent))
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
        task_id, score, reason, status, seconds = message
        if task_id != w.position:
            log.error("worker answered out of order", extra={"got": task_id, "want": w.position})
            self._worker_lost(w, "error: worker protocol error")
            return
        task = w.chunk[w.position]
        self._finish(task, Outcome(score, reason, status, seconds))
        if status != "ok":
            self.on_event(status, self.specs[task.fn].name)
        w.position += 1
        w.task_started = time.monotonic()
        if w.position == len(w.chunk):
            w.chunk = []

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
            if w.chunk:
                timeout = min(timeout, self._deadline(w) - now)
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
            if w.chunk and now > self._deadline(w):
                name = self.specs[w.chunk[w.position].fn].name
                log.warning("reward function exceeded its hard time limit; killing its worker",
                            extra={"function": name, "pid": w.process.pid})
                self._worker_lost(w, "timeout", "timeout")
            elif not w.ready and now > w.started + START_TIMEOUT_S:
                log.error("replacement worker did not start in time; retrying")
                self._replace(w)
