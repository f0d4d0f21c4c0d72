"""`CausalLM`: the decoder-only LM (Llama 3 / Qwen2 / Qwen3) as a flax.nnx module.

The module tree mirrors HF's `XForCausalLM` (`model.embed_tokens`, `model.layers`,
`model.norm`, `lm_head`), so parameter paths are the HF names (see `layers.py`), except that
the decoder layers are ONE `DecoderLayer` whose parameters are stacked on a leading layer
axis (`model.layers.self_attn.q_proj.weight` [L, in, out], see `stacking.py`) and applied by
`jax.lax.scan`: every program (train step, prefill, decode) traces and compiles one layer body,
so compile time and program size do not grow with depth (MaxText's ``scan_layers``). The
layers can run unrolled instead (`LAYER_LOOPS`), as the trainer's and the sampler's programs
do on CPU, where a scan copies each layer's weights out of the stack before its matmuls: over
static slices of the stacked weights (``layer_loop="unrolled"``), or over weights held per
layer (`forward_with`'s ``layers``).

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
    ATTENTION_IMPLEMENTATIONS,
    AttentionBackend,
    DenseAttention,
    KVCacheAttention,
    causal_mask,
)
from splitrl.models.config import TransformerConfig
from splitrl.models.layers import DecoderLayer, Embedding, Linear, RMSNorm
from splitrl.models.rope import inv_frequencies, rope_tables

# `model.remat`: what the backward pass of a train step keeps of each decoder layer.
REMAT_POLICIES = {
    # everything (no recomputation): the most memory, the fastest backward
    "none": None,
    # only each layer's input (the scan carry); the layer is recomputed in the backward pass
    "full": jax.checkpoint_policies.nothing_saveable,
    # the layer's matmul outputs (projections, MLP), recomputing only the cheap elementwise ops
    # and attention's batched score products in between
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}

# How a forward applies the decoder layers when it is not given weights held per layer.
# "scan": a `lax.scan` over the stacked weights, one layer body whatever the depth (compile
# time and program size flat in depth: TPU and GPU). "unrolled": one layer after the other
# over static slices of the stacked weights. XLA:CPU's matmul kernels take whole buffers, so
# in a scan each layer's weights are copied out of the stack before every matmul that reads
# them, forward and backward, and the backward pass stacks the layers' saved activations and
# gradients into loop buffers and slices them out again; unrolled, a layer's weights are
# sliced once per program, nothing is stacked but the gradients (one concatenation each), and
# the train step costs what it did before the scan (bench/README.md, issue 37). The price is a
# program that grows with depth (bench/compile_depth.py prints both).
LAYER_LOOPS = ("scan", "unrolled")


class Decoder(nnx.Module):
    """The HF `model.` prefix: embeddings, decoder layers and the final norm."""

    def __init__(self, config: TransformerConfig, *, dtype, param_dtype, rngs, std):
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, **kw, rngs=rngs,
                                      std=std)
        self.layers = _stacked_layers(config, kw, rngs, std)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)


class CausalLM(nnx.Module):
    """Causal LM with HF-named parameters (Linear weights [in, out]); `dtype` is the compute dtype.

    Parameters are stored in `param_dtype`; activations are computed in `dtype`; attention
    softmax, norms, RoPE and the logits are float32. `remat` names one of `REMAT_POLICIES`:
    what a backward pass keeps of each decoder layer (a forward-only program is unaffected).
    `attention` names one of `attention.ATTENTION_IMPLEMENTATIONS`: how attention over the
    given tokens runs (the splash kernel or XLA ops; cached decoding is unaffected).
    `layer_loop` names one of `LAYER_LOOPS`: a scan over the stacked layers or the layers
    unrolled (same values; see `LAYER_LOOPS` for when each is faster).
    """

    def __init__(self, config: TransformerConfig, *, dtype=jnp.float32, param_dtype=None,
                 rngs: nnx.Rngs, std: float = 0.02, remat: str = "none",
                 attention: str = "auto", layer_loop: str = "scan"):
        if remat not in REMAT_POLICIES:
            raise ValueError(f"remat: expected one of {sorted(REMAT_POLICIES)}, got {remat!r}")
        if layer_loop not in LAYER_LOOPS:
            raise ValueError(f"layer_loop: expected one of {LAYER_LOOPS}, got {layer_loop!r}")
        if attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"attention: expected one of {ATTENTION_IMPLEMENTATIONS}, got "
                             f"{attention!r}")
        param_dtype = dtype if param_dtype is None else param_dtype
        self.config = config
        self.dtype = dtype
        self.remat = remat
        self.attention = attention
        self.layer_loop = layer_loop
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
            # Segments: real tokens 1, padding 0 (the splash kernel's form of the same mask).
            backend = DenseAttention(causal_mask(query_slot, jnp.arange(t), valid),
                                     segments=valid.astype(jnp.int32),
                                     implementation=self.attention)
        else:
            key_valid = jax.lax.dynamic_update_slice(cache.mask, valid, (0, offset))
            mask = causal_mask(query_slot, jnp.arange(cache.mask.shape[1]), key_valid)
            backend = KVCacheAttention(cache._replace(mask=key_valid), offset, mask)
        h, backend = self.forward_with(tokens, positions, backend)
        return h, (None if cache is None else backend.cache)

    def forward_with(self, tokens, positions, attention: AttentionBackend, *,
                     layers: list | None = None):
        """The forward with a caller's attention backend (see `attention.py`): embeddings, every
        decoder layer (attending through ``attention``) and the final norm.

        tokens/positions [B,T] int32 (RoPE positions). Returns (hidden [B,T,D], the backend
        after the last layer). A generation engine passes its own cache layout here, so the
        model's forward exists once for training, prefill and decode.

        ``layers`` (one state per layer, as `stacking.layer_views` makes them) runs the layers
        one after the other, unrolled, each with its own weights, instead of the model's
        `layer_loop` over its own stacked layers (which are then not read). Unrolled,
        ``attention`` gets a Python int for the layer; scanned, a traced index. The `remat`
        policy applies to each layer either way.
        """
        cos, sin = rope_tables(inv_frequencies(self.config), positions)
        x = self.model.embed_tokens(tokens)
        graphdef, stacked = nnx.split(self.model.layers)
        policy = REMAT_POLICIES[self.remat]
        if layers is None and self.layer_loop == "unrolled":
            layers = [jax.tree.map(lambda w, i=i: w[i], stacked)
                      for i in range(self.config.num_layers)]
        if layers is not None:
            def layer(x, attention, layer_state, index):
                return nnx.merge(graphdef, layer_state)(x, cos, sin, attention, index)

            if policy is not None:
                layer = jax.checkpoint(layer, policy=policy, prevent_cse=False,
                                       static_argnums=(3,))
            for index, layer_state in enumerate(layers):
                x, attention = layer(x, attention, layer_state, index)
            return self.model.norm(x), attention

        def layer_step(carry, layer_state):
            x, attention, index = carry
            x, attention = nnx.merge(graphdef, layer_state)(x, cos, sin, attention, index)
            return (x, attention, index + 1), None

        if policy is not None:
            layer_step = jax.checkpoint(layer_step, policy=policy, prevent_cse=False)
        (x, attention, _), _ = jax.lax.scan(layer_step, (x, attention, jnp.int32(0)), stacked,
                                            unroll=_layer_unroll())
        return self.model.norm(x), attention


def _layer_unroll() -> bool | int:
    """The layer scan's ``unroll``: 1 (a loop, compile time flat in depth), except on several
    CPU devices, where the scan is unrolled whole (True).

    XLA:CPU's thunk executor can run a loop that holds collectives (the fsdp all-gathers of a
    layer's weights, a tensor-parallel all-reduce) concurrently with a collective outside it,
    in a different order on different devices; each device then waits in a rendezvous the
    others never reach, and the process aborts after 40 s. A trainer on fsdp=4 CPU devices hit
    it deterministically on one batch shape (tests/e2e/test_rewards_and_data.py, truncated
    long prompt). Unrolled, the collectives are all top-level and ordered. TPU and GPU keep
    the loop."""
    if jax.default_backend() == "cpu" and jax.device_count() > 1:
        return True
    return 1


def _stacked_layers(config: TransformerConfig, kw: dict, rngs: nnx.Rngs, std: float):
    """`config.num_layers` decoder layers as one `DecoderLayer` with stacked parameters (each
    layer initialised from its own split of `rngs`)."""

    def make(rngs):
        return DecoderLayer(config, **kw, rngs=rngs, std=std)

    return nnx.split_rngs(splits=config.num_layers)(nnx.vmap(make, in_axes=0, out_axes=0))(rngs)


def init_random(config: TransformerConfig, seed: int = 0, dtype=jnp.float32, *,
                param_dtype=None, std: float = 0.02) -> CausalLM:
    """A randomly initialised model (normal(0, std) matrices, zero biases, unit norms).

    Draws with numpy's generator on the host (deterministic in `seed`): XLA:CPU compiles
    threefry slowly (about a second per distinct tensor shape), which dominated small runs.
    Matrices are drawn in HF name order, layer by layer (`model.layers.0.*`, then
    `model.layers.1.*`, ...), so a seed gives the same weights at any layout.
    """
    param_dtype = dtype if param_dtype is None else param_dtype
    graphdef, abstract = nnx.split(abstract_model(config, dtype, param_dtype=param_dtype))
    rng = np.random.default_rng(seed)
    flat = list(nnx.to_flat_state(abstract))
    stacked = [i for i, (path, _) in enumerate(flat) if path[:2] == ("model", "layers")]
    values: dict[int, np.ndarray] = {}

    def draw(path, shape):
        if path[-1] == "bias":
            return np.zeros(shape, np.float32)
        if path[-2].endswith("norm"):
            return np.ones(shape, np.float32)
        return std * rng.standard_normal(shape, dtype=np.float32)

    for i, (path, var) in enumerate(flat):
        if i == (stacked[0] if stacked else None):  # every layer's tensors, layer after layer
            per_layer: dict[int, list[np.ndarray]] = {j: [] for j in stacked}
            for _ in range(config.num_layers):
                for j in stacked:
                    per_layer[j].append(draw(flat[j][0], flat[j][1].get_value().shape[1:]))
            values.update({j: np.stack(v) for j, v in per_layer.items()})
        if i not in values:
            values[i] = draw(path, var.get_value().shape)
    leaves = [(path, var.replace(jnp.asarray(values[i], param_dtype)))
              for i, (path, var) in enumerate(flat)]
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))


def abstract_model(config: TransformerConfig, dtype=jnp.float32, *, param_dtype=None,
                   remat: str = "none", attention: str = "auto",
                   layer_loop: str = "scan") -> CausalLM:
    """The model with ShapeDtypeStruct leaves (no memory), for its graphdef and shapes."""
    return nnx.eval_shape(lambda: CausalLM(config, dtype=dtype, param_dtype=param_dtype,
                                           rngs=nnx.Rngs(0), remat=remat,
                                           attention=attention, layer_loop=layer_loop))


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
