"""Checkpoints: exact resume (same process and a new process), retention, other layouts."""

import asyncio
import gc
import logging
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from trainer_helpers import RESUME_DEVICES, mesh_of, resume_batch, resume_learner

from trainer_service.learning.checkpoints import Checkpointer

HELPER = Path(__file__).with_name("trainer_helpers.py")
REPO = Path(__file__).resolve().parents[2]


def _host(params):
    return {k: np.asarray(v) for k, v in params.items()}


def test_resume_in_a_new_process_repeats_the_same_steps_exactly(tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    learner = resume_learner()  # gspo, beta > 0, TIS, entropy bonus, 2 epochs, fsdp over 4
    key = jax.random.key(7)
    with Checkpointer(ckpt_dir, every=3, keep=2, async_save=True) as ckpt:
        for step in range(1, 6):
            metrics = learner.train_step(resume_batch(step, learner))
            ckpt.save(step, learner.train_state(), weight_version=step, rng=key,
                      data_cursor={"index": 10 * step, "epoch": 0}, config={"seed": 0})
        assert ckpt.all_steps() == [3]
    assert metrics["kl"] > 0  # the policy has left the frozen reference
    after_5 = _host(learner.params)

    # Same process: a fresh learner restored at step 3 and doing steps 4-5 lands on after_5.
    again = resume_learner()
    with Checkpointer(ckpt_dir, every=3, keep=2, async_save=False) as ckpt:
        restored = ckpt.restore(again.abstract_train_state())
    assert (restored.step, restored.weight_version) == (3, 3)
    assert restored.data_cursor == {"index": 30, "epoch": 0} and restored.config == {"seed": 0}
    np.testing.assert_array_equal(jax.random.key_data(restored.rng), jax.random.key_data(key))
    again.load_train_state(restored.state, restored.weight_version)
    for step in (4, 5):
        again.train_step(resume_batch(step, again))
    for name, value in _host(again.params).items():
        np.testing.assert_allclose(value, after_5[name], atol=1e-6, rtol=0)

    # A new process with its own devices does the same. It emulates as many CPU devices as
    # this one (its fsdp mesh is RESUME_DEVICES of them, as here): JAX keys a compiled program
    # by the process's device count too, so it then reads the train step this process
    # compiled from the suite's compilation cache instead of compiling it again.
    out = tmp_path / "resumed.npz"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(HELPER.parent)]))
    proc = subprocess.run([sys.executable, str(HELPER), "resume", str(ckpt_dir), str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = np.load(out)
    assert int(got["step"]) == 5 and int(got["weight_version"]) == 3 and int(got["cursor"]) == 30
    assert int(got["max_devices"]) == RESUME_DEVICES  # restored onto the fsdp mesh, sharded
    np.testing.assert_array_equal(got["rng"], jax.random.key_data(key))
    for name, value in after_5.items():
        np.testing.assert_allclose(got[f"p:{name}"], value, atol=1e-6, rtol=0)


def test_keeps_the_last_k_and_restores_onto_another_layout(tmp_path):
    mesh4, mesh2 = mesh_of(4), mesh_of(2, axes=("tensor",))
    sharded = NamedSharding(mesh4, PartitionSpec("fsdp", None))
    state = {"params": {"model.embed_tokens.weight": jax.device_put(
        np.arange(32 * 8, dtype=np.float32).reshape(32, 8), sharded)}, "count": np.int32(0)}
    with Checkpointer(tmp_path, every=2, keep=2) as ckpt:
        saved = [s for s in range(1, 8) if ckpt.save(s, state, weight_version=s)]
        assert saved == [2, 4, 6]
        assert ckpt.save(7, state, weight_version=7, force=True)
        ckpt.wait()
        assert ckpt.all_steps() == [6, 7] and ckpt.latest_step() == 7
        target = NamedSharding(mesh2, PartitionSpec(None, "tensor"))
        abstract = {"params": {"model.embed_tokens.weight": jax.ShapeDtypeStruct(
            (32, 8), np.float32, sharding=target)},
            "count": jax.ShapeDtypeStruct((), np.int32, sharding=NamedSharding(mesh2,
                                                                              PartitionSpec()))}
        restored = ckpt.restore(abstract, step=6)
    weight = restored.state["params"]["model.embed_tokens.weight"]
    assert weight.sharding == target and restored.rng is None and restored.weight_version == 6
    np.testing.assert_array_equal(weight, np.arange(32 * 8).reshape(32, 8))


def test_restoring_a_missing_checkpoint_says_where_it_looked(tmp_path):
    with Checkpointer(tmp_path / "empty") as ckpt:
        with pytest.raises(FileNotFoundError, match="no checkpoint in"):
            ckpt.restore({})
        with pytest.raises(FileNotFoundError, match="step 3"):
            ckpt.restore({}, step=3)


def _unretrieved_task_failure(module: str) -> None:
    """A task whose coroutine is defined in ``module`` fails and is collected unawaited, as
    the other writes of a save do once orbax has awaited the first failure: asyncio logs
    "Task exception was never retrieved" for it."""
    namespace = {"__name__": module}
    exec("async def write():\n    raise OSError(28, 'No space left on device')", namespace)
    loop = asyncio.new_event_loop()
    task = loop.create_task(namespace["write"]())
    loop.run_until_complete(asyncio.wait([task]))  # done; its exception never retrieved
    del task
    gc.collect()
    loop.close()


def test_orbax_writes_failing_unawaited_are_warnings_and_other_tasks_stay_errors(tmp_path,
                                                                                 caplog):
    Checkpointer(tmp_path / "checkpoints")
    with caplog.at_level(logging.WARNING, logger="asyncio"):
        _unretrieved_task_failure("orbax.checkpoint._src.serialization.serialization")
        _unretrieved_task_failure("trainer_service.something_of_ours")
    unretrieved = [r for r in caplog.records if "never retrieved" in r.getMessage()]
    assert [r.levelname for r in unretrieved] == ["WARNING", "ERROR"]
