"""One process of the 2-process learner scenario in test_multihost.py (run as a subprocess).

    python multihost_worker.py PROCESS_ID NUM_PROCESSES COORDINATOR_PORT OUT_DIR

Each process has 2 emulated CPU devices (XLA_FLAGS); ``splitrl.distributed`` joins them into
one runtime with a global 4-device fsdp mesh. Process 0 leads exactly like the trainer's run
loop (``HostGroup``: train, gather for push, checkpoint, stop); process 1 runs ``follow``.
Then both restore the last checkpoint onto a fresh learner and gather it. Each process writes
``OUT_DIR/process-<i>.npz`` with what it saw.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

# The scenario, shared with the single-process reference in test_multihost.py.
STEPS = 2
DEVICES = 4
CURSOR = {"stream": {"index": 7}, "drawn": 32, "unfinished": []}


def batches():
    """Two steps' batches; the second one is wider (T = 8), like a longer bucket."""
    from trainer_helpers import rollout_batch

    first = rollout_batch(0)
    second = rollout_batch(1, winners=[2, 3])
    pad = lambda a, v: np.concatenate([a, np.full((a.shape[0], 2), v, a.dtype)], axis=1)  # noqa: E731
    second.tokens = pad(second.tokens, 0)
    second.attention_mask = pad(second.attention_mask, False)
    second.completion_mask = pad(second.completion_mask, False)
    second.sampler_logprobs = np.full(second.tokens.shape, -1.5, np.float32)
    first.sampler_logprobs = np.full(first.tokens.shape, -2.0, np.float32)
    return [first, second]


def learner_on(mesh, first_runs=None):
    from trainer_helpers import make_learner

    return make_learner(mesh, micro_batch_size=4, first_runs=first_runs)


class _Recording:
    """Passes train steps through to the learner and keeps the batches and metrics."""

    def __init__(self, learner):
        self.learner, self.batches, self.metrics = learner, [], []

    def train_step(self, batch):
        self.batches.append(batch)
        self.metrics.append(self.learner.train_step(batch))
        return self.metrics[-1]

    def __getattr__(self, name):
        return getattr(self.learner, name)


def main(process_id: int, num_processes: int, port: int, out_dir: Path) -> None:
    from splitrl.config import load_config
    from splitrl.distributed import maybe_initialize

    cfg = load_config(None, [f"trainer.distributed.num_processes={num_processes}",
                             f"trainer.distributed.process_id={process_id}",
                             f"trainer.distributed.coordinator_address=127.0.0.1:{port}"])
    maybe_initialize(cfg)

    import jax
    from trainer_helpers import mesh_of

    from trainer_service.learning.checkpoints import Checkpointer
    from trainer_service.learning.multihost import HostGroup, follow, gather_params

    assert jax.process_count() == num_processes and len(jax.devices()) == DEVICES
    hosts = HostGroup.current()
    mesh = mesh_of(DEVICES)
    learner = _Recording(learner_on(mesh, hosts.first_runs))
    checkpointer = Checkpointer(out_dir / "checkpoints", every=100, keep=2, async_save=True)
    pushed = None
    if hosts.is_leader:
        for step, batch in enumerate(batches(), start=1):
            learner.train_step(hosts.train(batch))
            hosts.checkpoint(step, step)
            checkpointer.save(step, learner.train_state(), weight_version=step,
                              data_cursor=CURSOR, force=True)
        pushed = hosts.params_for_push(learner.params, STEPS)
        assert hosts.gathered[1] == STEPS
        hosts.stop()
        ok = True
    else:
        ok = follow(hosts, learner, checkpointer)
    checkpointer.close()

    # Resume: every process restores onto a fresh learner on the global mesh.
    fresh = learner_on(mesh, hosts.first_runs)
    with Checkpointer(out_dir / "checkpoints", every=100, keep=2) as ckpt:
        restored = ckpt.restore(fresh.abstract_train_state())
    fresh.load_train_state(restored.state, restored.weight_version)
    restored_params = gather_params(fresh.params, first_runs=hosts.first_runs)

    record = {
        "ok": ok,
        "steps": learner.learner.version,
        "restored_step": restored.step,
        "restored_version": restored.weight_version,
        "restored_cursor_index": restored.data_cursor.get("stream", {}).get("index", -1),
        "param_shards": max(len(v.sharding.device_set) for v in fresh.params.values()),
        "loss": [m["loss"] for m in learner.metrics],
        "grad_norm": [m["grad_norm"] for m in learner.metrics],
    }
    arrays = {}
    for i, batch in enumerate(learner.batches):
        for name in ("tokens", "attention_mask", "completion_mask", "sampler_logprobs",
                     "advantages", "group_ids", "rewards"):
            arrays[f"batch{i}:{name}"] = getattr(batch, name)
    if pushed is not None:
        arrays.update({f"pushed:{k}": v for k, v in pushed.items()})
    arrays.update({f"restored:{k}": v for k, v in restored_params.items()})
    np.savez(out_dir / f"process-{process_id}.npz", record=np.array(repr(record)), **arrays)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
