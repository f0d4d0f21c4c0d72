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
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from splitrl.config import AlgorithmConfig, OptimizerConfig
from splitrl.mesh import DATA_AXIS, FSDP_AXIS, param_shardings
from splitrl.models import (
    CausalLM,
    abstract_model,
    hf_from_state,
    left_pad_positions,
    state_from_hf,
    token_logprobs,
)
from trainer_service.learning import losses
from trainer_service.learning.optim import make_optimizer

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
    """Owns the policy parameters, the optimizer state and (iff beta > 0) frozen reference
    parameters, all on `mesh`; `train_step` runs one GRPO/GSPO update."""

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
    ):
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 for training logprobs, got {temperature}")
        self.algorithm = algorithm
        self.mesh = mesh
        self.config = model.config
        self.dtype = model.dtype
        self.micro_batch_size = micro_batch_size
        self.epochs = epochs_per_batch
        self.temperature = temperature
        self.chunk_size = logprob_chunk_size
        self.loss_settings = losses.loss_settings(algorithm, generation_budget)
        self.tx, self.schedule = make_optimizer(optimizer, updates_per_step=epochs_per_batch)
        self.step = 0  # train steps done

        self._graphdef = nnx.split(abstract_model(self.config, self.dtype))[0]
        flat = hf_from_state(nnx.state(model, nnx.Param))
        self.param_shardings = param_shardings(mesh, flat, strategy)
        self.params: Params = jax.device_put(flat, self.param_shardings)
        # Reference policy for the KL term: kept only when it is used (beta > 0).
        self.ref_params: Params | None = None
        if algorithm.beta > 0:
            source = flat if reference is None else hf_from_state(nnx.state(reference, nnx.Param))
            self.ref_params = jax.device_put(
                jax.tree.map(jnp.array, source), self.param_shardings  # a copy, never updated
            )

        self._opt_shardings = self._optimizer_shardings()
        self.opt_state = jax.device_put(self.tx.init(self.params), self._opt_shardings)
        # Hashable static descriptions: learners with equal settings share compiled steps.
        self._spec = _ForwardSpec(self._graphdef, self.config, logprob_chunk_size, temperature)
        self._settings = tuple(sorted(self.loss_settings.items()))

    @classmethod
    def from_config(cls, model: CausalLM, cfg, mesh: Mesh) -> Learner:
        """A learner for a whole run's `splitrl.config.Config` on the trainer's `mesh`."""
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
        for _ in range(self.epochs):
            lr = float(self.schedule(self._updates()))
            grads, old, loss_metrics = self._accumulate_gradients(micro_batches, old, ref, counts)
            self.params, self.opt_state, grad_norm = _apply_update(
                self.tx, self.params, self.opt_state, grads
            )
            per_epoch.append({**loss_metrics, "grad_norm": float(grad_norm), "lr": lr})
        self.step += 1
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
        mb = self._micro_batches(empty, empty.completion_mask)[0]
        counts = {"num_tokens": 1.0, "num_sequences": 1.0}
        grads, _, metrics = _grad_step(
            self._spec, self._settings, _zeros_like(self.params), self.params, mb,
            jnp.zeros_like(mb["sampler_logprobs"][:, 1:]), True, self._reference_logprobs(mb),
            counts)
        jax.block_until_ready(metrics)
        # The update donates params and optimizer state: compiled, not run.
        _apply_update.lower(self.tx, self.params, self.opt_state, grads).compile()

    def _accumulate_gradients(self, micro_batches, old, ref, counts):
        """Sum of the micro-batch gradients (= the full batch's), the logprobs to use as pi_old
        in later epochs, and the batch's loss metrics."""
        grads, parts = _zeros_like(self.params), []
        first_epoch = old is None
        old = [None] * len(micro_batches) if first_epoch else old
        for i, mb in enumerate(micro_batches):
            placeholder = jnp.zeros_like(mb["sampler_logprobs"][:, 1:])
            grads, logp, m = _grad_step(
                self._spec, self._settings, grads, self.params, mb,
                placeholder if first_epoch else old[i], first_epoch, ref[i], counts,
            )
            old[i] = logp if first_epoch else old[i]
            parts.append(m)
        return grads, old, _combine(parts)

    # ------------------------------------------------------------------ helpers

    def _updates(self) -> int:
        """Optimizer updates done so far (the schedule's clock)."""
        return self.step * self.epochs

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

    def _reference_logprobs(self, mb):
        if self.ref_params is None:
            return None
        return _forward(self._spec, self.ref_params, mb)[0]

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
        a = np.asarray(batch.advantages, np.float64)
        lengths = completion_mask.sum(-1)
        out = {
            "advantage_mean": a.mean(), "advantage_std": a.std(),
            "advantage_min": a.min(), "advantage_max": a.max(),
            "tokens": float(lengths.sum()),
            "sequences": float(len(a)),
            "completion_length_mean": float(lengths.mean()),
        }
        if batch.rewards is not None:
            r = np.asarray(batch.rewards, np.float64)
            out.update(reward_mean=r.mean(), reward_std=r.std(), reward_min=r.min(),
                       reward_max=r.max())
        return {k: float(v) for k, v in out.items()}

    # ------------------------------------------------------------------ state access

    def model(self) -> CausalLM:
        """The current policy as an nnx model (shares the learner's arrays)."""
        return nnx.merge(self._graphdef, state_from_hf(self.config, self.params))

    def logprobs(self, batch: TrainBatch) -> np.ndarray:
        """The current policy's logprobs [B, T] of batch.tokens (0 at position 0), under the
        training temperature: what a sampler with the same weights reports."""
        rows = self._batch_sharding(batch.tokens.shape[0])(2)
        mb = {"tokens": jax.device_put(np.asarray(batch.tokens, np.int32), rows),
              "attention_mask": jax.device_put(np.asarray(batch.attention_mask, bool), rows)}
        lp = np.asarray(_forward(self._spec, self.params, mb)[0])
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

    def load_train_state(self, state: dict[str, Any], step: int) -> None:
        """Adopt a restored `train_state()` (already on this mesh) and step counter."""
        self.params = jax.device_put(state["params"], self.param_shardings)
        self.opt_state = jax.device_put(state["opt_state"], self._opt_shardings)
        self.step = int(step)


class _ForwardSpec(NamedTuple):
    graphdef: Any
    config: Any  # TransformerConfig
    chunk_size: int
    temperature: float


@functools.partial(jax.jit, static_argnums=0)
def _forward(spec: _ForwardSpec, params: Params, mb: dict[str, jax.Array]):
    """(logprobs, entropy) [b, T-1] of tokens[:, 1:] given their prefixes (chunked)."""
    model = nnx.merge(spec.graphdef, state_from_hf(spec.config, params))
    tokens, mask = mb["tokens"], mb["attention_mask"]
    positions = left_pad_positions(mask)
    return token_logprobs(
        model, tokens[:, :-1], tokens[:, 1:], positions[:, :-1], mask[:, :-1],
        chunk_size=spec.chunk_size, temperature=spec.temperature,
    )


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=2)
def _grad_step(spec, settings, grads_acc, params, mb, old, first_epoch, ref, counts):
    """grads_acc + d(loss)/d(params) on one micro-batch; also its logprobs and metrics."""

    def loss_fn(p):
        logp, entropy = _forward(spec, p, mb)
        old_logp = jnp.where(first_epoch, jax.lax.stop_gradient(logp), old)
        loss, metrics = losses.compute_loss(
            logp, old_logp, mb["advantages"], mb["completion_mask"][:, 1:], **dict(settings),
            ref=ref, sampler=mb["sampler_logprobs"][:, 1:], entropy=entropy,
            num_tokens=counts["num_tokens"], num_sequences=counts["num_sequences"],
        )
        return loss, (jax.lax.stop_gradient(logp), metrics)

    (_, (logp, metrics)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return jax.tree.map(jnp.add, grads_acc, grads), logp, metrics


@functools.partial(jax.jit, static_argnums=0, donate_argnums=(1, 2))
def _apply_update(tx, params, opt_state, grads):
    """One optax update; returns the new params and state and the pre-clip gradient norm."""
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, optax.tree.norm(grads)


_zeros_like = jax.jit(lambda tree: jax.tree.map(jnp.zeros_like, tree))


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
