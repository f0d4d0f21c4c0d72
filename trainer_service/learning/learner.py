"""The learner: the policy's parameters and optimizer state on the trainer's mesh, and one
GRPO/GSPO train step over a batch of scored rollouts.

    learner = Learner.from_config(model, cfg, mesh)   # or Learner(model, algorithm=..., ...)
    metrics = learner.train_step(batch)               # batch: TrainBatch (see below)
    learner.params                                    # {hf_name: array} on the trainer's mesh

One train step, for each of `epochs_per_batch` epochs over the batch:
    for each micro-batch:
        logp, entropy = chunked token logprobs of the completions under the current params
        old = logp (first epoch, no gradient; reused by later epochs)     -> ratio pi / pi_old
        ref = reference logprobs (only if beta > 0, computed once)
        loss = losses.compute_loss(...) with the full batch's token / sequence counts
        accumulate gradients (they add up to the full batch's gradient)
    one optax update (global-norm clip -> adamw, scheduled lr)

Simplifications, stated: one optimizer update per epoch (micro-batches only accumulate); the
sampler's logprobs are used for truncated importance sampling (see losses.py), not as pi_old;
reported loss metrics are the mean over epochs.

Parameters are kept as a flat `{hf_name: array}` dict (the names of the HF checkpoint and of
the weight wire), sharded with `splitrl.mesh.param_shardings`, and turned back into the nnx
model inside `jax.jit` (`nnx.merge`), which is much cheaper per step than `nnx.jit`.

With LoRA (`lora=LoraSpec`, `splitrl.models.lora`) the trained `params` are the adapters only
(`<module>.lora_A.weight` / `lora_B.weight`, sharded on the same mesh), and the frozen base
weights are `base_params`: the forward attaches the adapters to the base model inside the jit,
so gradients and optimizer state exist for the adapters alone, and the reference policy of the
KL term is the same base with the adapters off (no second copy). `policy_params()` is what
samplers serve and the export holds: the base with the adapters merged in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from splitrl.config import AlgorithmConfig, OptimizerConfig
from splitrl.mesh import DATA_AXIS, FSDP_AXIS, param_shardings
from splitrl.models import (
    CausalLM,
    abstract_model,
    hf_from_state,
    state_from_hf,
)
from splitrl.models import lora as lora_lib
from splitrl.models.lora import LoraSpec
from trainer_service.learning import losses
from trainer_service.learning.first_runs import FirstRuns
from trainer_service.learning.optim import make_optimizer
from trainer_service.learning.programs import (
    ForwardSpec,
    Layout,
    apply_update,
    forward,
    grad_step,
)

Params = dict[str, jax.Array]


@dataclasses.dataclass
class TrainBatch:
    """A padded batch of B scored completions (host numpy arrays).

    Row b is one prompt + completion. Per-position arrays are indexed like `tokens`: entry
    [b, t] is about the token tokens[b, t] (predicted from tokens[b, :t]), so position 0 can
    never be a completion token.

    tokens            int   [B, T]  prompt then completion; left-pad the prompt, right-pad the
                                    completion (any pad id)
    attention_mask    bool  [B, T]  True on real tokens (prompt and completion), False on padding
    completion_mask   bool  [B, T]  True on completion tokens whose logprob counts in the loss
    sampler_logprobs  float [B, T]  log pi_sampler(tokens[b, t]) reported by the sampler, under
                                    its sampling temperature (any value elsewhere)
    advantages        float [B]     one advantage per completion (learning.advantages)
    group_ids         int   [B]     prompt group of each completion
    rewards           float [B]     optional, for metrics and the zero-variance filter
    """

    tokens: np.ndarray
    attention_mask: np.ndarray
    completion_mask: np.ndarray
    sampler_logprobs: np.ndarray
    advantages: np.ndarray
    group_ids: np.ndarray
    rewards: np.ndarray | None = None

    def __post_init__(self):
        b, t = np.shape(self.tokens)
        for name in ("attention_mask", "completion_mask", "sampler_logprobs"):
            if np.shape(getattr(self, name)) != (b, t):
                raise ValueError(
                    f"TrainBatch.{name}: expected shape {(b, t)} like tokens, "
                    f"got {np.shape(getattr(self, name))}"
                )
        for name in ("advantages", "group_ids", "rewards"):
            value = getattr(self, name)
            if value is not None and np.shape(value) != (b,):
                raise ValueError(f"TrainBatch.{name}: expected shape {(b,)}, got {np.shape(value)}")
        if np.any(np.asarray(self.completion_mask)[:, 0]):
            raise ValueError("TrainBatch.completion_mask: position 0 cannot be a completion token")
        if np.any(np.asarray(self.completion_mask) & ~np.asarray(self.attention_mask, bool)):
            raise ValueError("TrainBatch.completion_mask: marks tokens outside attention_mask")


class Learner:
    """Owns the policy parameters, the optimizer state and (iff beta > 0 without LoRA) frozen
    reference parameters, all on `mesh`; `train_step` runs one GRPO/GSPO update. With `lora`
    the trained parameters are the adapters (see the module docstring)."""

    def __init__(
        self,
        model: CausalLM,
        *,
        algorithm: AlgorithmConfig,
        optimizer: OptimizerConfig,
        mesh: Mesh,
        strategy: str | None = "fsdp",
        micro_batch_size: int | None = None,
        epochs_per_batch: int = 1,
        temperature: float = 1.0,
        logprob_chunk_size: int = 256,
        reference: CausalLM | None = None,
        generation_budget: int | None = None,
        lora: LoraSpec | None = None,
        adapters: dict[str, Any] | None = None,
        seed: int = 0,
        base_fingerprint: str | None = None,
        remat: str = "none",
        attention: str = "auto",
        layer_loop: str = "auto",
        first_runs: FirstRuns | None = None,
    ):
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 for training logprobs, got {temperature}")
        if lora is not None and reference is not None:
            raise ValueError("with LoRA the reference policy is the base model (adapters off); "
                             "a separate reference model is not used")
        self.algorithm = algorithm
        self.mesh = mesh
        self.config = model.config
        self.dtype = model.dtype
        self.micro_batch_size = micro_batch_size
        self.epochs = epochs_per_batch
        self.temperature = temperature
        self.chunk_size = logprob_chunk_size
        self.loss_settings = losses.loss_settings(algorithm, generation_budget)
        # How the train step's programs are called: straight through with one process; on a
        # multi-host trainer each one's first run waits until every process has compiled it.
        self.first_runs = first_runs or FirstRuns()
        self.tx, self.schedule = make_optimizer(optimizer, updates_per_step=epochs_per_batch)
        # The version of `params`: updates applied so far. It is the one count of updates: the
        # trainer's weight version reads it, the learning-rate schedule and the LoRA dropout
        # keys run on it, and optax's own count moves with it (a batch with nothing to train
        # on moves neither); a checkpoint restores it with the optimizer state.
        self.version = 0
        self.lora = lora
        self.seed = seed
        self.base_fingerprint = base_fingerprint  # of the base checkpoint (LoRA runs)

        # The policy's forward in the train step, with the `model.remat` policy of its backward
        # pass (`splitrl.models.transformer.REMAT_POLICIES`), its `model.attention`
        # implementation (the splash kernel runs under a shard_map over `mesh`, which the
        # programs are traced with: see `_on_mesh`) and its `model.layer_loop` ("auto": the
        # layers unrolled on a CPU mesh, scanned elsewhere: `transformer.LAYER_LOOPS` says why).
        platforms = {d.platform for d in mesh.devices.flat}
        if layer_loop == "auto":
            layer_loop = "unrolled" if platforms == {"cpu"} else "scan"
        self._graphdef = nnx.split(abstract_model(self.config, self.dtype, remat=remat,
                                                  attention=attention,
                                                  layer_loop=layer_loop))[0]
        self._kernel_mesh = (mesh if attention == "splash"
                             or (attention == "auto" and platforms == {"tpu"}) else None)
        flat = hf_from_state(nnx.state(model, nnx.Param))
        # An abstract model (`splitrl.models.abstract_model`: ShapeDtypeStruct leaves) makes an
        # abstract learner: every array below is a sharded ShapeDtypeStruct, nothing is
        # allocated, and `lower_train_step` compiles its programs ahead of time (`splitrl plan`).
        self.abstract = all(isinstance(v, jax.ShapeDtypeStruct) for v in flat.values())
        # Frozen base weights (LoRA only): read by every forward, never updated or saved.
        self.base_params: Params | None = None
        if lora is None:
            self.param_shardings = param_shardings(mesh, flat, strategy)
            self.params: Params = self._place(flat, self.param_shardings)
        else:
            self.base_params = self._place(flat, param_shardings(mesh, flat, strategy))
            if adapters is None:
                adapters = lora_lib.init_adapters(self.config, lora, seed)
            lora_lib.check_adapters(self.config, lora, adapters)
            adapters = {k: jax.ShapeDtypeStruct(v.shape, jnp.float32) if self.abstract
                        else jnp.asarray(v, jnp.float32) for k, v in adapters.items()}
            self.param_shardings = param_shardings(mesh, adapters, strategy)
            self.params = self._place(adapters, self.param_shardings)
        # Reference policy for the KL term: kept only when it is used (beta > 0); with LoRA it
        # is the base (adapters off), which is already here.
        self.ref_params: Params | None = None
        if algorithm.beta > 0 and lora is None:
            source = flat if reference is None else hf_from_state(nnx.state(reference, nnx.Param))
            self.ref_params = (  # a copy, never updated; one program for every tensor
                self._place(source, self.param_shardings) if self.abstract else
                jax.jit(lambda t: jax.tree.map(jnp.copy, t),
                        out_shardings=self.param_shardings)(source))

        # Gradients accumulate sharded as the parameters are (FSDP: each device sums its own
        # shard). Zeros made without a sharding land on one device, and the gradient program
        # then returned every gradient whole on every device.
        self._zero_grads = jax.jit(lambda tree: jax.tree.map(jnp.zeros_like, tree),
                                   out_shardings=self.param_shardings)
        self._opt_shardings = self._optimizer_shardings()
        self._layout = Layout.of(self.param_shardings)
        self._opt_layout = Layout.of(self._opt_shardings)
        if self.abstract:
            self.opt_state = self._place(jax.eval_shape(self.tx.init, self.params),
                                         self._opt_shardings)
        else:  # one program, not one per parameter shape and operation
            self.opt_state = jax.jit(self.tx.init, out_shardings=self._opt_shardings)(
                self.params)
        # Hashable static descriptions: learners with equal settings share compiled steps.
        self._spec = ForwardSpec(self._graphdef, self.config, logprob_chunk_size, temperature,
                                  lora)
        self._settings = tuple(sorted(self.loss_settings.items()))

    @classmethod
    def from_config(cls, model: CausalLM, cfg, mesh: Mesh,
                    first_runs: FirstRuns | None = None) -> Learner:
        """A learner for a whole run's `splitrl.config.Config` on the trainer's `mesh` (with
        adapters when `model.lora` is set: fresh, or the PEFT adapter at `model.lora.path`)."""
        lora = adapters = fingerprint = None
        if cfg.model.lora is not None:
            from splitrl.models.hf_io import checkpoint_fingerprint

            base = hf_from_state(nnx.state(model, nnx.Param))
            lora, adapters = lora_lib.from_section(
                cfg.model.lora, model.config, seed=cfg.trainer.seed, base=base)
            if not all(isinstance(v, jax.ShapeDtypeStruct) for v in base.values()):
                # (an abstract model, for `splitrl plan`, has no weights to fingerprint)
                fingerprint = checkpoint_fingerprint(cfg.model.path)
        return cls(
            model,
            algorithm=cfg.algorithm,
            optimizer=cfg.trainer.optimizer,
            mesh=mesh,
            strategy=cfg.trainer.mesh.strategy,
            micro_batch_size=cfg.trainer.micro_batch_size,
            epochs_per_batch=cfg.trainer.epochs_per_batch,
            temperature=cfg.sampling.temperature or 1.0,  # greedy samplers report T = 1
            logprob_chunk_size=cfg.model.logprob_chunk_size,
            generation_budget=cfg.sampling.max_new_tokens,
            lora=lora,
            adapters=adapters,
            seed=cfg.trainer.seed,
            base_fingerprint=fingerprint,
            remat=cfg.model.remat,
            attention=cfg.model.attention,
            layer_loop=cfg.model.layer_loop,
            first_runs=first_runs,
        )

    # ------------------------------------------------------------------ the algorithm

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One GRPO/GSPO update on `batch`; returns the step's metrics (host floats)."""
        completion_mask = np.asarray(batch.completion_mask, bool)
        metrics = self._batch_metrics(batch, completion_mask)
        counts = {  # the full batch's normalisers, shared by every micro-batch
            "num_tokens": float(completion_mask[:, 1:].sum()),
            "num_sequences": float((completion_mask.sum(-1) > 0).sum()),
        }
        if counts["num_tokens"] == 0:  # everything filtered: no update at all
            return {**metrics, "skipped": 1.0, "lr": float(self.schedule(self._updates()))}

        micro_batches = self._micro_batches(batch, completion_mask)
        ref = [self._reference_logprobs(mb) for mb in micro_batches]  # None unless beta > 0
        old = None  # pi_old: the first epoch's logprobs
        per_epoch = []
        for epoch in range(self.epochs):
            lr = float(self.schedule(self._updates()))
            grads, old, loss_metrics = self._accumulate_gradients(micro_batches, old, ref, counts,
                                                                  epoch)
            self.params, self.opt_state, grad_norm = self.first_runs.call(
                apply_update, 3, self.tx, self._layout, self._opt_layout, self.params,
                self.opt_state, grads
            )
            per_epoch.append({**loss_metrics, "grad_norm": float(grad_norm), "lr": lr})
        self.version += 1
        metrics.update(_mean_over_epochs(per_epoch))
        return metrics

    def warm_up(self, rows: int, length: int) -> None:
        """Compile the train step's programs for batches of `rows` x `length` tokens before
        the first batch exists (the trainer calls it while the samplers generate).

        Runs the reference forward and the gradient program on an all-masked batch (outputs
        dropped, parameters untouched) and compiles the optimizer update ahead of time. Changes
        no state: a run with or without a warm-up trains the same numbers.
        """
        shape = (rows, length)
        empty = TrainBatch(
            tokens=np.zeros(shape, np.int32), attention_mask=np.zeros(shape, bool),
            completion_mask=np.zeros(shape, bool), sampler_logprobs=np.zeros(shape, np.float32),
            advantages=np.zeros(rows, np.float32), group_ids=np.zeros(rows, np.int32))
        mb = self._micro_batches(empty, empty.completion_mask)[:1]
        counts = {"num_tokens": 1.0, "num_sequences": 1.0}
        grads, _, _ = self._accumulate_gradients(mb, None, [self._reference_logprobs(mb[0])],
                                                 counts)
        # The update donates params and optimizer state: compiled, not run.
        apply_update.lower(self.tx, self._layout, self._opt_layout, self.params,
                            self.opt_state, grads).compile()

    def _accumulate_gradients(self, micro_batches, old, ref, counts, epoch=0):
        """Sum of the micro-batch gradients (= the full batch's), the logprobs to use as pi_old
        in later epochs, and the batch's loss metrics."""
        grads, parts = self._zero_grads(self.params), []
        first_epoch = old is None
        old = [None] * len(micro_batches) if first_epoch else old
        for i, mb in enumerate(micro_batches):
            with self._on_mesh():
                grads, logp, m = self.first_runs.call(
                    grad_step, 3, self._spec, self._settings, self._layout, grads,
                    self.base_params, self.params, mb,
                    _placeholder(mb) if first_epoch else old[i], first_epoch, ref[i], counts,
                    self._dropout_key(epoch, i),
                )
            old[i] = logp if first_epoch else old[i]
            parts.append(m)
        return grads, old, _combine(parts)

    # ------------------------------------------------------------------ helpers

    def _on_mesh(self):
        """The context the model's programs are traced in: the trainer's mesh set
        (`jax.set_mesh`) when the splash kernel may run (``model.attention`` "splash", or
        "auto" on TPU), since a Pallas kernel runs under a shard_map over it; no mesh
        otherwise, so the XLA path's programs are exactly those traced without a kernel."""
        if self._kernel_mesh is None:
            return contextlib.nullcontext()
        return jax.set_mesh(self._kernel_mesh)

    def _updates(self) -> int:
        """Optimizer updates done so far (the schedule's clock)."""
        return self.version * self.epochs

    def _dropout_key(self, epoch: int, micro_batch: int) -> jax.Array | None:
        """The LoRA dropout key of one forward: a function of (seed, version, epoch,
        micro-batch), so a resumed run draws the same masks. None without LoRA dropout."""
        if self.lora is None or self.lora.dropout == 0:
            return None
        key = jax.random.key(self.seed)
        for part in (self.version, epoch, micro_batch):
            key = jax.random.fold_in(key, part)
        return key

    def _optimizer_shardings(self):
        """Optimizer-state leaves that mirror a parameter (Adam's moments) share its sharding;
        everything else (step counts) is replicated."""
        replicated = NamedSharding(self.mesh, PartitionSpec())

        def pick(path, leaf):
            name = getattr(path[-1], "key", None) if path else None
            param = self.param_shardings.get(name) if isinstance(name, str) else None
            if param is not None and leaf.shape == self.params[name].shape:
                return param
            return replicated

        abstract = jax.eval_shape(self.tx.init, self.params)
        return jax.tree_util.tree_map_with_path(pick, abstract)

    def _place(self, tree, shardings):
        """`tree` on the mesh: device arrays, or sharded ShapeDtypeStructs when abstract."""
        if not self.abstract:
            return jax.device_put(tree, shardings)
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
        )

    def lower_train_step(self, rows: int, length: int) -> dict[str, jax.stages.Lowered]:
        """The programs of one train step, lowered for micro-batches of `rows` x `length`
        tokens with this learner's mesh, shardings and settings: "grad_step" (forward,
        backward and gradient accumulation of one micro-batch), "apply_update" (the optax
        update) and, when beta > 0, "reference_logprobs". `.compile()` them for their
        `memory_analysis()`; works on an abstract learner (nothing runs)."""
        sharding = self._batch_sharding(rows)
        spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding(
            len(shape)))
        mb = {
            "tokens": spec((rows, length), jnp.int32),
            "attention_mask": spec((rows, length), jnp.bool_),
            "completion_mask": spec((rows, length), jnp.bool_),
            "sampler_logprobs": spec((rows, length), jnp.float32),
            "advantages": spec((rows,), jnp.float32),
        }
        logp = spec((rows, length - 1), jnp.float32)
        scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype)
        counts = {"num_tokens": scalar(jnp.float32), "num_sequences": scalar(jnp.float32)}
        abstract = lambda tree: jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
        params, opt_state, base = (abstract(t) for t in (self.params, self.opt_state,
                                                         self.base_params))
        ref = None if self.algorithm.beta <= 0 else logp
        with self._on_mesh():
            lowered = {
                "grad_step": grad_step.lower(
                    self._spec, self._settings, self._layout, params, base, params, mb, logp,
                    scalar(jnp.bool_), ref, counts, self._dropout_key(0, 0),
                ),
                "apply_update": apply_update.lower(self.tx, self._layout, self._opt_layout,
                                                    params, opt_state, params),
            }
            if self.lora is not None and self.algorithm.beta > 0:  # the base, adapters off
                lowered["reference_logprobs"] = forward.lower(
                    self._spec._replace(lora=None), None, base, mb)
            elif self.ref_params is not None:
                lowered["reference_logprobs"] = forward.lower(
                    self._spec, None, abstract(self.ref_params), mb)
        return lowered

    def _reference_logprobs(self, mb):
        if self.algorithm.beta <= 0:
            return None
        with self._on_mesh():
            if self.lora is not None:  # the base model, adapters off
                return self.first_runs.call(forward, 1, self._spec._replace(lora=None), None,
                                            self.base_params, mb)[0]
            return self.first_runs.call(forward, 1, self._spec, None, self.ref_params, mb)[0]

    def _micro_batches(self, batch: TrainBatch, completion_mask) -> list[dict[str, jax.Array]]:
        """Split into micro-batches of equal size (the last padded with fully masked rows, so
        one compiled step serves all), each sharded over the mesh's data-parallel axes."""
        b = batch.tokens.shape[0]
        size = b if self.micro_batch_size is None else min(self.micro_batch_size, b)
        n = math.ceil(b / size)
        arrays = {
            "tokens": np.asarray(batch.tokens, np.int32),
            "attention_mask": np.asarray(batch.attention_mask, bool),
            "completion_mask": completion_mask,
            "sampler_logprobs": np.asarray(batch.sampler_logprobs, np.float32),
            "advantages": np.asarray(batch.advantages, np.float32),
        }
        pad = n * size - b
        if pad:
            arrays = {k: np.concatenate([v, np.zeros((pad,) + v.shape[1:], v.dtype)])
                      for k, v in arrays.items()}
        sharding = self._batch_sharding(size)
        return [
            {k: jax.device_put(v[i * size:(i + 1) * size], sharding(v.ndim))
             for k, v in arrays.items()}
            for i in range(n)
        ]

    def _batch_sharding(self, rows: int):
        axes = [a for a in (DATA_AXIS, FSDP_AXIS) if a in self.mesh.axis_names]
        ways = math.prod(self.mesh.shape[a] for a in axes)
        spec_axis = tuple(axes) if axes and rows % ways == 0 else None
        return lambda ndim: NamedSharding(
            self.mesh, PartitionSpec(spec_axis, *([None] * (ndim - 1)))
        )

    def _batch_metrics(self, batch: TrainBatch, completion_mask) -> dict[str, float]:
        """The batch's advantages and token counts. Rewards and completion lengths are the
        run's (``reward/*``, ``completion_len/mean``, from the same groups): one name each."""
        a = np.asarray(batch.advantages, np.float64)
        lengths = completion_mask.sum(-1)
        out = {
            "advantage_mean": a.mean(), "advantage_std": a.std(),
            "advantage_min": a.min(), "advantage_max": a.max(),
            "tokens": float(lengths.sum()),
            "sequences": float(len(a)),
        }
        return {k: float(v) for k, v in out.items()}

    # ------------------------------------------------------------------ state access

    def policy_params(self) -> Params:
        """The policy's full parameters on the trainer's mesh: `params` itself, or with LoRA
        the base with the adapters merged (`splitrl.models.lora.merge`: what samplers serve
        after an adapter push, bitwise)."""
        if self.lora is None:
            return self.params
        assert self.base_params is not None  # set with lora
        return lora_lib.merge(self.base_params, self.params, self.lora)

    def model(self) -> CausalLM:
        """The current policy as an nnx model (with LoRA: adapters merged into the weights)."""
        return nnx.merge(self._graphdef, state_from_hf(self.config, self.policy_params()))

    def state_bytes(self) -> dict[str, int]:
        """Bytes of the arrays the learner keeps alive, by role (global sizes, all shards)."""

        def nbytes(tree) -> int:
            return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree)
                       if hasattr(x, "dtype"))

        return {"trained_params": nbytes(self.params), "frozen_params": nbytes(self.base_params),
                "reference_params": nbytes(self.ref_params), "opt_state": nbytes(self.opt_state)}

    def checkpoint_meta(self) -> dict[str, Any]:
        """What a checkpoint's train state was made with (checked on restore)."""
        if self.lora is None:
            return {"lora": None}
        return {"lora": {"rank": self.lora.rank, "alpha": self.lora.alpha,
                         "targets": list(self.lora.targets),
                         "base_fingerprint": self.base_fingerprint}}

    def check_checkpoint_meta(self, meta: dict[str, Any] | None, where: str = "checkpoint"
                              ) -> None:
        """ValueError unless a checkpoint saved with `meta` (`checkpoint_meta()`; None: saved
        with no learner meta, i.e. without LoRA) holds this learner's kind of train state."""
        saved = (meta or {}).get("lora")
        mine = self.checkpoint_meta()["lora"]
        if saved is None and mine is None:
            return
        if saved is None or mine is None:
            have = "without LoRA" if saved is None else f"with LoRA rank {saved['rank']}"
            now = "model.lora is unset" if mine is None else f"model.lora has rank {mine['rank']}"
            raise ValueError(f"{where} was saved {have}, but {now}: its train state does not "
                             "fit; resume with the run's model.lora, or start a new run_dir")
        for key in ("rank", "alpha", "targets"):
            if saved[key] != mine[key]:
                raise ValueError(f"{where} was saved with LoRA {key} {saved[key]!r}, but "
                                 f"model.lora gives {mine[key]!r}; resume with the run's "
                                 "model.lora, or start a new run_dir")
        if saved.get("base_fingerprint") != mine["base_fingerprint"]:
            raise ValueError(f"{where} holds adapters trained on the base checkpoint "
                             f"{saved.get('base_fingerprint')}, but model.path now holds "
                             f"{mine['base_fingerprint']}: the adapters would apply to other "
                             "weights; point model.path at the run's base checkpoint")

    def logprobs(self, batch: TrainBatch) -> np.ndarray:
        """The current policy's logprobs [B, T] of batch.tokens (0 at position 0), under the
        training temperature: what a sampler with the same weights reports."""
        rows = self._batch_sharding(batch.tokens.shape[0])(2)
        mb = {"tokens": jax.device_put(np.asarray(batch.tokens, np.int32), rows),
              "attention_mask": jax.device_put(np.asarray(batch.attention_mask, bool), rows)}
        with self._on_mesh():
            lp = np.asarray(forward(self._spec, self.base_params, self.params, mb)[0])
        return np.concatenate([np.zeros((lp.shape[0], 1), lp.dtype), lp], axis=1)

    def train_state(self) -> dict[str, Any]:
        """What a checkpoint must hold to continue exactly: params and optimizer state."""
        return {"params": self.params, "opt_state": self.opt_state}

    def abstract_train_state(self) -> dict[str, Any]:
        """`train_state()` as ShapeDtypeStructs carrying this learner's shardings."""
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
            self.train_state(),
        )

    def load_train_state(self, state: dict[str, Any], version: int) -> None:
        """Adopt a restored `train_state()` (already on this mesh) and the version its params
        are (the checkpoint's weight version: updates applied, not steps run)."""
        self.params = jax.device_put(state["params"], self.param_shardings)
        self.opt_state = jax.device_put(state["opt_state"], self._opt_shardings)
        self.version = int(version)


def _placeholder(mb: dict[str, jax.Array]) -> jax.Array:
    """The first epoch's pi_old argument (unused: that epoch's own logprobs are pi_old), laid
    out as the micro-batch's logprobs; made on the host, so no program compiles for it."""
    sampler = mb["sampler_logprobs"]
    return jax.device_put(np.zeros((sampler.shape[0], sampler.shape[1] - 1), np.float32),
                          sampler.sharding)


def _combine(parts: list[dict[str, jax.Array]]) -> dict[str, float]:
    """Micro-batch metrics -> batch metrics: sums (they are globally normalised), min / max."""
    host = jax.device_get(parts)
    out = {}
    for key in host[0]:
        values = [float(p[key]) for p in host]
        if key.endswith("_min"):
            out[key] = min(values)
        elif key.endswith("_max"):
            out[key] = max(values)
        else:
            out[key] = sum(values)
    return out


def _mean_over_epochs(epochs: list[dict[str, Any]]) -> dict[str, float]:
    keys = epochs[0].keys()
    return {k: float(np.mean([float(e[k]) for e in epochs])) for k in keys}
