"""Tiny models and rollout batches for the trainer tests, and the resume test's subprocess.

    python trainer_helpers.py resume CKPT_DIR OUT.npz   restore CKPT_DIR's latest checkpoint onto
                                                        a fresh learner, do steps 4-5, save params
"""

from __future__ import annotations

import sys

import jax
import numpy as np
from jax.sharding import Mesh

from splitrl.config import AlgorithmConfig, OptimizerConfig
from splitrl.models import TransformerConfig, init_random
from trainer_service.learning.advantages import compute_advantages
from trainer_service.learning.learner import Learner, TrainBatch

VOCAB = 32


def tiny_config(**overrides) -> TransformerConfig:
    kw = dict(family="qwen2", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
              num_heads=4, num_kv_heads=2, head_dim=8, attention_bias=True, eos_token_id=1,
              pad_token_id=0, bos_token_id=2)
    kw.update(overrides)
    return TransformerConfig(**kw)


def tiny_model(seed: int = 0):
    return init_random(tiny_config(), seed=seed, std=0.1)


def mesh_of(n: int, axes=("fsdp",)) -> Mesh:
    devices = np.array(jax.devices()[:n]).reshape((n,) + (1,) * (len(axes) - 1))
    return Mesh(devices, axes)


def rollout_batch(seed: int, *, groups: int = 2, group_size: int = 4, winners=None) -> TrainBatch:
    """`groups` prompts x `group_size` random completions, left-padded prompts (3 or 2 tokens)
    and right-padded completions (3 or 2 tokens): T = 6. Reward 1 for completion `winners[g]`
    of each group (default: index 1), 0 for the rest. sampler_logprobs are zeros (fill them)."""
    rng = np.random.default_rng(seed)
    b, t = groups * group_size, 6
    tokens = np.zeros((b, t), np.int32)
    attention = np.zeros((b, t), bool)
    completion = np.zeros((b, t), bool)
    rewards = np.zeros(b, np.float32)
    winners = [1] * groups if winners is None else winners
    for g in range(groups):
        prompt = rng.integers(3, VOCAB, size=3 - g % 2)
        for j in range(group_size):
            row = g * group_size + j
            comp_len = 3 if j % 2 == 0 else 2
            start = 3 - len(prompt)
            tokens[row, start:3] = prompt
            tokens[row, 3:3 + comp_len] = rng.integers(3, VOCAB, size=comp_len)
            attention[row, start:3 + comp_len] = True
            completion[row, 3:3 + comp_len] = True
            rewards[row] = float(j == winners[g])
    group_ids = np.repeat(np.arange(groups), group_size)
    advantages = np.asarray(compute_advantages("grpo", rewards, group_ids))
    return TrainBatch(tokens=tokens, attention_mask=attention, completion_mask=completion,
                      sampler_logprobs=np.zeros((b, t), np.float32), advantages=advantages,
                      group_ids=group_ids, rewards=rewards)


def make_learner(mesh, *, seed=0, algorithm=None, optimizer=None, **kw) -> Learner:
    algorithm = algorithm or AlgorithmConfig(loss="grpo", tis_cap=2.0)
    optimizer = optimizer or OptimizerConfig(lr=1e-2, schedule="cosine", warmup_steps=1,
                                             total_steps=10, weight_decay=0.01)
    return Learner(tiny_model(seed), algorithm=algorithm, optimizer=optimizer, mesh=mesh, **kw)


# The resume scenario, shared by the test process and the restoring subprocess.
RESUME_DEVICES = 4


def resume_learner() -> Learner:
    return make_learner(mesh_of(RESUME_DEVICES), epochs_per_batch=2,
                        algorithm=AlgorithmConfig(loss="gspo", beta=0.05, tis_cap=2.0,
                                                  entropy_coef=0.01))


def resume_batch(step: int, learner: Learner) -> TrainBatch:
    """Step `step`'s batch; sampler logprobs are the policy's, slightly perturbed (stale)."""
    batch = rollout_batch(100 + step, winners=[step % 4, (step + 1) % 4])
    noise = np.random.default_rng(step).normal(0, 0.05, batch.tokens.shape).astype(np.float32)
    batch.sampler_logprobs = learner.logprobs(batch) + noise
    return batch


def _resume_main(ckpt_dir: str, out: str) -> None:
    from trainer_service.learning.checkpoints import Checkpointer

    learner = resume_learner()
    with Checkpointer(ckpt_dir, every=1, keep=2, async_save=False) as ckpt:
        restored = ckpt.restore(learner.abstract_train_state())
    learner.load_train_state(restored.state, restored.weight_version)
    for step in (restored.step + 1, restored.step + 2):
        learner.train_step(resume_batch(step, learner))
    sharded = {k: len(v.sharding.device_set) for k, v in learner.params.items()}
    np.savez(out, step=learner.version, weight_version=restored.weight_version,
             cursor=restored.data_cursor["index"],
             rng=np.asarray(jax.random.key_data(restored.rng)),
             max_devices=max(sharded.values()),
             **{f"p:{k}": np.asarray(v) for k, v in learner.params.items()})


if __name__ == "__main__":
    if sys.argv[1] == "resume":
        _resume_main(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit(f"unknown command {sys.argv[1]!r}")
