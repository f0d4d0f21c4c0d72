"""Sampler throughput: SplitRL's GenerationEngine vs transformers' `generate`, same run.

    HF_HUB_OFFLINE=1 JAX_PLATFORMS=cpu python bench/sampler_throughput.py [--quick]

Builds one random Qwen2 checkpoint (4 layers, hidden 512, intermediate 1408, 8 heads / 4 KV
heads, vocab 16384: ~30M parameters) with `splitrl.models.init_random` + `save_pretrained`,
then generates 64 prompts (random lengths 16-64) x 128 new tokens with both engines:
temperature 1.0, top_k 50, no EOS stop (the engine gets no EOS ids; transformers gets
`eos_token_id=None`), so both produce exactly 64 x 128 tokens. transformers loads the same
checkpoint with `AutoModelForCausalLM.from_pretrained` in float32, left padding, one batch,
`torch.set_num_threads(cores)`. SplitRL runs once to compile (reported separately), then is
timed; transformers gets one warm-up call too. Prints tokens/s of both and the ratio.

XLA CPU flags: none are set by default besides the emulated device count (`--devices`, default
1); the engine runs as the sampler would. `--xla-flags` passes extra flags for experiments.
Wall-clock figures on a shared machine depend on other processes: the process CPU seconds of
both engines are printed too, with the load average.
"""

from __future__ import annotations

import argparse
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
    ap.add_argument("--repeats", type=int, default=1, help="timed SplitRL runs (best is kept)")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--xla-flags", default="", help="extra XLA_FLAGS for the JAX engine")
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
    devices = args.devices
    flags = f"--xla_force_host_platform_device_count={devices} {args.xla_flags}"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flags).strip()
    sys.path.insert(0, str(REPO))

    import jax
    import numpy as np
    from flax import nnx

    from sampler_service.engine import GenerationEngine
    from sampler_service.sampling import SamplingOptions
    from splitrl.config import MeshConfig
    from splitrl.mesh import build_mesh
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
    top_k, temperature = 50, 1.0

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        model = init_random(config, seed=0, std=0.02)
        save_pretrained(model, path)
        del model
        params = sum(x.size for x in jax.tree.leaves(nnx.state(from_pretrained(path))))
        print(f"model: qwen2 4x512 (ffn 1408, 8 heads / 4 kv, vocab 16384), {params / 1e6:.1f}M "
              f"params; {num_prompts} prompts (len {lengths.min()}-{lengths.max()}) x "
              f"{new_tokens} new tokens; temperature {temperature}, top_k {top_k}; "
              f"{cores} cores; splitrl mesh {{'data': {devices}}}")

        # ---- SplitRL
        model = from_pretrained(path)
        graphdef, state = nnx.split(model)
        mesh = build_mesh(MeshConfig(axes={"data": devices}, strategy="replicated"))
        engine = GenerationEngine(config, graphdef, mesh=mesh, max_batch_size=num_prompts,
                                  max_sequence_length=64 + new_tokens, eos_token_ids=(),
                                  pad_token_id=0)
        state = engine.place_state(state, strategy="replicated")
        options = SamplingOptions(temperature=temperature, top_k=top_k,
                                  max_new_tokens=new_tokens, seed=0)
        t0 = time.perf_counter()
        out = engine.generate(state, prompts, options)
        first = time.perf_counter() - t0
        best, cpu = float("inf"), 0.0
        for r in range(args.repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            out = engine.generate(state, prompts, dict_replace(options, seed=r + 1))
            if time.perf_counter() - t0 < best:
                best, cpu = time.perf_counter() - t0, time.process_time() - c0
        ours_tokens = sum(len(s[0].token_ids) for s in out)
        ours_tps = ours_tokens / best
        print(f"splitrl      : {ours_tokens} tokens in {best:.2f} s = {ours_tps:8.1f} tok/s "
              f"(cpu {cpu:.1f} s; first call incl. compile {first:.2f} s, "
              f"compile ~{first - best:.2f} s)")
        if args.skip_transformers:
            return

        # ---- transformers
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(cores)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None
        hf.generation_config.pad_token_id = 0
        width = max(lengths)
        ids = torch.zeros((num_prompts, width), dtype=torch.long)
        attn = torch.zeros((num_prompts, width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            attn[i, width - len(p):] = 1
        kw = dict(attention_mask=attn, do_sample=True, temperature=temperature, top_k=top_k,
                  top_p=1.0, max_new_tokens=new_tokens,
                  eos_token_id=None, pad_token_id=0)
        with torch.inference_mode():
            hf.generate(ids[:2], **{**kw, "attention_mask": attn[:2], "max_new_tokens": 4})
            torch.manual_seed(0)
            t0, c0 = time.perf_counter(), time.process_time()
            seqs = hf.generate(ids, **kw)
            hf_s, hf_cpu = time.perf_counter() - t0, time.process_time() - c0
        hf_tokens = int((seqs.shape[1] - width) * num_prompts)
        hf_tps = hf_tokens / hf_s
        print(f"transformers : {hf_tokens} tokens in {hf_s:.2f} s = {hf_tps:8.1f} tok/s "
              f"(cpu {hf_cpu:.1f} s; torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads)")
        print(f"ratio splitrl / transformers = {ours_tps / hf_tps:.2f}x "
              f"(cpu-time ratio {hf_cpu / hf_tokens / (cpu / ours_tokens):.2f}x; "
              f"load average {os.getloadavg()[0]:.1f} on {cores} cores)")


def dict_replace(options, **changes):
    import dataclasses

    return dataclasses.replace(options, **changes)


if __name__ == "__main__":
    main()
