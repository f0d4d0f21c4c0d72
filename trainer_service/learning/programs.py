"""The learner's jitted programs: the policy's forward (token logprobs and entropy), one
micro-batch's loss gradient accumulated into a running sum, and the optax update. Pure
functions of their arguments; `Learner` (learner.py) owns the state they are called with and
when, and `splitrl plan` lowers the same programs (`Learner.lower_train_step`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from splitrl.models import left_pad_positions, state_from_hf, token_logprobs
from splitrl.models import lora as lora_lib
from splitrl.models.lora import LoraSpec
from trainer_service.learning import losses

Params = dict[str, jax.Array]


class ForwardSpec(NamedTuple):
    graphdef: Any
    config: Any  # TransformerConfig
    chunk_size: int
    temperature: float
    lora: LoraSpec | None = None


def policy(spec: ForwardSpec, base: Params | None, params: Params, dropout_key=None):
    """The policy model inside a jit: `params` merged into the graph, or with LoRA the base
    with `params` (the adapters) attached to its targeted Linear modules."""
    if spec.lora is None:
        return nnx.merge(spec.graphdef, state_from_hf(spec.config, params))
    assert base is not None  # the frozen base of a LoRA policy
    model = nnx.merge(spec.graphdef, state_from_hf(spec.config, base))
    return lora_lib.attach(model, spec.lora, params, dropout_key)


@functools.partial(jax.jit, static_argnums=0)
def forward(spec: ForwardSpec, base: Params | None, params: Params,
             mb: dict[str, jax.Array], dropout_key=None):
    """(logprobs, entropy) [b, T-1] of tokens[:, 1:] given their prefixes (chunked)."""
    model = policy(spec, base, params, dropout_key)
    tokens, mask = mb["tokens"], mb["attention_mask"]
    positions = left_pad_positions(mask)
    return token_logprobs(
        model, tokens[:, :-1], tokens[:, 1:], positions[:, :-1], mask[:, :-1],
        chunk_size=spec.chunk_size, temperature=spec.temperature,
    )


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=3)
def grad_step(spec, settings, layout, grads_acc, base, params, mb, old, first_epoch, ref,
               counts, dropout_key):
    """grads_acc + d(loss)/d(params) on one micro-batch, laid out as the parameters (``layout``);
    also its logprobs and metrics."""

    def loss_fn(p):
        logp, entropy = forward(spec, base, p, mb, dropout_key)
        old_logp = jnp.where(first_epoch, jax.lax.stop_gradient(logp), old)
        loss, metrics = losses.compute_loss(
            logp, old_logp, mb["advantages"], mb["completion_mask"][:, 1:], **dict(settings),
            ref=ref, sampler=mb["sampler_logprobs"][:, 1:], entropy=entropy,
            num_tokens=counts["num_tokens"], num_sequences=counts["num_sequences"],
        )
        return loss, (jax.lax.stop_gradient(logp), metrics)

    (_, (logp, metrics)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    summed = jax.lax.with_sharding_constraint(jax.tree.map(jnp.add, grads_acc, grads),
                                              layout.tree())
    return summed, logp, metrics


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(3, 4))
def apply_update(tx, layout, opt_layout, params, opt_state, grads):
    """One optax update; returns the new params and state, laid out as before (``layout``,
    ``opt_layout``), and the pre-clip gradient norm."""
    updates, opt_state = tx.update(grads, opt_state, params)
    params = jax.lax.with_sharding_constraint(optax.apply_updates(params, updates),
                                              layout.tree())
    opt_state = jax.lax.with_sharding_constraint(opt_state, opt_layout.tree())
    return params, opt_state, optax.tree.norm(grads)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A pytree's shardings as a static (hashable) argument. The jitted steps pin their outputs
    to it: left to XLA, an output's sharding can differ from its input's (``P(None, None)`` in,
    ``P(None, 'fsdp')`` out), and the next call with it compiles the program again."""

    treedef: Any
    leaves: tuple

    @classmethod
    def of(cls, shardings) -> Layout:
        leaves, treedef = jax.tree.flatten(shardings)
        return cls(treedef, tuple(leaves))

    def tree(self):
        return jax.tree.unflatten(self.treedef, self.leaves)
