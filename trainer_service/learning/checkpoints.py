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
    learner.load_train_state(restored.state, restored.weight_version)

Saves are asynchronous when configured (the arrays are copied off the devices, then written
in the background; the next save or `wait()` / `close()` waits for the previous one). A save
that fails in the background is reported by the first `check_saved()` after it ended (the run
calls it every step), as :class:`SaveFailed` naming the cause (disk full, permission, quota):
the run learns of it long before the next save is due. Only the last `keep` checkpoints are
kept.

Restoring verifies: `restore_newest` reads the newest step whole (metadata and every array);
a step that does not read (a truncated data file, garbled metadata) is moved aside to
``<dir>.unreadable/<step>`` and the next older step is tried, so a run resumes from the newest
intact checkpoint and says which steps it skipped and why.

Restoring takes the abstract state (ShapeDtypeStructs with shardings), so arrays come back
directly onto the trainer's current mesh and layout, which may differ from the one that saved
them.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec

from splitrl.config import CheckpointConfig

log = logging.getLogger(__name__)

FORMAT_VERSION = 1

# What a person can do something about, by errno, in the words of a console line.
_STORAGE_CAUSES = {
    errno.ENOSPC: "disk full (no space left on device)",
    errno.EDQUOT: "disk quota exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.EROFS: "read-only file system",
    errno.EIO: "input/output error (a failing disk?)",
}


# tensorstore (orbax's array writer) raises ValueError carrying the errno as a status payload,
# rendered as [os_error_code='28'].
_TENSORSTORE_ERRNO = re.compile(r"\[os_error_code='(\d+)'\]")


def _errno(error: BaseException) -> int | None:
    if isinstance(error, OSError):
        return error.errno
    found = _TENSORSTORE_ERRNO.search(str(error))
    return int(found.group(1)) if found else None


def storage_cause(error: BaseException) -> str:
    """The cause of a failed write as a person reads it: "disk full (...)", "permission
    denied", "disk quota exceeded"..., from the errno of the first error in the exception's
    chain that carries one; otherwise the exception itself."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        code = _errno(current)
        if code in _STORAGE_CAUSES:
            where = getattr(current, "filename", None)
            return _STORAGE_CAUSES[code] + (f" writing {where}" if where else "")
        current = current.__cause__ or current.__context__
    return f"{type(error).__name__}: {str(error)[:300]}"


class SaveFailed(Exception):
    """A checkpoint could not be written; ``cause`` says why in a person's words."""

    def __init__(self, step: int, directory: Path, error: BaseException):
        self.step, self.cause = step, storage_cause(error)
        super().__init__(f"the checkpoint of step {step} could not be written to {directory}: "
                         f"{self.cause}")


class NoIntactCheckpoint(Exception):
    """Checkpoints exist but none of them reads."""


class _OrbaxErrorsAsWarnings(logging.Filter):
    """orbax logs (through absl's logger) a failed save at error level from each thread it ran
    in, and an unreadable step as it tries it; the Checkpointer reports both once, with their
    cause (:class:`SaveFailed`, :meth:`Checkpointer.restore_newest`). Those lines stay in the
    log, as warnings, off the console's error lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


class _OrbaxTaskErrorsAsWarnings(_OrbaxErrorsAsWarnings):
    """The same for asyncio's "Task exception was never retrieved": when several of a save's
    writes fail at once (a full disk), orbax awaits the first failure and asyncio logs each
    other one as its task is collected, at error level. Only records whose exception was raised
    in orbax's code are demoted; any other task's error stays an error."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _raised_in_orbax(record.exc_info):
            return super().filter(record)
        return True


def _raised_in_orbax(exc_info) -> bool:
    """Whether the traceback of a log record's exception passes through an ``orbax`` module."""
    tb = exc_info[2] if exc_info else None
    while tb is not None:
        if str(tb.tb_frame.f_globals.get("__name__", "")).startswith("orbax."):
            return True
        tb = tb.tb_next
    return False


_ORBAX_FILTER = _OrbaxErrorsAsWarnings()
_ORBAX_TASK_FILTER = _OrbaxTaskErrorsAsWarnings()


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
        self._unchecked: int | None = None  # a save started and not yet known to be on disk
        logging.getLogger("absl").addFilter(_ORBAX_FILTER)  # once: filters are a set
        logging.getLogger("asyncio").addFilter(_ORBAX_TASK_FILTER)

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
        try:  # (orbax waits for the previous save first, after a barrier of all processes)
            self._manager.save(
                int(step),
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)
                ),
                force=True,
            )
        except Exception as e:  # a synchronous save, the start of an asynchronous one, or
            # the previous one (if no check_saved() saw it fail)
            raise SaveFailed(self._unchecked or int(step), self.directory, e) from e
        self._unchecked = int(step)
        return True

    @property
    def save_pending(self) -> bool:
        """A save was started and is not yet known to be on disk."""
        return self._unchecked is not None

    def check_saved(self) -> None:
        """Raise :class:`SaveFailed` if the last save failed; never waits for one that is still
        being written."""
        if self._unchecked is not None and not self._manager.is_saving_in_progress():
            self.wait()

    def wait(self) -> None:
        """Block until a pending asynchronous save is on disk; :class:`SaveFailed` if it
        failed."""
        step, self._unchecked = self._unchecked, None
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            raise SaveFailed(step if step is not None else -1, self.directory, e) from e

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

    def restore_newest(
        self, abstract_state: Any, check_meta: Callable[[dict], None] = lambda meta: None,
        *, move_aside: bool = True,
    ) -> tuple[Checkpoint, list[tuple[int, str]]]:
        """Restore the newest step that reads whole, verifying each from the newest down:
        ``check_meta`` sees its metadata first (an exception from it propagates: a checkpoint
        of another run is refused, not skipped). Unreadable steps are moved aside to
        ``<dir>.unreadable/`` so new saves and ``splitrl audit`` never read them again.
        Returns the checkpoint and the skipped ``(step, reason)``s, newest first;
        :class:`NoIntactCheckpoint` when none reads (then nothing is moved). Several processes
        restoring one checkpoint (multi-host) skip the same steps; only one (``move_aside``)
        moves them."""
        skipped: list[tuple[int, str]] = []
        for step in reversed(self.all_steps()):
            try:
                meta = self.meta(step)
            except Exception as e:
                skipped.append((step, _reason(e)))
                continue
            check_meta(meta)
            try:
                checkpoint = self.restore(abstract_state, step)
            except Exception as e:
                skipped.append((step, _reason(e)))
                continue
            if move_aside:
                self._set_aside([s for s, _ in skipped])
            return checkpoint, skipped
        raise NoIntactCheckpoint(  # left in place: starting afresh is the user's decision
            f"no checkpoint in {self.directory} reads: "
            + "; ".join(f"step {s}: {r}" for s, r in skipped)
            + ". To start the run afresh: another trainer.run_dir, or remove that directory "
            "(a copy of the run directory keeps them for a look).")

    def newest_readable_meta(self) -> dict | None:
        """The metadata of the newest step whose metadata reads (None: there is none)."""
        for step in reversed(self.all_steps()):
            try:
                return self.meta(step)
            except Exception:
                continue
        return None

    def _aside_dir(self) -> Path:
        return self.directory.with_name(self.directory.name + ".unreadable")

    def _set_aside(self, steps: list[int]) -> None:
        for step in steps:
            target = self._aside_dir() / str(step)
            if target.exists():
                shutil.rmtree(target)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(self.directory / str(step)), target)
            log.warning("unreadable checkpoint moved aside",
                        extra={"step": step, "to": str(target)})
        if steps:
            self._manager.reload()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _reason(error: BaseException) -> str:
    """Why a checkpoint step does not read, in one line: the innermost cause (orbax wraps the
    storage layer's error, e.g. tensorstore's OUT_OF_RANGE for a truncated file, in its own)."""
    seen: set[int] = set()
    while id(error) not in seen:
        cause = error.__cause__ or error.__context__
        if cause is None:
            break
        seen.add(id(error))
        error = cause
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def _replicated_like(abstract_state: Any):
    """A replicated sharding on the mesh of the abstract state (for small extras like rng)."""
    for leaf in jax.tree.leaves(abstract_state):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return NamedSharding(sharding.mesh, PartitionSpec())
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])
