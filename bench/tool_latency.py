"""The sampler's busy fraction when tools are slow: multi-turn episodes vs single-turn generation.

    make demo-tools            # trains the model this uses: runs/demo-tools/export
    HF_HUB_OFFLINE=1 JAX_PLATFORMS=cpu python bench/tool_latency.py [--model DIR]

The model of `make demo-tools` calls the `lookup` tool once per episode (``!``, then the end of
its turn) and answers with the digit it sees. Here the tool sleeps ``L`` seconds per call
(``--latencies``, default 50 ms and 500 ms): `SlowLookup`, in ``--workers`` isolated worker
processes as a sampler runs them. ``--prompts`` x ``--group`` episodes go through one
`GenerationEngine` of ``--rows`` decode rows and the sampler's episode driver
(`sampler_service.episodes.Episodes`), exactly as a Rollout runs them.

The reference is single-turn generation of the same number of model tokens by the same engine
settings: the same prompts and group, each completion as long as an episode's model tokens on
average (no stop token, so every completion has exactly that length).

    busy fraction = model tokens per second with tools / model tokens per second single-turn

1.0 means the tool waits cost the batch nothing: while some episodes wait on their tools, the
others' turns fill the rows. Each measurement runs once to compile (not timed), then
``--repeats`` timed runs, best kept. Timings on a shared machine depend on its load: the load
average is printed beside them.
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
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
    ap.add_argument("--repeats", type=int, default=2)
    return ap.parse_args()


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

    tokenizer = load_tokenizer(model_dir)
    model = from_pretrained(model_dir)
    graphdef, state = nnx.split(model)
    mesh = build_mesh(MeshConfig(axes={"tensor": 1}), jax.devices()[:1])
    stops = eos_token_ids(tokenizer)

    def engine(eos):
        eng = GenerationEngine(model.config, graphdef, mesh=mesh, max_batch_size=args.rows,
                               max_sequence_length=32, eos_token_ids=eos,
                               pad_token_id=tokenizer.pad_token_id or 0,
                               weights=lambda: (0, placed))
        return eng

    single_engine = engine(())  # the reference's: no stop token
    placed = single_engine.place_state(state)

    prompt = tokenizer.encode("?", add_special_tokens=False)
    prompts = [prompt] * args.prompts
    options = SamplingOptions(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=2,
                              stop_token_ids=(), seed=0, greedy=False)
    columns = [{"secret": i % 10} for i in range(args.prompts)]

    def episodes_run(episodes) -> tuple[float, int, float]:
        """(seconds, model tokens, tool calls per episode) of one run."""
        events: queue.SimpleQueue = queue.SimpleQueue()
        keys = episodes.new_keys(len(prompts), args.group)
        start = time.perf_counter()
        _, failed = episodes.reset(keys, columns)
        episodes.run(prompts, list(range(len(prompts))), keys, options, args.group,
                     exclusive=False, sink=events, failed=failed)
        tokens = calls = 0
        while (event := events.get()) is not None:
            if isinstance(event, BaseException):
                raise event
            for t in event.sequences:
                tokens += sum(t.model_token_mask)
                calls += sum(len(turn.tool_calls) for turn in t.turns)
        return time.perf_counter() - start, tokens, calls / (len(prompts) * args.group)

    def single_run(eng, length: int) -> tuple[float, int]:
        opts = SamplingOptions(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=length,
                               stop_token_ids=(), seed=0, greedy=False)
        start = time.perf_counter()
        out = eng.submit(prompts, opts, args.group).result()
        return time.perf_counter() - start, sum(len(s.token_ids) for g in out for s in g)

    print(f"model {model_dir}; {args.prompts} prompts x {args.group} episodes, {args.rows} "
          f"decode rows, {args.workers} tool workers; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    for latency in [float(x) for x in args.latencies.split(",") if x]:
        tool_engine = engine(stops)
        cfg = EnvironmentConfig(name="tool_latency:SlowLookup",
                                options={"latency_s": latency}, workers=args.workers,
                                max_turns=3, tool_timeout_s=max(10.0, 4 * latency))
        episodes = Episodes(cfg, tokenizer, tool_engine, 32, stop_token_ids=stops)
        try:
            episodes_run(episodes)  # compiles
            best = min((episodes_run(episodes) for _ in range(args.repeats)),
                       key=lambda r: r[0] / max(r[1], 1))
            stats = tool_engine.stats
        finally:
            episodes.close()
            tool_engine.close()
        print(f"  engine: {stats['segments']} segments, {stats['prefills']} prefills, "
              f"prefill {stats['prefill_seconds']:.2f} s, decode {stats['decode_seconds']:.2f} s, "
              f"{stats['compiled_programs']} programs", flush=True)
        seconds, tokens, calls = best
        length = max(1, round(tokens / (len(prompts) * args.group)))
        single_run(single_engine, length)  # compiles
        ref_seconds, ref_tokens = min((single_run(single_engine, length)
                                       for _ in range(args.repeats)),
                                      key=lambda r: r[0] / max(r[1], 1))
        with_tools, single = tokens / seconds, ref_tokens / ref_seconds
        print(f"latency {latency * 1000:.0f} ms: episodes {tokens} model tokens in "
              f"{seconds:.2f} s ({with_tools:.1f} tok/s, {calls:.2f} tool calls per episode); "
              f"single-turn {ref_tokens} tokens ({length} per completion) in {ref_seconds:.2f} s "
              f"({single:.1f} tok/s)", flush=True)
        print(f"tool-latency busy fraction: {with_tools / single:.2f} "
              f"(tool latency {latency * 1000:.0f} ms)", flush=True)
    single_engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
