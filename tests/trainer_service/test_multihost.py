"""The multi-controller trainer: two JAX processes on 127.0.0.1 (2 CPU devices each) train
exactly like one process with 4 devices, gather the params for a push, and checkpoint/restore
through orbax; with one process, ``HostGroup`` is a pass-through."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from multihost_worker import CURSOR, DEVICES, STEPS, batches, learner_on
from trainer_helpers import mesh_of, rollout_batch

from splitrl_app.launch.ports import free_port
from trainer_service.learning.first_runs import FirstRuns
from trainer_service.learning.multihost import (
    BARRIER_PREFIX,
    KEY_PREFIX,
    HostGroup,
    Message,
    gather_params,
)

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def multihost_env(devices: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(REPO), str(HERE)]), PYTHONUNBUFFERED="1")
    return env


def wait_all(procs: dict[str, subprocess.Popen], logs: dict[str, Path]):
    """Wait for every process to exit, however long that takes on a busy machine (the suite's
    per-test timeout is the bound); once one fails, kill the rest and show the logs."""
    try:
        while any(p.poll() is None for p in procs.values()) and not any(
                p.returncode for p in procs.values()):
            time.sleep(0.5)
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
    wait_all(procs, logs)
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


def test_gather_in_buckets_returns_every_parameter_whole():
    learner = learner_on(mesh_of(DEVICES))
    sizes = sorted(v.nbytes for v in learner.params.values())
    for bucket_bytes in (1, sizes[-1] + sizes[-2], 1 << 30):  # one each, some pairs, all
        host = gather_params(learner.params, bucket_bytes=bucket_bytes)
        assert list(host) == sorted(learner.params)
        for name, value in learner.params.items():
            assert isinstance(host[name], np.ndarray), name
            assert np.array_equal(host[name], np.asarray(value)), name


def test_control_messages_round_trip_and_reject_unknown_ops():
    message = Message(3, "train", step=4, version=4, batch={"tokens": ["int32", [8, 6]]})
    assert Message.from_json(message.to_json()) == message
    with pytest.raises(ValueError, match="unknown op 'jump'"):
        Message.from_json(Message(0, "jump").to_json())


class FakeClient:
    """The coordination service's key-value store, in memory; ``misses`` deadlines first."""

    def __init__(self, misses: int = 0):
        self.store, self.deleted, self.misses = {}, [], misses

    def key_value_set(self, key, value):
        self.store[key] = value

    def key_value_delete(self, key):
        self.deleted.append(key)
        self.store.pop(key, None)

    def blocking_key_value_get(self, key, timeout_ms):
        if self.misses:
            self.misses -= 1
            raise RuntimeError(f"DEADLINE_EXCEEDED: GetKeyValue() timed out with key: {key}")
        return self.store[key]

    def key_value_dir_get(self, directory):
        return [(k, v) for k, v in self.store.items() if k.startswith(directory)]


def test_followers_read_the_leaders_messages_in_order_and_wait_through_deadlines():
    client = FakeClient(misses=2)
    leader, follower = HostGroup(0, 2, client), HostGroup(1, 2, client, poll_s=0.01)
    received = []
    for send in (lambda: leader.checkpoint(2, 2), lambda: leader._send("gather", version=2),
                 leader.stop, leader.stop):  # stop is sent once
        send()
        received.append(follower.receive() if follower._seq < leader._seq else None)
    assert [m.op for m in received if m] == ["checkpoint", "gather", "stop"]
    assert (received[0].step, received[0].version, received[3]) == (2, 2, None)
    # Message n-2 is deleted when n is sent: every follower has read it by then.
    assert client.deleted == [KEY_PREFIX + "0"] and len(client.store) == 2
    with pytest.raises(RuntimeError, match="only process 0 sends"):
        follower.checkpoint(1, 1)


def test_a_follower_fails_on_a_lost_coordinator_rather_than_waiting_forever():
    class Broken(FakeClient):  # the get and the directory read both fail, as on a lost service
        def blocking_key_value_get(self, key, timeout_ms):
            raise RuntimeError("UNAVAILABLE: failed to connect to the coordination service")

        def key_value_dir_get(self, directory):
            raise RuntimeError("UNAVAILABLE: failed to connect to the coordination service")

    with pytest.raises(RuntimeError, match="UNAVAILABLE"):
        HostGroup(1, 2, Broken()).receive()


class BlockingClient(FakeClient):
    """A get waits for its key until the deadline, as the coordination service's does."""

    def __init__(self):
        super().__init__()
        self.changed = threading.Condition()

    def key_value_set(self, key, value):
        with self.changed:
            super().key_value_set(key, value)
            self.changed.notify_all()

    def blocking_key_value_get(self, key, timeout_ms):
        with self.changed:
            if not self.changed.wait_for(lambda: key in self.store, timeout_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: GetKeyValue() timed out with key: {key}")
            return self.store[key]

    def key_value_dir_get(self, directory):
        with self.changed:
            return super().key_value_dir_get(directory)


def _barriers(groups, names):
    """Each group passes a barrier of its name in its own thread; the errors, by process."""
    errors = {}

    def run(group, name):
        try:
            group.barrier(name)
        except RuntimeError as e:
            errors[group.index] = str(e)

    threads = [threading.Thread(target=run, args=pair)
               for pair in zip(groups, names, strict=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def test_a_barrier_waits_for_the_slowest_process_past_any_deadline_and_checks_the_programs():
    client = BlockingClient()
    groups = [HostGroup(i, 2, client, poll_s=0.01) for i in range(2)]
    late = threading.Timer(0.3, groups[1].barrier, args=("_grad_step",))  # 30 deadlines later
    late.start()
    groups[0].barrier("_grad_step")
    late.join()
    assert client.store == {BARRIER_PREFIX + "0/0": "_grad_step",
                            BARRIER_PREFIX + "0/1": "_grad_step"}
    assert _barriers(groups, ["_apply_update", "_apply_update"]) == {}
    errors = _barriers(groups, ["_apply_update", "_sum_over_rows"])  # diverged: both fail
    assert "process 1 is at '_sum_over_rows', process 0 at '_apply_update'" in errors[0]
    assert set(errors) == {0, 1}


def test_first_runs_compile_and_wait_once_per_program_and_signature():
    waits = []
    runs = FirstRuns(wait=waits.append)
    scale = jax.jit(lambda factor, x: factor * x, static_argnums=0)
    assert np.array_equal(runs.call(scale, 1, 2.0, np.ones(3, np.float32)), np.full(3, 2.0))
    runs.call(scale, 1, 2.0, np.zeros(3, np.float32))  # the same program
    assert len(waits) == 1
    runs.call(scale, 1, 3.0, np.ones(3, np.float32))  # another static argument
    runs.call(scale, 1, 3.0, np.ones(4, np.float32))  # another shape
    runs.call(scale, 1, 3.0, np.ones(4, np.int32))  # another dtype
    assert waits == ["<lambda>"] * 4
    assert np.array_equal(FirstRuns().call(scale, 1, 2.0, np.ones(2)), [2.0, 2.0])  # no wait


def test_a_group_of_several_processes_needs_the_distributed_client():
    with pytest.raises(RuntimeError, match="no jax.distributed client"):
        HostGroup(0, 2, client=None)


# ------------------------------------------------------------------ end to end


def _start_trainers(launcher, sampler: str, coordinator: str, follower_address: str):
    """The real `splitrl trainer` CLI as 2 processes x 2 devices: process 0 on the launcher's
    trainer address, process 1 (a follower) on its own port of this host."""
    common = [f"services.sampler_addresses=[{sampler}]",
              "trainer.distributed.num_processes=2",
              f"trainer.distributed.coordinator_address={coordinator}"]
    launcher.start("trainer", "trainer", [*common, "trainer.distributed.process_id=0"], 2)
    launcher.start("trainer-1", "trainer",
                   [*common, "trainer.distributed.process_id=1",
                    f"services.trainer_address={follower_address}"], 2)


def _wait_trainers(launcher, timeout_s: float) -> None:
    from tests.e2e.harness import tail, wait_exit

    for name in ("trainer", "trainer-1"):
        code = wait_exit(launcher, name, timeout_s)
        assert code == 0, f"{name} exited with {code}:\n" + tail(launcher.log_dir /
                                                                f"{name}.log", 60)


@pytest.mark.slow
def test_two_process_trainer_runs_pushes_checkpoints_and_resumes(arith_model, tmp_path):
    """Reward service + one sampler + a 2-process trainer through the CLI: 3 steps with a
    checkpoint at step 2, then both processes are started again and resume to step 4."""
    import grpc

    from splitrl.serving import check_health, make_channel
    from splitrl.v1 import trainer_pb2, trainer_pb2_grpc
    from splitrl_app.launch.supervisor import Launcher
    from tests.e2e.harness import log_records, run_config, trained_records

    run_dir = tmp_path / "run"
    cfg = run_config(arith_model, run_dir, "trainer.steps=3", "trainer.prompts_per_step=4",
                     "algorithm.group_size=4", "trainer.checkpoint.every=2",
                     "trainer.eval_before=false", "trainer.eval_after=false",
                     "services.num_samplers=1")
    launcher = Launcher(cfg)
    follower_address = f"127.0.0.1:{free_port()}"
    try:
        launcher.start("reward", "reward", [])
        sampler = launcher.start_sampler(0)
        launcher.wait_healthy("reward", launcher.reward_address)
        launcher.wait_healthy("sampler-0", sampler)

        _start_trainers(launcher, sampler, f"127.0.0.1:{free_port()}", follower_address)
        # Kubernetes probes every pod: the follower serves health, but not the Trainer API.
        launcher.wait_healthy("trainer-1", follower_address)
        with make_channel(follower_address) as channel:
            with pytest.raises(grpc.RpcError) as err:
                trainer_pb2_grpc.TrainerStub(channel).Status(trainer_pb2.StatusRequest(),
                                                             timeout=10)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "ask process 0" in err.value.details()
        _wait_trainers(launcher, 300)
        assert not check_health(follower_address, timeout_s=1.0)

        # Resume: both processes again, one more step, from the step-3 checkpoint.
        launcher.cfg.trainer.steps = 4
        from splitrl.config import dump_config

        dump_config(launcher.cfg, launcher.config_path)
        # The sampler started for 3 steps serves the extended run as it is: the run's length
        # is not agreed, and a sampler takes any newer version its trainer pushes.
        _start_trainers(launcher, sampler, f"127.0.0.1:{free_port()}", follower_address)
        _wait_trainers(launcher, 300)
    finally:
        launcher.stop()
        follower = launcher.procs.get("trainer-1")
        if follower is not None and follower.poll() is None:
            follower.kill()
            follower.wait()

    leader_log = log_records(launcher.log_dir / "trainer.log")
    follower_log = log_records(launcher.log_dir / "trainer-1.log")
    pushes = [r["version"] for r in leader_log if r.get("msg") == "weights pushed"]
    assert pushes == [1, 2, 3, 4], pushes  # every step's weights reached the sampler
    synced = [r for r in leader_log if r.get("msg") == "sampler synced"]
    assert [r["version"] for r in synced if r.get("ok")] == [0, 3]  # at start and on resume
    resumed = [r for r in leader_log if r.get("msg") == "resumed from checkpoint"]
    assert [(r["step"], r["version"]) for r in resumed] == [(3, 3)]
    # Followers only train: no pushes, no samplers, no metrics files of their own.
    assert not [r for r in follower_log if r.get("msg") in ("weights pushed", "sampler synced")]

    records = trained_records(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    uids = [u for r in records for u in r["uids"]]
    assert len(uids) == len(set(uids)) == 4 * 4, "each prompt once, across the restart"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert all(np.isfinite(m["loss"]) for m in metrics)
    steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [3, 4]  # keep 2: step 2 (periodic) rotated out by the final saves
    assert (run_dir / "export" / "config.json").is_file()
    assert list((run_dir / "export").glob("*.safetensors"))
