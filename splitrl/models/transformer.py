"""`CausalLM`: the decoder-only LM (Llama 3 / Qwen2 / Qwen3) as a flax.nnx module.

The module tree mirrors HF's `XForCausalLM` (`model.embed_tokens`, `model.layers.N...`,
`model.norm`, `lm_head`), so parameter paths are the HF names (see `layers.py`).

Calling convention (shared by trainer and sampler):

    logits, new_cache = model(tokens, positions, attention_mask=..., cache=..., cache_index=...)

Without a cache, attention is causal over the T given tokens plus a key-padding mask. With a
cache (see `cache.py`) the tokens are written at slots [cache_index, cache_index + T) and each
query attends to the valid cache slots at or before its own slot. Both are attention backends
(`attention.py`); `forward_with` takes any other, e.g. a generation engine's own cache layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from splitrl.models.attention import (
    AttentionBackend,
    DenseAttention,
    KVCacheAttention,
    causal_mask,
)
from splitrl.models.config import TransformerConfig
from splitrl.models.layers import DecoderLayer, Embedding, Linear, RMSNorm
from splitrl.models.rope import inv_frequencies, rope_tables


class Decoder(nnx.Module):
    """The HF `model.` prefix: embeddings, decoder layers and the final norm."""

    def __init__(self, config: TransformerConfig, *, dtype, param_dtype, rngs, std):
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, **kw, rngs=rngs,
                                      std=std)
        self.layers = nnx.List([DecoderLayer(config, **kw, rngs=rngs, std=std)
                                for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)


class CausalLM(nnx.Module):
    """Causal LM with HF-named parameters (Linear weights [in, out]); `dtype` is the compute dtype.

    Parameters are stored in `param_dtype`; activations are computed in `dtype`; attention
    softmax, norms, RoPE and the logits are float32. `remat=True` recomputes each decoder
    layer in the backward pass (cache-less calls only): activation memory of one layer
    instead of all, for training on long sequences.
    """

    def __init__(self, config: TransformerConfig, *, dtype=jnp.float32, param_dtype=None,
                 rngs: nnx.Rngs, std: float = 0.02, remat: bool = False):
        param_dtype = dtype if param_dtype is None else param_dtype
        self.config = config
        self.dtype = dtype
        self.remat = remat
        self.model = Decoder(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs, std=std)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype,
                                  param_dtype=param_dtype, rngs=rngs, std=std)

    def __call__(self, tokens, positions=None, *, attention_mask=None, cache=None,
                 cache_index=None):
        """tokens/positions [B,T] int32, attention_mask [B,T] bool (True = real token).

        Returns (logits [B,T,V] float32, new KVCache or None).
        """
        h, new_cache = self.forward_hidden(tokens, positions, attention_mask=attention_mask,
                                           cache=cache, cache_index=cache_index)
        return self.logits(h), new_cache

    def hidden_states(self, tokens, positions=None, *, attention_mask=None):
        """Final-normed hidden states [B,T,D] (no cache), e.g. for chunked log-probs."""
        return self.forward_hidden(tokens, positions, attention_mask=attention_mask)[0]

    def output_weight(self) -> tuple[jax.Array, int]:
        """(w, vocab_axis): the embedding [V, D] (axis 0) when tied, else lm_head [D, V] (1)."""
        if self.lm_head is None:
            return self.model.embed_tokens.weight[...], 0
        return self.lm_head.effective_weight(), 1

    def logits(self, h: jax.Array) -> jax.Array:
        """Logits [..., V] in float32 from hidden states [..., D]."""
        w, vocab_axis = self.output_weight()
        spec = "...d,vd->...v" if vocab_axis == 0 else "...d,dv->...v"
        return jnp.einsum(spec, h.astype(self.dtype), w.astype(self.dtype),
                          preferred_element_type=jnp.float32)

    def forward_hidden(self, tokens, positions=None, *, attention_mask=None, cache=None,
                       cache_index=None):
        """Everything but the output projection; returns (hidden [B,T,D], new cache or None)."""
        b, t = tokens.shape
        offset = 0
        if cache is not None:
            if cache_index is None:
                raise ValueError("cache_index is required when a cache is given")
            offset = jnp.asarray(cache_index, jnp.int32)
        if positions is None:
            positions = jnp.broadcast_to(offset + jnp.arange(t, dtype=jnp.int32), (b, t))
        valid = (jnp.ones((b, t), bool) if attention_mask is None
                 else attention_mask.astype(bool))
        query_slot = offset + jnp.arange(t)
        if cache is None:
            backend = DenseAttention(causal_mask(query_slot, jnp.arange(t), valid))
        else:
            key_valid = jax.lax.dynamic_update_slice(cache.mask, valid, (0, offset))
            mask = causal_mask(query_slot, jnp.arange(cache.mask.shape[1]), key_valid)
            backend = KVCacheAttention(cache._replace(mask=key_valid), offset, mask)
        h, backend = self.forward_with(tokens, positions, backend)
        return h, (None if cache is None else backend.cache)

    def forward_with(self, tokens, positions, attention: AttentionBackend):
        """The forward with a caller's attention backend (see `attention.py`): embeddings, every
        decoder layer (attending through ``attention``) and the final norm.

        tokens/positions [B,T] int32 (RoPE positions). Returns (hidden [B,T,D], the backend
        after the last layer). A generation engine passes its own cache layout here, so the
        model's forward exists once for training, prefill and decode.
        """
        cos, sin = rope_tables(inv_frequencies(self.config), positions)
        x = self.model.embed_tokens(tokens)
        for i, layer in enumerate(self.model.layers):
            if self.remat and isinstance(attention, DenseAttention) and not attention.keep_kv:
                x = _remat_layer(layer, x, cos, sin, attention, i)
                continue
            x, attention = layer(x, cos, sin, attention, i)
        return self.model.norm(x), attention


def _remat_layer(layer, x, cos, sin, attention, index):
    """layer(x) under `jax.checkpoint`, as a pure function of the layer's state."""
    graphdef, state = nnx.split(layer)

    @jax.checkpoint
    def run(state, x, cos, sin, attention):
        return nnx.merge(graphdef, state)(x, cos, sin, attention, index)[0]

    return run(state, x, cos, sin, attention)


def init_random(config: TransformerConfig, seed: int = 0, dtype=jnp.float32, *,
                param_dtype=None, std: float = 0.02) -> CausalLM:
    """A randomly initialised model (normal(0, std) matrices, zero biases, unit norms).

    Draws with numpy's generator on the host (deterministic in `seed`): XLA:CPU compiles
    threefry slowly (about a second per distinct tensor shape), which dominated small runs.
    """
    param_dtype = dtype if param_dtype is None else param_dtype
    graphdef, abstract = nnx.split(abstract_model(config, dtype, param_dtype=param_dtype))
    rng = np.random.default_rng(seed)
    leaves = []
    for path, var in nnx.to_flat_state(abstract):
        shape = var.get_value().shape
        if path[-1] == "bias":
            value = np.zeros(shape, np.float32)
        elif len(shape) == 1:
            value = np.ones(shape, np.float32)
        else:
            value = std * rng.standard_normal(shape, dtype=np.float32)
        leaves.append((path, var.replace(jnp.asarray(value, param_dtype))))
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))


def abstract_model(config: TransformerConfig, dtype=jnp.float32, *, param_dtype=None,
                   remat: bool = False) -> CausalLM:
    """The model with ShapeDtypeStruct leaves (no memory), for its graphdef and shapes."""
    return nnx.eval_shape(lambda: CausalLM(config, dtype=dtype, param_dtype=param_dtype,
                                           rngs=nnx.Rngs(0), remat=remat))


def apply(graphdef, state, tokens, positions=None, *, attention_mask=None, cache=None,
          cache_index=None):
    """Pure forward: `nnx.merge(graphdef, state)(...)`, for a cheap `jax.jit` hot loop.

        graphdef, state = nnx.split(model)
        step = jax.jit(apply, static_argnums=0, donate_argnames="cache")
        logits, cache = step(graphdef, state, tok, pos, cache=cache, cache_index=i)
    """
    model = nnx.merge(graphdef, state)
    return model(tokens, positions, attention_mask=attention_mask, cache=cache,
                 cache_index=cache_index)
