"""The sampler's busy fraction while tools run: rows decoding with slow tools vs single-turn.

    make demo-tools            # trains the model this uses: runs/demo-tools/export
    HF_HUB_OFFLINE=1 JAX_PLATFORMS=cpu python bench/tool_latency.py [--model DIR]

The model of `make demo-tools` calls the `lookup` tool once per episode (``!``, then the end of
its turn) and answers with the digit it sees. Here the tool sleeps ``L`` seconds per call
(``--latencies``, default 50 ms and 500 ms): `SlowLookup`, in ``--workers`` isolated worker
processes as a sampler runs them. ``--prompts`` x ``--group`` episodes go through one
`GenerationEngine` of ``--rows`` decode rows and the sampler's episode driver
(`sampler_service.episodes.Episodes`), exactly as a Rollout runs them.

What is measured is whether a trajectory waiting on its tool holds the batch. A sampler serves
more than one request (an async run keeps several Rollouts in flight), so the engine is kept
busy with single-turn requests (``--length`` tokens each, no stop token) submitted by a feeder
thread, and the episodes run among them. Over the window from the episodes' start to their
end, with the batch already full:

    busy fraction = tokens decoded per CPU second of the sampler's process in that window
                    (the single-turn requests' and the episodes' model tokens) / tokens
                    decoded per CPU second by the same single-turn requests alone, over a
                    window of the same token count

CPU seconds (`time.process_time`), because on a shared machine wall time mostly measures the
other processes; on a dedicated sampler the two agree (the batch is kept full, so the process
never idles). The wall-clock ratio is printed beside it.

1.0 means the tool waits and the trajectories' returns cost the batch nothing: while episodes
wait on their tools their rows decode other work, and returning trajectories join without
stalling it (no compile, a small prefill). A trajectory that kept its row while waiting, or a
return that compiled a program, would show as a lower fraction. (Episodes alone cannot keep
the rows busy here: their turns are two tokens and the tool workers, not the sampler, set how
fast they go; the line "episodes alone" shows that bound.)

Returning trajectories are admitted in bucketed shapes (`scheduler.Scheduler._chunks`,
`_prefill_inputs`): a finite set of programs, compiled the first time each shape occurs. The
runs with episodes are repeated untimed until two in a row compile nothing (at most 12; XLA
compile events from `jax.monitoring`: the steady state of a sampler that has run a while),
then ``--repeats`` timed runs, best kept; the warm-up runs it took and the programs compiled
during the timed runs are printed by name. The load average is printed beside the timings.
``--profile`` also prints where each timed window's CPU seconds went (`Profile`: by thread,
by engine phase).
"""

from __future__ import annotations

import argparse
import gc
import os
import queue
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from splitrl.environments.builtin import Lookup  # noqa: E402


class SlowLookup(Lookup):
    """`lookup` whose tool takes ``latency_s`` seconds (an API call, a sandbox start)."""

    def __init__(self, latency_s: float = 0.05, call_reward: float = 0.0):
        super().__init__(call_reward=call_reward)
        self._latency_s = latency_s

    def lookup(self) -> str:
        """The value hidden in this episode's table entry."""
        time.sleep(self._latency_s)
        return super().lookup()


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(REPO / "runs" / "demo-tools" / "export"))
    ap.add_argument("--latencies", default="0.05,0.5", help="seconds per tool call")
    ap.add_argument("--rows", type=int, default=64, help="the engine's decode rows")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=8, help="episodes per prompt")
    ap.add_argument("--workers", type=int, default=16, help="tool worker processes")
    ap.add_argument("--length", type=int, default=24,
                    help="tokens of each single-turn completion")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--profile", action="store_true",
                    help="also print where the timed windows' CPU seconds go, by thread and by "
                         "the engine thread's phases (adds a little host work of its own)")
    return ap.parse_args()


class Profile:
    """Where a window's CPU seconds go (``--profile``).

    By thread: each Python thread's own CPU clock (the engine's, the episode drivers', the
    tool pool's that talks to the tool workers, the feeder's); "XLA" is the process's native
    threads (the CPU client's threads that execute the compiled programs), read from
    /proc/self/task/*/schedstat. The tool workers are other processes: not counted, as in the
    busy fraction. On the engine thread, per phase of `Scheduler.step`: the thread's own CPU
    (host work: Python, dispatch) and the native threads' CPU meanwhile (the phase's
    programs: the engine thread alone runs programs). Phases are timed by wrapping the
    scheduler's methods on the instance (and `_Driver.run` for the drivers' threads, which end
    inside the window): what a sampler runs, plus a clock read around each call. Python's
    cyclic garbage collections are timed too (`gc.callbacks`), in whichever thread runs them."""

    PHASES = ("step", "_retire", "_admit", "_layout", "_prefill_chunk", "_prefill_inputs",
              "_decode", "_decode_inputs")
    RUNS_PROGRAMS = ("step", "_layout", "_prefill_chunk", "_decode")  # the rest: host only

    def __init__(self, scheduler):
        from sampler_service import episodes

        self.host = dict.fromkeys(self.PHASES, 0.0)
        self.xla = dict.fromkeys(self.PHASES, 0.0)
        self.calls = dict.fromkeys(self.PHASES, 0)
        self.drivers = 0.0  # CPU of the episode drivers' threads that ended
        self.gc = 0.0  # CPU of Python's cyclic garbage collections, in whichever thread
        self._gc_start: dict[int, float] = {}
        gc.callbacks.append(self._on_gc)
        self._native: list[int] = []
        for name in self.PHASES:
            setattr(scheduler, name, self._timed(name, getattr(scheduler, name)))
        run = episodes._Driver.run  # noqa: SLF001 - profiling what a sampler runs

        def driver_run(driver) -> None:
            try:
                run(driver)
            finally:
                self.drivers += time.thread_time()
        episodes._Driver.run = driver_run  # noqa: SLF001

    def _on_gc(self, phase: str, _info: dict) -> None:
        if phase == "start":
            self._gc_start[threading.get_ident()] = time.thread_time()
        elif (start := self._gc_start.pop(threading.get_ident(), None)) is not None:
            self.gc += time.thread_time() - start

    def _native_cpu(self) -> float:
        total = 0
        for tid in self._native:
            try:
                with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
                    total += int(f.read().split()[0])
            except OSError:  # ended
                pass
        return total / 1e9

    def _timed(self, name, method):
        native = self._native_cpu if name in self.RUNS_PROGRAMS else lambda: 0.0

        def timed(*args, **kwargs):
            host, xla = time.thread_time(), native()
            try:
                return method(*args, **kwargs)
            finally:
                self.host[name] += time.thread_time() - host
                self.xla[name] += native() - xla
                self.calls[name] += 1
        return timed

    def snapshot(self) -> dict:
        threads: dict[str, float] = {"episodes": self.drivers}
        python = set()
        for thread in threading.enumerate():
            python.add(thread.native_id)
            try:
                seconds = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
            except (OSError, TypeError):  # ended meanwhile
                continue
            kind = thread.name.split("_")[0].split("-")[0]  # tools_3 -> tools, engine-0 -> engine
            threads[kind] = threads.get(kind, 0.0) + seconds
        self._native = [int(t) for t in os.listdir("/proc/self/task") if int(t) not in python]
        threads["XLA"] = self._native_cpu()
        return {"process": time.process_time(), "threads": threads, "gc": self.gc,
                "host": dict(self.host),
                "xla": dict(self.xla), "calls": dict(self.calls)}

    @staticmethod
    def report(start: dict, end: dict) -> str:
        total = end["process"] - start["process"]
        threads = {k: end["threads"][k] - start["threads"].get(k, 0.0)
                   for k in end["threads"]}
        threads["unattributed"] = total - sum(threads.values())
        calls = {k: end["calls"][k] - start["calls"][k] for k in end["calls"]}

        def phases(which: str) -> dict:
            d = {k: end[which][k] - start[which][k] for k in end[which]}
            out = {"retire": d["_retire"], "admit (choose rows)": d["_admit"],
                   "layout": d["_layout"], "prefill inputs": d["_prefill_inputs"],
                   "prefill+admit": d["_prefill_chunk"] - d["_prefill_inputs"],
                   "decode inputs": d["_decode_inputs"],
                   "decode": d["_decode"] - d["_decode_inputs"]}
            out["rest of step"] = d["step"] - sum(out.values())
            return out

        host, xla = phases("host"), phases("xla")
        lines = [f"    CPU {total:.2f} s by thread: " + ", ".join(
            f"{k} {v:.3f}" for k, v in sorted(threads.items(), key=lambda kv: -kv[1]))
            + f"; of which Python's garbage collections {end['gc'] - start['gc']:.3f}"]
        lines.append(f"    engine steps ({calls['step']} steps, {calls['_decode']} segments, "
                     f"{calls['_prefill_chunk']} prefill chunks), host + XLA CPU: " + ", ".join(
                         f"{k} {host[k]:.3f}+{xla[k]:.3f}" for k in host))
        return "\n".join(lines)


class Feeder:
    """Keeps the engine's queue holding single-turn requests (8 prompts x 8 completions each,
    at most two waiting) until stopped: the rest of a busy sampler's work. It wakes when one
    of its requests ends (as a Rollout's handler waits on its request), not on a timer, so
    it costs the sampler's process nothing while it waits."""

    def __init__(self, engine, prompt, options):
        self.engine, self.prompt, self.options = engine, prompt, options
        self._stop = threading.Event()
        self._ended = threading.Event()  # one of the requests ended
        self._requests: list = []
        self._thread = threading.Thread(target=self._run, name="feeder", daemon=True)
        self._thread.start()

    def put(self, event) -> None:
        """The requests' sink: their groups, then None (or an error) at their end."""
        if event is None or isinstance(event, BaseException):
            self._ended.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._ended.clear()
            self._requests = [r for r in self._requests if not r.finished]
            if len(self._requests) < 2 + self.engine.max_batch_size // 64:
                self._requests.append(
                    self.engine.submit([self.prompt] * 8, self.options, 8, sink=self))
            else:
                self._ended.wait()

    def stop(self) -> None:
        self._stop.set()
        self._ended.set()
        self._thread.join()
        for request in self._requests:
            request.cancel()
        while self.engine.stats["active_sequences"] or self.engine.stats["queued_sequences"]:
            time.sleep(0.01)


def main() -> int:
    args = parse_args()
    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        print(f"no model at {model_dir}: run `make demo-tools` first (or pass --model)",
              file=sys.stderr)
        return 2
    os.environ.setdefault("SPLITRL_CODE_DIRS", str(Path(__file__).resolve().parent))
    import jax
    from flax import nnx

    from sampler_service.engine import GenerationEngine
    from sampler_service.episodes import Episodes
    from sampler_service.sampling import SamplingOptions
    from splitrl.config import EnvironmentConfig, MeshConfig
    from splitrl.mesh import build_mesh
    from splitrl.models import from_pretrained
    from splitrl.tokenizer import eos_token_ids, load_tokenizer

    compiled: list[str] = []  # XLA compilations in this process: what a warm sampler never does

    def on_duration(event: str, _seconds: float, fun_name: str = "?", **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(fun_name)

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    tokenizer = load_tokenizer(model_dir)
    model = from_pretrained(model_dir)
    graphdef, state = nnx.split(model)
    mesh = build_mesh(MeshConfig(axes={"tensor": 1}), jax.devices()[:1])
    stops = tuple(eos_token_ids(tokenizer))
    # No engine-wide stop token: the episodes' turns stop on the model's end of turn
    # (their options), the single-turn requests run their whole length.
    engine = GenerationEngine(model.config, graphdef, mesh=mesh, max_batch_size=args.rows,
                              max_sequence_length=32, eos_token_ids=(),
                              pad_token_id=tokenizer.pad_token_id or 0,
                              weights=lambda: (0, placed))
    placed = engine.place_state(state)
    profile = Profile(engine.scheduler) if args.profile else None

    prompt = tokenizer.encode("?", add_special_tokens=False)
    prompts = [prompt] * args.prompts
    turn = SamplingOptions(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=2,
                           stop_token_ids=stops, seed=0, greedy=False)
    single = SamplingOptions(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=args.length,
                             stop_token_ids=(), seed=0, greedy=False)
    columns = [{"secret": i % 10} for i in range(args.prompts)]

    def counters() -> tuple:
        st = engine.stats
        return (time.perf_counter(), st["tokens_generated"], st["live_row_steps"],
                st["row_steps"], st["segments"], st["prefill_chunks"], st["prefill_seconds"],
                st["decode_seconds"], time.process_time(), len(compiled),
                profile.snapshot() if profile else None)

    def window(start, end) -> dict:
        seconds, tokens = end[0] - start[0], end[1] - start[1]
        rows = end[3] - start[3]
        return {"seconds": seconds, "tokens": tokens, "rate": tokens / seconds,
                "occupancy": (end[2] - start[2]) / rows if rows else 0.0,
                "segments": end[4] - start[4], "prefills": end[5] - start[5],
                "prefill_s": end[6] - start[6], "decode_s": end[7] - start[7],
                "cpu_s": end[8] - start[8], "compiles": compiled[start[9]:end[9]],
                "cpu_rate": tokens / (end[8] - start[8]),
                "profile": Profile.report(start[10], end[10]) if profile else ""}

    def where(run: dict) -> str:
        return (f"{run['segments']} segments, {run['prefills']} prefills; prefill "
                f"{run['prefill_s']:.2f} s, decode {run['decode_s']:.2f} s, process CPU "
                f"{run['cpu_s']:.2f} s" + (f"\n{run['profile']}" if run["profile"] else ""))

    def batch_full() -> None:
        while engine.stats["active_sequences"] < engine.max_batch_size:
            time.sleep(0.005)

    def episodes_run(episodes, feeder: bool) -> dict:
        """One run of the episodes, among single-turn requests when ``feeder``."""
        background = Feeder(engine, prompt, single) if feeder else None
        try:
            if background is not None:
                batch_full()
            events: queue.SimpleQueue = queue.SimpleQueue()
            keys = episodes.new_keys(len(prompts), args.group)
            start = counters()
            _, failed = episodes.reset(keys, columns)
            episodes.run(prompts, list(range(len(prompts))), keys, turn, args.group,
                         exclusive=False, sink=events, failed=failed)
            model_tokens = calls = 0
            while (event := events.get()) is not None:
                if isinstance(event, BaseException):
                    raise event
                for t in event.sequences:
                    model_tokens += sum(t.model_token_mask)
                    calls += sum(len(x.tool_calls) for x in t.turns)
            out = window(start, counters())
        finally:
            if background is not None:
                background.stop()
        out.update(model_tokens=model_tokens, calls=calls)
        return out

    def single_run(tokens: int) -> dict:
        """Single-turn requests alone, over a window of ``tokens`` decoded tokens."""
        background = Feeder(engine, prompt, single)
        try:
            batch_full()
            start = counters()
            while engine.stats["tokens_generated"] - start[1] < tokens:
                time.sleep(0.002)
            return window(start, counters())
        finally:
            background.stop()

    def warm_up(episodes, most: int = 12) -> int:
        """Runs of the episodes among single-turn requests until two in a row compile nothing
        new (at most ``most``): the steady state of a sampler that has run a while, whose
        bucketed shapes are all compiled (one clean run still left rare shapes for the timed
        runs to compile). Returns the runs it took."""
        clean = 0
        for runs in range(1, most + 1):
            clean = 0 if episodes_run(episodes, feeder=True)["compiles"] else clean + 1
            if clean == 2:
                return runs
        return most

    def best(runs: list[dict]) -> dict:
        return max(runs, key=lambda r: r["cpu_rate"])

    print(f"model {model_dir}; {args.prompts} prompts x {args.group} episodes, {args.rows} "
          f"decode rows, {args.workers} tool workers, single-turn completions of "
          f"{args.length} tokens; load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores", flush=True)
    try:
        for latency in [float(x) for x in args.latencies.split(",") if x]:
            cfg = EnvironmentConfig(name="tool_latency:SlowLookup",
                                    options={"latency_s": latency}, workers=args.workers,
                                    max_turns=3, tool_timeout_s=max(10.0, 4 * latency))
            episodes = Episodes(cfg, tokenizer, engine, 32, stop_token_ids=stops)
            try:
                alone = episodes_run(episodes, feeder=False)
                single_run(alone["tokens"])  # compiles
                warm_runs = warm_up(episodes)
                mixed_runs = [episodes_run(episodes, feeder=True) for _ in range(args.repeats)]
                mixed = best(mixed_runs)
                ref_runs = [single_run(mixed["tokens"]) for _ in range(args.repeats)]
                ref = best(ref_runs)
                late = [name for r in mixed_runs + ref_runs for name in r["compiles"]]
            finally:
                episodes.close()
            floor = alone["calls"] * latency / args.workers
            print(f"latency {latency * 1000:.0f} ms: episodes alone {alone['model_tokens']} "
                  f"model tokens in {alone['seconds']:.2f} s ({alone['calls']} tool calls; "
                  f"the tool workers alone need {floor:.2f} s)", flush=True)
            print(f"  with single-turn requests: {mixed['tokens']} tokens "
                  f"({mixed['model_tokens']} the episodes') in {mixed['seconds']:.2f} s wall "
                  f"({mixed['rate']:.0f} tok/s), rows decoding {mixed['occupancy']:.2f}; "
                  f"{where(mixed)}", flush=True)
            print(f"  single-turn alone: {ref['tokens']} tokens in {ref['seconds']:.2f} s wall "
                  f"({ref['rate']:.0f} tok/s), rows decoding {ref['occupancy']:.2f}; "
                  f"{where(ref)}", flush=True)
            print(f"  {warm_runs} warm-up runs; {len(late)} XLA compilations in the timed runs "
                  f"{sorted(set(late))}; "
                  f"wall-clock ratio {mixed['rate'] / ref['rate']:.2f}", flush=True)
            print(f"tool-latency busy fraction: {mixed['cpu_rate'] / ref['cpu_rate']:.2f} "
                  f"(tool latency {latency * 1000:.0f} ms)", flush=True)
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
