"""The floor of one GRPO step: its arithmetic as bare jitted programs, in one process.

    HF_HUB_OFFLINE=1 JAX_PLATFORMS=cpu python bench/step_floor.py --config CONFIG [key=value ...]

For the config's model and batch (``trainer.prompts_per_step`` x ``algorithm.group_size`` rows,
the data's longest prompt as the sampler encodes it, ``sampling.max_new_tokens`` new tokens)
it times, each as one ``jax.jit`` program on exactly those shapes (no bucket padding), with no
services, no gRPC and nothing but ``block_until_ready`` between them:

- generate: prefill the prompts, then decode the new tokens with the model's own KV cache
  (``splitrl.models.apply``) in a ``lax.fori_loop``, sampling on device, every row to the end;
  or the sampler's ``GenerationEngine`` on the same prompts, if that is faster
- reference: the reference policy's token logprobs of the whole batch (``token_logprobs``)
- policy: value and gradient of the GRPO loss (``losses.compute_loss`` with the config's
  settings) plus the optax update (``make_optimizer``), one program

floor = generate + reference + policy. Then, in the same process on the same rows, SplitRL's
own ``Learner.train_step`` on the batch ``build_train_batch`` makes (its padding included):
what the trainer's "train" part costs without services. FLOPs are XLA's cost analysis of each
program; the FLOP rate is theirs over the measured seconds. Medians of ``--repeats`` runs, after
one compiling run; process CPU seconds too, since wall times move with the machine's load
(printed).

Compare a run's step with it: ``bench/step_breakdown.py`` gives the step's interval (wait +
train + push + other).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def timed(fn, repeats: int) -> tuple[float, float]:
    """(median wall s, median process CPU s) of fn() after one warm-up call."""
    import jax

    jax.block_until_ready(fn())
    walls, cpus = [], []
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        jax.block_until_ready(fn())
        walls.append(time.perf_counter() - t)
        cpus.append(time.process_time() - c)
    return statistics.median(walls), statistics.median(cpus)


def flops(jitted, *args) -> float:
    cost = jitted.lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float((cost or {}).get("flops", 0.0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    sys.path.insert(0, str(REPO))

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from sampler_service.engine import GenerationEngine
    from sampler_service.sampling import SamplingOptions
    from splitrl.config import load_config
    from splitrl.mesh import build_mesh
    from splitrl.models import (
        apply,
        from_pretrained,
        init_cache,
        left_pad_positions,
        token_logprobs,
    )
    from splitrl.tokenizer import load_tokenizer
    from trainer_service.learning import losses
    from trainer_service.learning.batching import build_train_batch
    from trainer_service.learning.learner import Learner
    from trainer_service.learning.optim import make_optimizer
    from trainer_service.orchestration.data import PromptStream
    from trainer_service.orchestration.rollouts import Completion, RolloutGroup, WorkItem

    cfg = load_config(args.config, args.overrides)
    model = from_pretrained(cfg.model.path, dtype=cfg.model.dtype)
    config = model.config
    graphdef, state = nnx.split(model)
    params = nnx.state(model, nnx.Param)
    tokenizer = load_tokenizer(cfg.model.path, cfg.model.tokenizer_class)
    stream = PromptStream.for_run(cfg, tokenizer=tokenizer)
    prompt_len = stream.length_reports["train"].longest
    groups, group = cfg.trainer.prompts_per_step, cfg.algorithm.group_size
    rows, new = groups * group, cfg.sampling.max_new_tokens
    length = prompt_len + new
    temperature = cfg.sampling.temperature or 1.0
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(f"model {cfg.model.path}: {n_params:,} params; batch {groups} prompts x {group} = "
          f"{rows} rows of {prompt_len} prompt + {new} new tokens = {length}; "
          f"{os.cpu_count()} cores, jax {jax.__version__}")

    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(3, config.vocab_size, (rows, length)), jnp.int32)
    mask = jnp.ones((rows, length), bool)
    completion = jnp.zeros((rows, length), bool).at[:, prompt_len:].set(True)
    advantages = jnp.asarray(rng.normal(size=rows), jnp.float32)
    settings = losses.loss_settings(cfg.algorithm, new)

    # ---- generate: prefill + decode loop, one program
    def generate(state, prompts, key):
        cache = init_cache(config, rows, length)
        pmask = jnp.ones(prompts.shape, bool)
        logits, cache = apply(graphdef, state, prompts, left_pad_positions(pmask),
                              attention_mask=pmask, cache=cache, cache_index=0)
        out = jnp.zeros((rows, new), jnp.int32)

        def body(i, carry):
            last, cache, out, key = carry
            key, sub = jax.random.split(key)
            tok = jax.random.categorical(sub, last / temperature).astype(jnp.int32)
            out = out.at[:, i].set(tok)
            pos = jnp.full((rows, 1), prompt_len + i, jnp.int32)
            logits, cache = apply(graphdef, state, tok[:, None], pos,
                                  attention_mask=jnp.ones((rows, 1), bool), cache=cache,
                                  cache_index=prompt_len + i)
            return logits[:, -1], cache, out, key

        _, _, out, _ = jax.lax.fori_loop(0, new, body, (logits[:, -1], cache, out, key))
        return out

    # ---- reference forward and the policy update
    def logprobs(p, toks):
        m = nnx.merge(graphdef, p)
        pos = left_pad_positions(mask)
        return token_logprobs(m, toks[:, :-1], toks[:, 1:], pos[:, :-1], mask[:, :-1],
                              chunk_size=cfg.model.logprob_chunk_size,
                              temperature=temperature)

    def reference(p, toks):
        return logprobs(p, toks)[0]

    tx, _ = make_optimizer(cfg.trainer.optimizer, updates_per_step=1)
    opt_state = tx.init(params)

    def policy(p, opt_state, toks, ref, sampler):
        def loss_fn(p):
            logp, entropy = logprobs(p, toks)
            loss, _ = losses.compute_loss(
                logp, jax.lax.stop_gradient(logp), advantages, completion[:, 1:], **settings,
                ref=ref, sampler=sampler, entropy=entropy)
            return loss

        loss, grads = jax.value_and_grad(loss_fn)(p)
        updates, opt_state = tx.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, loss

    gen_j, ref_j, pol_j = jax.jit(generate), jax.jit(reference), jax.jit(policy)
    prompts = tokens[:, :prompt_len]
    key = jax.random.key(0)
    ref = ref_j(params, tokens)
    sampler = ref
    parts = {
        "generate": (timed(lambda: gen_j(state, prompts, key), args.repeats),
                     flops(gen_j, state, prompts, key)),
        "reference": (timed(lambda: ref_j(params, tokens), args.repeats),
                      flops(ref_j, params, tokens)),
        "policy": (timed(lambda: pol_j(params, opt_state, tokens, ref, sampler), args.repeats),
                   flops(pol_j, params, opt_state, tokens, ref, sampler)),
    }
    # The sampler's own program (shared prompt cache, on-device sampling) may beat the plain
    # loop: the floor takes the faster of the two ways to generate the same tokens.
    engine = GenerationEngine(config, graphdef, mesh=build_mesh(cfg.sampler.mesh),
                              max_batch_size=rows, max_sequence_length=length,
                              eos_token_ids=(), pad_token_id=0)
    engine_state = engine.place_state(state, strategy=cfg.sampler.mesh.strategy)
    options = SamplingOptions(temperature=temperature, max_new_tokens=new, seed=0)
    unique = [p.tolist() for p in np.asarray(prompts)[::group]]
    engine_s = timed(lambda: engine.generate(engine_state, unique, options, n=group),
                     args.repeats)
    print(f"  (generate with the sampler's engine: {engine_s[0] * 1e3:.1f} ms, cpu "
          f"{engine_s[1] * 1e3:.1f} ms; model loop: {parts['generate'][0][0] * 1e3:.1f} ms)")
    if engine_s[0] < parts["generate"][0][0]:
        parts["generate"] = (engine_s, parts["generate"][1])
    floor_wall = sum(w for (w, _), _ in parts.values())
    floor_cpu = sum(c for (_, c), _ in parts.values())
    floor_flops = sum(f for _, f in parts.values())
    for name, ((wall, cpu), f) in parts.items():
        print(f"  {name:10s} {wall * 1e3:8.1f} ms (cpu {cpu * 1e3:7.1f} ms)  {f / 1e9:6.2f} GFLOP"
              f"  {f / wall / 1e9:6.1f} GFLOP/s")
    print(f"floor      {floor_wall * 1e3:8.1f} ms (cpu {floor_cpu * 1e3:7.1f} ms)  "
          f"{floor_flops / 1e9:6.2f} GFLOP  {floor_flops / floor_wall / 1e9:6.1f} GFLOP/s")

    # ---- SplitRL's learner on the same rows (its batch building and padding included)
    mesh = build_mesh(cfg.trainer.mesh)
    learner = Learner.from_config(model, cfg, mesh)
    host_tokens = np.asarray(tokens)
    scored = []
    for g in range(groups):
        completions = [Completion(token_ids=host_tokens[g * group + i, prompt_len:].tolist(),
                                  logprobs=[-6.0] * new, reward=float(i % 2), rewards={},
                                  finish_reason="length")
                       for i in range(group)]
        scored.append(RolloutGroup(item=WorkItem(uid=f"g{g}", row={}),
                                   prompt_token_ids=host_tokens[g * group, :prompt_len].tolist(),
                                   completions=completions, weight_version=0, sampler_id=""))

    def learner_step():
        batch = build_train_batch(scored, cfg.algorithm, pad_id=0, longest=length)
        return learner.train_step(batch)

    batch = build_train_batch(scored, cfg.algorithm, pad_id=0, longest=length)
    wall, cpu = timed(learner_step, args.repeats)
    print(f"learner    {wall * 1e3:8.1f} ms (cpu {cpu * 1e3:7.1f} ms)  train step on "
          f"{batch.tokens.shape[0]} x {batch.tokens.shape[1]} (rows of up to {length} tokens)")
    train_floor = parts["reference"][0][0] + parts["policy"][0][0]
    print(f"learner / (reference + policy) = {wall / train_floor:.2f}x; "
          f"floor + learner overhead = {(floor_wall + wall - train_floor) * 1e3:.1f} ms; "
          f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
