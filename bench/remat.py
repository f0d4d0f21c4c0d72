"""What each `model.remat` policy costs and saves in the train step, same run.

    JAX_PLATFORMS=cpu python bench/remat.py [--layers 8] [--hidden 256] [--rows 8] [--length 512]

One random Qwen2-shaped model (``--layers`` x ``--hidden``, 4x MLP, head_dim 64, vocab 8192) and
one GRPO batch (``--rows`` completions of ``--length`` tokens). For each policy ("none",
"full", "save_dots") the learner's gradient program is compiled on this host's CPU and its
temporaries read from XLA's `memory_analysis()` (what the backward pass keeps alive beyond the
arguments), then whole train steps are timed in interleaved rounds (policy A, B, C, A, ...;
the best of ``--repeats`` kept) so a change in the machine's load hits every policy alike.
Prints, per policy: temporaries, step seconds, and both as ratios to "none".

Wall-clock figures on a shared machine depend on the other processes: the load average is
printed too.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

POLICIES = ("none", "full", "save_dots")


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from splitrl.config import load_config
    from splitrl.models import TransformerConfig, abstract_model, init_random
    from trainer_service.learning.learner import Learner, TrainBatch

    heads = max(1, args.hidden // 64)
    config = TransformerConfig(
        family="qwen2", vocab_size=8192, hidden_size=args.hidden,
        intermediate_size=4 * args.hidden, num_layers=args.layers, num_heads=heads,
        num_kv_heads=max(1, heads // 2), head_dim=64, tie_word_embeddings=True,
        attention_bias=True, max_position_embeddings=4 * args.length)
    cfg = load_config(None)
    mesh = Mesh(np.array(jax.devices()[:1]), ("fsdp",))

    def learner(policy, source):
        return Learner(source, algorithm=cfg.algorithm, optimizer=cfg.trainer.optimizer,
                       mesh=mesh, remat=policy)

    rng = np.random.default_rng(0)
    shape = (args.rows, args.length)
    completion = np.zeros(shape, bool)
    completion[:, args.length // 4:] = True
    batch = TrainBatch(
        tokens=rng.integers(0, config.vocab_size, shape).astype(np.int32),
        attention_mask=np.ones(shape, bool), completion_mask=completion,
        sampler_logprobs=np.full(shape, -np.log(config.vocab_size), np.float32),
        advantages=rng.standard_normal(args.rows).astype(np.float32),
        group_ids=np.repeat(np.arange(args.rows // 2), 2).astype(np.int32))

    temporaries, learners = {}, {}
    for policy in POLICIES:
        abstract = learner(policy, abstract_model(config))
        grad = abstract.lower_train_step(args.rows, args.length)["grad_step"].compile()
        temporaries[policy] = grad.memory_analysis().temp_size_in_bytes
        # its own weights (a train step donates them), the same for every policy
        learners[policy] = learner(policy, init_random(config, seed=0))
        learners[policy].train_step(batch)  # compile and warm
    seconds = dict.fromkeys(POLICIES, float("inf"))
    for _ in range(args.repeats):
        for policy in POLICIES:
            start = time.perf_counter()
            learners[policy].train_step(batch)
            seconds[policy] = min(seconds[policy], time.perf_counter() - start)

    print(f"model: {args.layers} layers, hidden {args.hidden}; batch {args.rows} x "
          f"{args.length} tokens; load average {os.getloadavg()[0]:.2f}")
    print(f"{'policy':<10} {'temporaries MiB':>16} {'step s':>8} {'temp / none':>12} "
          f"{'time / none':>12}")
    for policy in POLICIES:
        print(f"{policy:<10} {temporaries[policy] / 2**20:>16.1f} {seconds[policy]:>8.3f} "
              f"{temporaries[policy] / temporaries['none']:>12.2f} "
              f"{seconds[policy] / seconds['none']:>12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
