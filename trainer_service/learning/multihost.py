"""The trainer as a multi-controller JAX program: process 0 leads, every process trains.

On a multi-host slice every host runs ``splitrl trainer`` and ``splitrl.distributed`` joins them
into one JAX runtime whose mesh spans all hosts' devices. A jitted step on that mesh is a
collective: every process must make the same call, in the same order, on the same inputs. So

- process 0, the **leader**, does everything that talks to the world: the gRPC server, the
  sampler pool, dispatcher, buffer, publisher, data stream, evaluation, metrics files;
- every other process, a **follower**, builds the same mesh and ``Learner`` and then only obeys
  the leader (:func:`follow`), making the collective call that matches each control message.
  Both sides hold a ``trainer_service.policy.Policy``, whose methods make the leader's calls;
  the leader's loop is ``run.py``, a follower's ``follower.py``::

    leader (Policy; run.py stops)                      follower (follow)
    hosts.train(batch)         -- train + shapes -->   batch = hosts.receive_batch(message)
    learner.train_step(batch)                          learner.train_step(batch)
    hosts.params_for_push(...) -- gather ---------->   gather_params(learner.params) (dropped)
    hosts.checkpoint(step, v)  -- checkpoint ------>   checkpointer.save(step, ..., force=True)
    checkpointer.save(...)
    hosts.stop()               -- stop ------------>   close the checkpointer, exit 0 (1: failed)

Each program's first run waits until every process has compiled it (``first_runs.py``: Gloo
gives a process 30 s to join a new device group, and compiling can take longer).

Control messages are small JSON values in the key-value store of the ``jax.distributed``
coordination service (hosted by process 0): a follower waits for message n with a blocking get
that costs nothing while the leader waits for rollouts or evaluates, so no device collective
is left pending for minutes. The batch goes device to device (a sum over the processes' rows),
its shapes announced in the ``train`` message first (T varies with the bucket); followers get it
bitwise. Orbax is multi-process aware: every process writes its own shards, and the JSON
metadata (step, version, the data cursor) is written by process 0 only, so the cursor on disk
is the leader's.

Weight push: the sender (``splitrl.wire``) reads every region from shards its process holds,
and with a mesh over several processes the leader holds only its own hosts'. So for a push
every process gathers the params in buckets of ~256 MiB (a jitted identity onto the replicated
layout, then a copy to the host); followers drop each bucket at once, the leader keeps them.
Cost: the whole model in host RAM on the leader (params' dtype, e.g. 16 GB for 8B parameters
in bf16), one bucket at a time replicated on every device, and one all-gather of the model per
push. The leader keeps the last gathered copy: samplers joining between pushes
get it (the last pushed version), since a collective cannot start from the membership thread.
A single process does none of this: params are pushed straight from the devices (zero-copy).

Checkpoints: every process must see the same checkpoint directory (``trainer.checkpoint.dir``
on shared storage, e.g. GCS in ``deploy/k8s/overlays/gke-tpu``); the rest of the run directory
(metrics, trained prompts, export) is written by the leader only.

Stopping and failure: only the leader decides. On SIGTERM it stops after the current step and
sends ``stop``; a follower ignores its first signal (stopping alone would leave the others in a
collective). A leader whose run fails sends ``stop`` marked failed, so followers exit 1 too. If
the leader dies, the coordination service dies with it and JAX terminates the followers; the
indexed Job restarts all of them, and they resume from the last checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from trainer_service.learning.first_runs import FirstRuns
from trainer_service.learning.learner import TrainBatch

log = logging.getLogger(__name__)

KEY_PREFIX = "splitrl/trainer/control/"
BARRIER_PREFIX = "splitrl/trainer/barrier/"
OPS = ("train", "gather", "checkpoint", "stop")
_FIELDS = [f.name for f in dataclasses.fields(TrainBatch)]


@dataclasses.dataclass(frozen=True)
class Message:
    """One control message from the leader; followers act on them in ``seq`` order."""

    seq: int
    op: str  # one of OPS
    step: int = 0
    version: int = 0
    batch: dict[str, list] | None = None  # train: {field: [dtype, shape]} of the batch arrays
    failed: bool = False  # stop: the leader's run failed

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Message:
        message = cls(**json.loads(text))
        if message.op not in OPS:
            raise ValueError(f"control message {message.seq}: unknown op {message.op!r}")
        return message


class HostGroup:
    """This process's place in the trainer's process group, and the leader's side of the
    protocol. With one process every method is a pass-through and nothing is sent."""

    def __init__(self, process_index: int = 0, process_count: int = 1, client: Any = None,
                 poll_s: float = 60.0):
        if process_count > 1 and client is None:
            raise RuntimeError(f"{process_count} JAX processes but no jax.distributed client")
        self.index = process_index
        self.count = process_count
        self.client = client
        self.poll_s = poll_s
        self._seq = 0
        self._barriers = 0  # barriers passed: a process's n-th barrier meets the others' n-th
        self._stopped = False
        # The programs every process runs together: each first run waits for all to compile.
        self.first_runs = FirstRuns(self.barrier if self.multi else None)
        # The leader's host copy of the params from the last gather, and its weight version.
        self.gathered: tuple[dict[str, np.ndarray], int] | None = None

    @classmethod
    def current(cls) -> HostGroup:
        """The group of the running JAX runtime (after ``splitrl.distributed``)."""
        count = jax.process_count()
        client = None
        if count > 1:
            from jax._src import distributed

            client = distributed.global_state.client
        return cls(jax.process_index(), count, client)

    @property
    def multi(self) -> bool:
        return self.count > 1

    @property
    def is_leader(self) -> bool:
        return self.index == 0

    # ------------------------------------------------------------------ leader

    def train(self, batch: TrainBatch) -> TrainBatch:
        """Hand ``batch`` to every follower (they train on it next); returns it unchanged."""
        if self.multi:
            arrays = {name: np.asarray(getattr(batch, name)) for name in _FIELDS
                      if getattr(batch, name) is not None}
            self._send("train", batch={k: [v.dtype.name, list(v.shape)]
                                       for k, v in arrays.items()})
            self._broadcast({k: _wire(v) for k, v in arrays.items()}, is_source=True)
        return batch

    def params_for_push(self, params: Mapping[str, jax.Array], version: int) -> Mapping:
        """Params the weight sender can read whole: ``params`` itself with one process, else a
        host copy gathered with the followers' help (kept for samplers that join later)."""
        if not self.multi:
            return params
        self._send("gather", version=version)
        host = gather_params(params, first_runs=self.first_runs)
        self.gathered = (host, version)
        return host

    def checkpoint(self, step: int, version: int) -> None:
        """Tell the followers to save their shards of step ``step``, as the leader does next."""
        if self.multi:
            self._send("checkpoint", step=step, version=version)

    def stop(self, failed: bool = False) -> None:
        """Release the followers (once): they close their checkpointer and exit."""
        if self.multi and self.is_leader and not self._stopped:
            self._stopped = True
            self._send("stop", failed=failed)

    def _send(self, op: str, **fields) -> None:
        if not self.is_leader:
            raise RuntimeError(f"process {self.index} is a follower; only process 0 sends {op!r}")
        message = Message(self._seq, op, **fields)
        self.client.key_value_set(KEY_PREFIX + str(message.seq), message.to_json())
        if message.seq >= 2:
            # Every follower has read message n-2: it took part in message n-1's collective.
            _delete_quietly(self.client, KEY_PREFIX + str(message.seq - 2))
        self._seq += 1

    # ------------------------------------------------------------------ follower

    def receive(self) -> Message:
        """The leader's next control message (waits as long as the leader needs)."""
        text = self._wait_for(KEY_PREFIX + str(self._seq), "the leader",
                              {"message": self._seq})
        message = Message.from_json(text)
        if message.seq != self._seq:
            raise RuntimeError(f"control message {self._seq}: got seq {message.seq}")
        self._seq += 1
        return message

    def _wait_for(self, key: str, whom: str, context: dict) -> str:
        """The value of ``key`` in the coordination service, once someone sets it: waits as
        long as it takes (a blocking get per ``poll_s``, a log line after each).

        The client raises one error type both when a get reaches its deadline and when the
        service is gone. A read of the key's directory tells the two apart without reading
        the error's text: it answers an absent key with an empty list, and fails only when the
        service does (that error is raised)."""
        directory = key.rsplit("/", 1)[0] + "/"
        waited = 0.0
        while True:
            try:
                return self.client.blocking_key_value_get(key, int(self.poll_s * 1000))
            except Exception:
                present = dict(self.client.key_value_dir_get(directory))
                if key in present:  # set between the deadline and the read
                    return present[key]
            waited += self.poll_s
            log.info(f"waiting for {whom}", extra={**context, "waited_s": round(waited)})

    # ------------------------------------------------------------------ every process

    def barrier(self, name: str) -> None:
        """Wait until every process has reached this barrier (each process's n-th barrier
        meets the others' n-th; ``name`` says where, and must agree): as long as the slowest
        process needs, e.g. to compile a program (``first_runs``)."""
        if not self.multi:
            return
        n, self._barriers = self._barriers, self._barriers + 1
        key = f"{BARRIER_PREFIX}{n}/"
        self.client.key_value_set(key + str(self.index), name)
        for other in range(self.count):
            if other == self.index:
                continue
            theirs = self._wait_for(key + str(other), f"process {other}",
                                    {"barrier": n, "at": name})
            if theirs != name:
                raise RuntimeError(f"barrier {n}: process {other} is at {theirs!r}, process "
                                   f"{self.index} at {name!r}: the processes no longer run the "
                                   f"same programs")

    def _broadcast(self, arrays: dict[str, np.ndarray], is_source: bool) -> dict:
        """The leader's ``arrays`` on every process (followers pass zeros of the same shapes):
        each process's arrays are its row of a global array, summed over the rows on device,
        as ``jax.experimental.multihost_utils.broadcast_one_to_all`` does, with the first run
        of each set of shapes lined up by ``first_runs``."""
        mesh = _process_mesh()
        rows = {k: multihost_utils.host_local_array_to_global_array(
                    np.expand_dims(v if is_source else np.zeros_like(v), 0), mesh,
                    PartitionSpec("processes"))
                for k, v in arrays.items()}
        summed = self.first_runs.call(_sum_rows(mesh), 0, rows)
        return {k: np.asarray(v.addressable_data(0)) for k, v in summed.items()}

    def receive_batch(self, message: Message) -> TrainBatch:
        """The batch the leader broadcasts after a ``train`` message."""
        assert message.batch is not None, "a train message carries the batch's shapes"
        spec = {k: (np.dtype(dtype), tuple(shape)) for k, (dtype, shape) in message.batch.items()}
        zeros = {k: _wire(np.zeros(shape, dtype)) for k, (dtype, shape) in spec.items()}
        arrays = self._broadcast(zeros, is_source=False)
        return TrainBatch(**{k: np.asarray(arrays[k]).astype(spec[k][0]) for k in spec})


def follow(hosts: HostGroup, learner, checkpointer, on_message=None) -> bool:
    """A follower's whole run: obey the leader's control messages until ``stop``.

    Returns False if the leader reported that its run failed. ``on_message(message)`` is called
    after each message has been carried out (status, logging).
    """
    if hosts.is_leader:
        raise RuntimeError("follow() runs on followers; process 0 leads")
    while True:
        message = hosts.receive()
        t0 = time.monotonic()
        if message.op == "train":
            learner.train_step(hosts.receive_batch(message))
        elif message.op == "gather":
            gather_params(learner.params, first_runs=hosts.first_runs)
        elif message.op == "checkpoint":
            checkpointer.save(message.step, learner.train_state(),
                              weight_version=message.version, force=True)
        log.debug("control message done", extra={"op": message.op, "step": message.step,
                                                  "seconds": time.monotonic() - t0})
        if on_message is not None:
            on_message(message)
        if message.op == "stop":
            return not message.failed


GATHER_BUCKET_BYTES = 256 * 2**20


def gather_params(params: Mapping[str, jax.Array], bucket_bytes: int = GATHER_BUCKET_BYTES,
                  first_runs: FirstRuns | None = None) -> dict[str, np.ndarray]:
    """Every parameter whole on the host of every process (a collective: every process calls
    it with the same params). Tensors go in buckets of about ``bucket_bytes``, in name order:
    one compiled all-gather per bucket (the same buckets every push, so compiled once), and at
    most one bucket replicated on each device at a time. On a multi-host trainer pass the
    group's ``first_runs``: a bucket's first gather waits until every process compiled it."""
    out: dict[str, np.ndarray] = {}
    first_runs = first_runs or FirstRuns()
    for bucket in _buckets(params, bucket_bytes):
        replicate = _replicate(_mesh_of(params[bucket[0]]))
        whole = first_runs.call(replicate, 0, {n: params[n] for n in bucket})
        out.update({name: np.asarray(whole[name].addressable_data(0)) for name in bucket})
    return out


def _buckets(params: Mapping[str, jax.Array], limit: int) -> list[list[str]]:
    buckets: list[list[str]] = [[]]
    size = 0
    for name in sorted(params):
        nbytes = params[name].size * params[name].dtype.itemsize
        if buckets[-1] and size + nbytes > limit:
            buckets.append([])
            size = 0
        buckets[-1].append(name)
        size += nbytes
    return buckets if buckets[-1] else []


def _mesh_of(array: jax.Array) -> Mesh | AbstractMesh:
    sharding = array.sharding
    assert isinstance(sharding, NamedSharding), "the learner places parameters on its mesh"
    return sharding.mesh


def _identity(tree):
    return tree


@functools.cache
def _replicate(mesh: Mesh | AbstractMesh):
    """A jitted identity onto the replicated layout of ``mesh``: one function per mesh, so its
    compiled programs are found again (and ``FirstRuns`` knows them)."""
    return jax.jit(_identity, out_shardings=NamedSharding(mesh, PartitionSpec()))


@functools.cache
def _process_mesh() -> Mesh:
    """Every device of the runtime, a row per process."""
    devices = np.array(jax.devices()).reshape(jax.process_count(), jax.local_device_count())
    return Mesh(devices, ("processes", "local_devices"))


def _sum_over_rows(tree):
    return jax.tree.map(lambda x: jnp.sum(x, axis=0), tree)


@functools.cache
def _sum_rows(mesh: Mesh):
    """Sums each array over its first axis (a row per process), the result replicated."""
    return jax.jit(_sum_over_rows, out_shardings=NamedSharding(mesh, PartitionSpec()))


def host_model(learner, params: Mapping[str, np.ndarray | jax.Array], base_path=None):
    """The policy as an nnx model over host params (e.g. the leader's gathered copy, for the
    export), placed on the CPU backend when there is one rather than on one accelerator. With
    LoRA ``params`` are the adapters, merged into the base checkpoint at ``base_path`` (read
    again on this host: the leader holds only its shards of the trainer's copy)."""
    from splitrl.models import from_pretrained, hf_from_state, model_from_state, state_from_hf
    from splitrl.models.lora import merge

    try:
        device = jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        device = None
    with jax.default_device(device):
        if learner.lora is not None:
            from flax import nnx

            base = from_pretrained(base_path, dtype=learner.dtype)
            params = merge(hf_from_state(nnx.state(base, nnx.Param)), params, learner.lora)
        return model_from_state(learner.config, state_from_hf(learner.config, params),
                                learner.dtype)


def _wire(array: np.ndarray) -> np.ndarray:
    """bool travels as uint8: the broadcast is a sum with zeros from the other processes."""
    return array.astype(np.uint8) if array.dtype == np.bool_ else array


def _delete_quietly(client, key: str) -> None:
    try:
        client.key_value_delete(key)
    except Exception as e:  # housekeeping only
        log.debug("could not delete control key", extra={"key": key, "error": str(e)})
