"""How a sampler should serve LoRA: adapters merged into its weights, or applied in the forward.

On the weight-push benchmark's ~24M-parameter model, LoRA rank 16 on every attention and MLP
projection, this process (2 emulated devices, tensor parallel, as a demo sampler) measures, in
the same run:

- decode tokens/s of the KV-cache forward with the adapters merged into the weights (what the
  sampler does: ``sampler_service/weights.py``) and with the same adapters attached to the base
  model (``splitrl.models.lora.attach``: ``y = x W + s (x A) B`` in every targeted layer);
- the cost of merging, paid once per adapter push instead of per token;
- the memory each way: merged serving keeps the base checkpoint's targeted weights beside the
  merged ones; in-forward serving keeps only the adapters.

    python bench/lora_serving.py [--batch 16] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from splitrl.config import MeshConfig  # noqa: E402
from splitrl.mesh import build_mesh, param_shardings  # noqa: E402
from splitrl.models import (  # noqa: E402
    TransformerConfig,
    apply,
    hf_from_state,
    init_cache,
    init_random,
    model_from_state,
    state_from_hf,
)
from splitrl.models import lora as lora_lib  # noqa: E402

RANK = 16


def bench_config() -> TransformerConfig:
    """bench/weight_push.py's small model (~24M parameters)."""
    return TransformerConfig(family="qwen2", vocab_size=8192, hidden_size=512,
                             intermediate_size=2048, num_layers=4, num_heads=8,
                             num_kv_heads=4, head_dim=64, attention_bias=True,
                             tie_word_embeddings=False, eos_token_id=1, pad_token_id=0)


def decoder(model, batch: int, prompt_len: int, new_tokens: int):
    """A compiled greedy decode with the KV cache, one jitted step per token (as the engine's
    loop); calling it returns its wall time in seconds."""
    graphdef, state = nnx.split(model)
    step = jax.jit(apply, static_argnums=0, donate_argnames="cache")
    prompt = jnp.asarray(np.random.default_rng(0).integers(2, 8000, (batch, prompt_len)),
                         jnp.int32)

    def run() -> float:
        start = time.perf_counter()
        cache = init_cache(model.config, batch, prompt_len + new_tokens)
        logits, cache = step(graphdef, state, prompt, cache=cache, cache_index=0)
        token = jnp.argmax(logits[:, -1], -1)[:, None].astype(jnp.int32)
        for i in range(new_tokens):
            logits, cache = step(graphdef, state, token, cache=cache,
                                 cache_index=prompt_len + i)
            token = jnp.argmax(logits[:, -1], -1)[:, None].astype(jnp.int32)
        jax.block_until_ready(token)
        return time.perf_counter() - start

    run()  # compile
    return run


def interleaved_tokens_per_s(runs: dict, tokens: int, rounds: int) -> dict[str, float]:
    """Best tokens/s of each decoder over ``rounds``, the decoders taking turns in every round
    so that a change of load hits them all alike."""
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):
        for name, run in runs.items():
            best[name] = min(best[name], run())
    return {name: tokens / seconds for name, seconds in best.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    config = bench_config()
    mesh = build_mesh(MeshConfig(axes={"tensor": 2}, strategy="tp"))
    flat = hf_from_state(nnx.state(init_random(config, seed=0), nnx.Param))
    base = jax.device_put(flat, param_shardings(mesh, flat, "tp"))
    spec = lora_lib.LoraSpec(RANK, 2.0 * RANK,
                             lora_lib.resolve_targets(config, lora_lib.ALL_PROJECTIONS))
    rng = np.random.default_rng(1)
    adapters = {n: (0.01 * rng.standard_normal(a.shape)).astype(np.float32)
                for n, a in lora_lib.init_adapters(config, spec).items()}
    adapters = jax.device_put(adapters, param_shardings(mesh, adapters, "tp"))

    merge_s = float("inf")
    for _ in range(args.rounds + 1):
        start = time.perf_counter()
        merged = jax.block_until_ready(lora_lib.merge(base, adapters, spec))
        merge_s = min(merge_s, time.perf_counter() - start)
    merged_model = model_from_state(config, state_from_hf(config, merged))
    in_forward = lora_lib.attach(model_from_state(config, state_from_hf(config, base)), spec,
                                 adapters)
    plain = model_from_state(config, state_from_hf(config, base))

    kw = dict(batch=args.batch, prompt_len=args.prompt_len, new_tokens=args.new_tokens)
    tps = interleaved_tokens_per_s(
        {"base": decoder(plain, **kw), "merged": decoder(merged_model, **kw),
         "in_forward": decoder(in_forward, **kw)}, args.batch * args.new_tokens, args.rounds)
    tps_base, tps_merged, tps_forward = tps["base"], tps["merged"], tps["in_forward"]
    targeted = sum(merged[f"{t}.weight"].nbytes for t in spec.targets)
    adapter_bytes = sum(a.nbytes for a in adapters.values())
    print(f"load average: {os.getloadavg()}")
    print(f"model {sum(a.size for a in flat.values()) / 1e6:.1f}M parameters; LoRA rank {RANK} "
          f"on {len(spec.targets)} projections; batch {args.batch}, {args.new_tokens} new tokens")
    print(f"decode tokens/s: base {tps_base:.0f}, merged {tps_merged:.0f}, adapters in the "
          f"forward {tps_forward:.0f}; ratio in-forward/merged {tps_forward / tps_merged:.2f}")
    print(f"merge per adapter push: {merge_s * 1e3:.1f} ms "
          f"(= {merge_s * tps_merged:.0f} decoded tokens at the merged rate)")
    print(f"memory beyond the served weights: merged keeps the base's targeted weights "
          f"{targeted / 1e6:.1f} MB; in-forward keeps the adapters {adapter_bytes / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
