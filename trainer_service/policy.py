"""The policy every trainer process holds: the learner on the global mesh, its checkpoints,
and the process's place in the host group.

Every process builds one from the same config: the leader (``run.py``) drives it, each
follower (``follower.py``) hands it to :func:`~trainer_service.learning.multihost.follow`.
The calls here that are collectives (a train step, a gather for a push, a checkpoint) tell
the followers first (``multihost.py``), so the leader's loop and theirs stay in step; with one
process the host group is a pass-through and the params are read straight from the devices.

One owner each: the weight version is the learner's (its count of updates); the params are
replaced by a train step under ``params_lock`` and read under it by a sampler that joins (the
join worker's thread, ``join_sync.py``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import jax

from splitrl.config import Config, to_dict
from splitrl.mesh import build_mesh
from splitrl.models import from_pretrained
from trainer_service.learning.checkpoints import Checkpoint, Checkpointer
from trainer_service.learning.export import export_adapter, export_hf
from trainer_service.learning.learner import Learner, TrainBatch
from trainer_service.learning.multihost import HostGroup, follow, host_model

log = logging.getLogger(__name__)


class Policy:
    """The learner, its checkpointer and the host group of one trainer process."""

    def __init__(self, cfg: Config, hosts: HostGroup):
        self.cfg = cfg
        self.hosts = hosts
        self.mesh = build_mesh(cfg.trainer.mesh)
        model = from_pretrained(cfg.model.path, dtype=cfg.model.dtype)
        self.learner = Learner.from_config(model, cfg, self.mesh,
                                           first_runs=hosts.first_runs)
        log.info("learner state", extra={  # what LoRA saves shows here (bench/lora_memory.py)
            f"{role}_mb": round(n / 2**20, 2) for role, n in self.learner.state_bytes().items()})
        self.checkpointer = Checkpointer.from_config(cfg.trainer.checkpoint, cfg.trainer.run_dir)
        self._params_lock = threading.Lock()

    @property
    def version(self) -> int:
        """The weight version: the learner's count of updates (its one owner)."""
        return self.learner.version

    # -- resume -----------------------------------------------------------------------------

    def restore(self, check: Callable[[dict], None]
                ) -> tuple[Checkpoint, list[tuple[int, str]]] | None:
        """Load the newest intact checkpoint into the learner (None: there is none). ``check``
        sees each candidate's metadata first and raises to refuse it; the learner refuses a
        train state of another kind (LoRA or not, rank, targets, base) even then. Returns the
        checkpoint and the unreadable steps skipped, newest first (moved aside by the leader
        only: every process skips the same)."""
        if self.checkpointer.latest_step() is None:
            return None

        def check_meta(meta: dict) -> None:
            check(meta)
            self.learner.check_checkpoint_meta(
                meta.get("learner"), where=f"checkpoint in {self.checkpointer.directory}")

        ckpt, skipped = self.checkpointer.restore_newest(self.learner.abstract_train_state(),
                                                         check_meta,
                                                         move_aside=self.hosts.is_leader)
        self.learner.load_train_state(ckpt.state, ckpt.weight_version)
        return ckpt, skipped

    def save(self, step: int, data_cursor: dict) -> None:
        """Checkpoint step ``step`` now: params, optimizer state, the version and the leader's
        ``data_cursor``; the followers save their shards of it too."""
        self.hosts.checkpoint(step, self.version)
        self.checkpointer.save(step, self.learner.train_state(), weight_version=self.version,
                               data_cursor=data_cursor, config=to_dict(self.cfg),
                               learner_meta=self.learner.checkpoint_meta(), force=True)

    # -- training ---------------------------------------------------------------------------

    def train(self, batch: TrainBatch) -> dict[str, float]:
        """One update on ``batch`` (every process trains on it); the learner may skip it."""
        self.hosts.train(batch)
        with self._params_lock:
            return self.learner.train_step(batch)

    def start_warm_up(self, rows: int, length: int) -> threading.Thread | None:
        """Compile the train step for ``rows`` x ``length`` batches in the background, so the
        first step does not wait for the compiler. Single-process only (followers must make
        the same calls, in the same order)."""
        if self.hosts.multi:
            return None

        def run():
            try:
                self.learner.warm_up(rows, length)
            except Exception:  # only a head start: the first step compiles what is missing
                log.exception("train step warm-up failed")

        thread = threading.Thread(target=run, name="warm-up", daemon=True)
        thread.start()
        return thread

    # -- the weights, read ------------------------------------------------------------------

    def params_for_push(self) -> Mapping:
        """The params as the weight sender reads them: straight from the devices (one
        process), or gathered to this host together with the followers (multi-host)."""
        return self.hosts.params_for_push(self.learner.params, self.version)

    def current_weights(self) -> tuple[Mapping, int]:
        """``(params on the host, version)`` for a sampler that joins, from any thread: a
        collective cannot start there, so multi-host returns the last gathered copy."""
        with self._params_lock:
            if self.hosts.multi:
                if self.hosts.gathered is None:
                    raise RuntimeError("no gathered params yet: the run gathers before it starts")
                return self.hosts.gathered
            return jax.device_get(self.learner.params), self.version

    def export(self, out: Path) -> None:
        """The policy as a Hugging Face model in ``out``; with LoRA also the adapters as a PEFT
        directory ``out/adapter`` (for the base checkpoint ``model.path``)."""
        params = self._trained_params()
        export_hf(self._host_model(params), out, source_dir=self.cfg.model.path)
        if self.learner.lora is not None:
            export_adapter(self.learner.lora, params, out / "adapter",
                           config=self.learner.config, base_model=self.cfg.model.path)

    def _trained_params(self) -> Mapping:
        """The trained params now (the adapters with LoRA): the learner's own (one process), or
        the leader's gathered copy (multi-host; the final step's push gathered them)."""
        if not self.hosts.multi:
            return self.learner.params
        gathered = self.hosts.gathered
        if gathered is None or gathered[1] != self.version:
            return self.params_for_push()
        return gathered[0]

    def _host_model(self, params: Mapping):
        """The current policy as an nnx model on this host."""
        if not self.hosts.multi:
            return self.learner.model()
        return host_model(self.learner, params, base_path=self.cfg.model.path)

    # -- a follower ---------------------------------------------------------------------------

    def follow(self, on_message=None) -> bool:
        """A follower's whole run: the leader's train steps, gathers and checkpoints, on its
        word, until it says stop (False: the leader's run failed)."""
        return follow(self.hosts, self.learner, self.checkpointer, on_message)

    def close(self) -> None:
        self.checkpointer.close()
