"""Trainer checkpoints with orbax: everything a run needs to continue exactly where it was.

A checkpoint at train step `step` holds two orbax items:
  state  arrays (StandardSave): {"params", "opt_state"} from `Learner.train_state()`, plus
         "rng" (the key data of the trainer's PRNG key, if any)
  meta   JSON (JsonSave): step, weight version, the data cursor (an opaque JSON dict from the
         data pipeline), the PRNG implementation, the run's config and what the learner says
         its train state was made with (`Learner.checkpoint_meta()`: LoRA rank, targets and
         base checkpoint), which `meta` returns before any array is restored

    ckpt = Checkpointer.from_config(cfg.trainer.checkpoint, run_dir)
    ckpt.save(step, learner.train_state(), weight_version=v, data_cursor=cursor, rng=key,
              config=to_dict(cfg))            # a no-op unless step % every == 0 (or force=True)
    ...
    restored = ckpt.restore(learner.abstract_train_state())     # latest step by default
    learner.load_train_state(restored.state, restored.step)

Saves are asynchronous when configured (the arrays are copied off the devices, then written
in the background; the next save or `wait()` / `close()` waits for the previous one). Only the
last `keep` checkpoints are kept. Restoring takes the abstract state (ShapeDtypeStructs with
shardings), so arrays come back directly onto the trainer's current mesh and layout, which may
differ from the one that saved them.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec

from splitrl.config import CheckpointConfig

FORMAT_VERSION = 1


@dataclasses.dataclass
class Checkpoint:
    """What `Checkpointer.restore` returns."""

    step: int
    state: Any  # the train state, on the shardings of the abstract state given to restore
    weight_version: int
    data_cursor: dict
    rng: jax.Array | None
    config: dict | None
    learner_meta: dict | None = None


class Checkpointer:
    """Saves every `every` steps into `directory/<step>/`, keeping the last `keep`."""

    def __init__(
        self, directory: str | os.PathLike, *, every: int = 10, keep: int = 2,
        async_save: bool = True,
    ):
        if every < 1 or keep < 1:
            raise ValueError(f"checkpoint every and keep must be >= 1, got {every} and {keep}")
        self.directory = Path(directory).absolute()
        self.every = every
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=async_save,
            create=True,
        )
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "meta")
        )

    @classmethod
    def from_config(cls, cfg: CheckpointConfig, run_dir: str | os.PathLike) -> Checkpointer:
        directory = cfg.dir if cfg.dir is not None else Path(run_dir) / "checkpoints"
        return cls(directory, every=cfg.every, keep=cfg.keep, async_save=cfg.async_save)

    def should_save(self, step: int) -> bool:
        return step > 0 and step % self.every == 0

    def save(
        self,
        step: int,
        state: Any,
        *,
        weight_version: int,
        data_cursor: dict | None = None,
        rng: jax.Array | None = None,
        config: dict | None = None,
        learner_meta: dict | None = None,
        force: bool = False,
    ) -> bool:
        """Save the train state and metadata at `step` if `should_save(step)` or `force`
        (asynchronously if configured). Returns whether a save was started."""
        if not (force or self.should_save(step)):
            return False
        arrays = {"train": state}
        meta = {
            "format": FORMAT_VERSION,
            "step": int(step),
            "weight_version": int(weight_version),
            "data_cursor": data_cursor or {},
            "config": config,
            "learner": learner_meta,
            "rng_impl": None,
        }
        if rng is not None:
            if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
                meta["rng_impl"] = str(jax.random.key_impl(rng))
                rng = jax.random.key_data(rng)
            else:
                meta["rng_impl"] = "raw"  # an old-style uint32 key array
            arrays["rng"] = rng
            meta["rng_shape"] = list(rng.shape)
        self._manager.save(
            int(step),
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)
            ),
            force=True,
        )
        return True

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def meta(self, step: int | None = None) -> dict:
        """The JSON metadata of `step` (default: the latest): step, weight version, data cursor
        and the config of the run that saved it, without reading any array."""
        self.wait()
        step = self._existing(step)
        return self._manager.restore(
            step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
        ).meta

    def _existing(self, step: int | None) -> int:
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no checkpoint in {self.directory}")
        if step not in self._manager.all_steps():
            raise FileNotFoundError(
                f"no checkpoint for step {step} in {self.directory}; have {self.all_steps()}"
            )
        return step

    def restore(self, abstract_state: Any, step: int | None = None) -> Checkpoint:
        """Restore `step` (default: the latest) onto the shardings of `abstract_state`."""
        step = self._existing(step)
        meta = self.meta(step)
        abstract = {"train": abstract_state}
        if meta.get("rng_impl") is not None:
            abstract["rng"] = jax.ShapeDtypeStruct(
                tuple(meta["rng_shape"]), np.uint32, sharding=_replicated_like(abstract_state)
            )
        arrays = self._manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
        ).state
        rng = arrays.get("rng")
        if rng is not None and meta["rng_impl"] != "raw":
            rng = jax.random.wrap_key_data(rng, impl=meta["rng_impl"])
        return Checkpoint(
            step=int(meta["step"]),
            state=arrays["train"],
            weight_version=int(meta["weight_version"]),
            data_cursor=meta["data_cursor"],
            rng=rng,
            config=meta.get("config"),
            learner_meta=meta.get("learner"),
        )

    def wait(self) -> None:
        """Block until a pending asynchronous save is on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _replicated_like(abstract_state: Any):
    """A replicated sharding on the mesh of the abstract state (for small extras like rng)."""
    for leaf in jax.tree.leaves(abstract_state):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return NamedSharding(sharding.mesh, PartitionSpec())
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])
