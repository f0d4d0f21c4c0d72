"""The multi-controller trainer: two JAX processes on 127.0.0.1 (2 CPU devices each) train
exactly like one process with 4 devices, gather the params for a push, and checkpoint/restore
through orbax; with one process, ``HostGroup`` is a pass-through."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from multihost_worker import CURSOR, DEVICES, STEPS, batches, learner_on
from trainer_helpers import mesh_of, rollout_batch

from trainer_service.launcher import free_port
from trainer_service.multihost import HostGroup, Message

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def multihost_env(devices: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(REPO), str(HERE)]), PYTHONUNBUFFERED="1")
    return env


def wait_all(procs: dict[str, subprocess.Popen], logs: dict[str, Path], timeout_s: float):
    """Wait for every process; on a failure or timeout kill the rest and show the logs."""
    try:
        for proc in procs.values():
            proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    codes = {name: proc.returncode for name, proc in procs.items()}
    if any(codes.values()):
        tails = "\n".join(f"--- {n} (exit {codes[n]}):\n" + "\n".join(
            line for line in logs[n].read_text(errors="replace").splitlines()[-40:]
            if "SPMD" not in line) for n in procs)
        raise AssertionError(f"exit codes {codes}\n{tails}")


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("multihost")
    port = free_port()
    procs, logs = {}, {}
    for pid in range(2):
        logs[pid] = out / f"process-{pid}.log"
        procs[pid] = subprocess.Popen(
            [sys.executable, str(HERE / "multihost_worker.py"), str(pid), "2", str(port),
             str(out)],
            stdout=logs[pid].open("wb"), stderr=subprocess.STDOUT,
            env=multihost_env(DEVICES // 2), cwd=REPO,
        )
    wait_all(procs, logs, timeout_s=400)
    return [_load(out / f"process-{pid}.npz") for pid in range(2)]


def _load(path: Path):
    data = np.load(path)
    record = ast.literal_eval(str(data["record"]))
    return record, {k: data[k] for k in data.files if k != "record"}


def _prefixed(arrays, prefix):
    return {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}


def test_two_processes_step_like_one_process_with_the_same_devices(two_process_run):
    (leader, leader_arrays), (follower, follower_arrays) = two_process_run
    assert leader["ok"] and follower["ok"]
    assert leader["steps"] == follower["steps"] == STEPS
    # The follower trained on the leader's batches, bitwise, dtypes included (T varied).
    sent, got = _prefixed(leader_arrays, "batch"), _prefixed(follower_arrays, "batch")
    assert sent.keys() == got.keys() and len(sent) == 2 * 7
    for key in sent:
        assert sent[key].dtype == got[key].dtype and np.array_equal(sent[key], got[key]), key
    assert sent["1:tokens"].shape[1] == sent["0:tokens"].shape[1] + 2

    # The same steps in this process on 4 of its devices: the same params and metrics. Only
    # the cross-process reductions (gloo) sum in another order; Adam's first steps amplify that
    # float32 noise where a gradient is near 0 (seen: max |diff| 1.5e-6).
    reference = learner_on(mesh_of(DEVICES))
    metrics = [reference.train_step(batch) for batch in batches()]
    pushed = _prefixed(leader_arrays, "pushed:")
    assert pushed.keys() == reference.params.keys()
    for name, value in reference.params.items():
        assert pushed[name].shape == value.shape and pushed[name].dtype == value.dtype, name
        np.testing.assert_allclose(pushed[name], np.asarray(value), rtol=1e-5, atol=5e-6,
                                   err_msg=name)
    for key in ("loss", "grad_norm"):
        for process in (leader, follower):
            assert process[key] == pytest.approx([m[key] for m in metrics], rel=1e-5), key
    assert not _prefixed(follower_arrays, "pushed:"), "only the leader keeps gathered params"


def test_checkpoint_restores_on_every_process_with_the_leaders_cursor(two_process_run):
    (leader, leader_arrays), (follower, follower_arrays) = two_process_run
    pushed = _prefixed(leader_arrays, "pushed:")
    for record, arrays in two_process_run:
        assert record["restored_step"] == STEPS and record["restored_version"] == STEPS
        # The follower saved with no cursor: the JSON metadata on disk is process 0's.
        assert record["restored_cursor_index"] == CURSOR["stream"]["index"]
        assert record["param_shards"] == DEVICES  # restored onto the global mesh
        restored = _prefixed(arrays, "restored:")
        for name, value in pushed.items():
            assert np.array_equal(restored[name], value), name


# ------------------------------------------------------------------ one process, no JAX group


def test_one_process_group_is_a_pass_through():
    hosts = HostGroup.current()
    assert not hosts.multi and hosts.is_leader
    batch = rollout_batch(0)
    assert hosts.train(batch) is batch
    params = {"w": np.ones(3)}
    assert hosts.params_for_push(params, 1) is params  # zero-copy: nothing gathered
    assert hosts.gathered is None
    hosts.checkpoint(1, 1)
    hosts.stop()


def test_control_messages_round_trip_and_reject_unknown_ops():
    message = Message(3, "train", step=4, version=4, batch={"tokens": ["int32", [8, 6]]})
    assert Message.from_json(message.to_json()) == message
    with pytest.raises(ValueError, match="unknown op 'jump'"):
        Message.from_json(Message(0, "jump").to_json())


def test_a_group_of_several_processes_needs_the_distributed_client():
    with pytest.raises(RuntimeError, match="no jax.distributed client"):
        HostGroup(0, 2, client=None)
