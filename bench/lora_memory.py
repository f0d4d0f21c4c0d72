"""The trainer's memory with LoRA beside a full fine-tune of the same model.

On the weight-push benchmark's ~24M-parameter model (``bench/weight_push.py``'s small config,
float32), this process (4 emulated devices, fsdp, as the demo trainer) builds the trainer's
``Learner`` four ways and prints the bytes of the arrays each keeps alive, by role
(``Learner.state_bytes``), and the live device bytes it added (``jax.live_arrays``, all shards):

- full fine-tune, beta = 0 and beta > 0 (a frozen reference copy for the KL term);
- LoRA rank 16 on every attention and MLP projection, beta = 0 and beta > 0 (the reference is
  the base with the adapters off: no copy).

It also runs one train step each way (one batch of 8 sequences x 64 tokens) so that what the
optimizer allocates lazily is there too, and prints ``optimizer bytes LoRA / full``.

    python bench/lora_memory.py
"""

from __future__ import annotations

import gc
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from weight_push import LORA_RANK, model_config  # noqa: E402

from splitrl.config import AlgorithmConfig, MeshConfig, OptimizerConfig  # noqa: E402
from splitrl.mesh import build_mesh  # noqa: E402
from splitrl.models import init_random  # noqa: E402
from splitrl.models import lora as lora_lib  # noqa: E402
from trainer_service.learning.learner import Learner, TrainBatch  # noqa: E402


def live_bytes() -> int:
    gc.collect()
    return sum(x.nbytes for x in jax.live_arrays())


def batch(vocab: int, rows: int = 8, length: int = 64) -> TrainBatch:
    """A rollout batch: 16 prompt tokens, 48 completion tokens, advantages +-1 by row."""
    rng = np.random.default_rng(0)
    mask = np.ones((rows, length), bool)
    completion = np.zeros((rows, length), bool)
    completion[:, 16:] = True
    return TrainBatch(tokens=rng.integers(2, vocab, (rows, length)).astype(np.int32),
                      attention_mask=mask, completion_mask=completion,
                      sampler_logprobs=np.full((rows, length), -9.0, np.float32),
                      advantages=np.where(np.arange(rows) % 2, 1.0, -1.0).astype(np.float32),
                      group_ids=np.arange(rows) // 4)


def measure(config, mesh, lora, beta: float) -> dict[str, int]:
    model = init_random(config, seed=0)  # the learner takes its arrays over (and donates them)
    start = live_bytes()
    learner = Learner(model, algorithm=AlgorithmConfig(beta=beta),
                      optimizer=OptimizerConfig(lr=1e-4), mesh=mesh, lora=lora)
    learner.train_step(batch(config.vocab_size))
    sizes = learner.state_bytes()
    sizes["live"] = live_bytes() - start
    del learner, model
    return sizes


def main() -> int:
    config = model_config("small")
    mesh = build_mesh(MeshConfig(axes={"fsdp": 4}, strategy="fsdp"))
    spec = lora_lib.LoraSpec(LORA_RANK, 2.0 * LORA_RANK,
                             lora_lib.resolve_targets(config, lora_lib.ALL_PROJECTIONS))
    rows = {}
    for name, lora, beta in (("full, beta=0", None, 0.0), ("full, beta=0.04", None, 0.04),
                             ("LoRA, beta=0", spec, 0.0), ("LoRA, beta=0.04", spec, 0.04)):
        rows[name] = measure(config, mesh, lora, beta)
    n_params = rows["LoRA, beta=0"]["frozen_params"] // 4  # float32
    print(f"load average: {os.getloadavg()}")
    print(f"model {n_params / 1e6:.1f}M parameters (bench/weight_push.py small), float32; LoRA "
          f"rank {LORA_RANK} on {len(spec.targets)} projections; fsdp on 4 devices; Adam")
    mb = 1e6
    for name, s in rows.items():
        print(f"{name:16s} trained params {s['trained_params'] / mb:7.2f} MB, frozen "
              f"{s['frozen_params'] / mb:6.1f} MB, reference {s['reference_params'] / mb:6.1f} MB,"
              f" optimizer {s['opt_state'] / mb:7.2f} MB; live device bytes {s['live'] / mb:6.1f}"
              " MB")
    full, lora = rows["full, beta=0.04"], rows["LoRA, beta=0.04"]
    print(f"optimizer bytes LoRA / full: {lora['opt_state'] / full['opt_state']:.4f}; "
          f"live bytes LoRA / full (beta > 0): {lora['live'] / full['live']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
