"""Building blocks: RMSNorm, Linear, grouped-query attention (pluggable backend), SwiGLU MLP.

Parameter layout convention: every parameter lives under the attribute names HF uses, so
the nnx path of a parameter *is* its HF name (`model.layers.3.self_attn.q_proj.weight`), which
is what checkpoints, partition rules (`splitrl.mesh`) and the wire use. Shapes follow flax:
Linear weights are [in_features, out_features] (the transpose of torch's [out, in]; `hf_io`
transposes on load/save), so `lm_head.weight` is [hidden, vocab]; the embedding table stays
[vocab, hidden] and RMSNorm weights and biases are 1-D, as in HF. Column-parallel projections
(q/k/v/gate/up) therefore split their last dim for tensor parallelism, row-parallel ones
(o/down) their first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from splitrl.models.config import TransformerConfig
from splitrl.models.rope import apply_rope


class RMSNorm(nnx.Module):
    """y = weight * x / rms(x), normalised in float32 like HF (weight initialised to ones)."""

    def __init__(self, dim: int, eps: float, *, dtype, param_dtype):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        y = (x32 * jax.lax.rsqrt(var + self.eps)).astype(self.dtype)
        return self.weight[...].astype(self.dtype) * y


class LoraFactor(nnx.Module):
    """One factor of a LoRA adapter (``lora_A`` [in, r] or ``lora_B`` [r, out]): x @ weight."""

    def __init__(self, weight: jax.Array):
        self.weight = nnx.Param(weight)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.einsum("...i,io->...o", x, self.weight[...].astype(x.dtype))


class LoraKey(nnx.Variable):
    """The PRNG key of one adapter's input dropout (set only for training forwards)."""


class Linear(nnx.Module):
    """Dense layer y = x @ weight (+ bias), weight [in, out] (see module docstring).

    With a LoRA adapter attached (``splitrl.models.lora.attach`` sets ``lora_A``, ``lora_B``,
    ``lora_scale`` and, for training with dropout, ``lora_dropout`` / ``lora_key``):
    y = x @ weight + lora_scale * dropout(x) @ lora_A @ lora_B, as PEFT computes it.
    """

    lora_A: LoraFactor | None = None
    lora_B: LoraFactor | None = None
    lora_scale: float = 0.0
    lora_dropout: float = 0.0
    lora_key: LoraKey | None = None

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype, param_dtype,
                 rngs: nnx.Rngs, std: float):
        w = std * jax.random.normal(rngs.params(), (in_features, out_features), jnp.float32)
        self.weight = nnx.Param(w.astype(param_dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype)) if bias else None
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.astype(self.dtype)
        y = jnp.einsum("...i,io->...o", x, self.weight[...].astype(self.dtype))
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        if self.lora_A is not None:
            assert self.lora_B is not None, "lora.attach sets lora_A and lora_B together"
            h = x
            if self.lora_key is not None:
                keep = jax.random.bernoulli(self.lora_key[...], 1.0 - self.lora_dropout, x.shape)
                h = jnp.where(keep, x / (1.0 - self.lora_dropout), 0).astype(x.dtype)
            y = y + self.lora_scale * self.lora_B(self.lora_A(h))
        return y

    def effective_weight(self) -> jax.Array:
        """weight (+ lora_scale * lora_A @ lora_B with an adapter), for callers that read the
        weight instead of calling the layer (the chunked log-prob path reads the LM head)."""
        if self.lora_A is None:
            return self.weight[...]
        assert self.lora_B is not None, "lora.attach sets lora_A and lora_B together"
        w = self.weight[...]
        delta = self.lora_A.weight[...].astype(w.dtype) @ self.lora_B.weight[...].astype(w.dtype)
        return w + self.lora_scale * delta


class Embedding(nnx.Module):
    """Token embedding table [vocab, hidden]; also the output projection when tied."""

    def __init__(self, vocab: int, dim: int, *, dtype, param_dtype, rngs: nnx.Rngs, std: float):
        w = std * jax.random.normal(rngs.params(), (vocab, dim), jnp.float32)
        self.weight = nnx.Param(w.astype(param_dtype))
        self.dtype = dtype

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], tokens, axis=0).astype(self.dtype)


class Attention(nnx.Module):
    """Grouped-query self-attention projections with optional per-head q/k RMSNorm (Qwen3).

    The attention itself (which keys each query sees, where keys/values are cached) is the
    backend passed in (`attention.py`): one projection/RoPE code path for every cache layout.
    """

    def __init__(self, config: TransformerConfig, *, dtype, param_dtype, rngs: nnx.Rngs,
                 std: float):
        c = config
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs, std=std)
        self.q_proj = Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.attention_bias, **kw)
        self.k_proj = Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias,
                             **kw)
        self.v_proj = Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias,
                             **kw)
        self.o_proj = Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.attention_out_bias,
                             **kw)
        self.q_norm: RMSNorm | None
        self.k_norm: RMSNorm | None
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
        else:
            self.q_norm = self.k_norm = None
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.dtype = dtype

    def __call__(self, x, cos, sin, attention, layer: int):
        """x [B,T,D]; cos/sin [B,T,Dh/2]; ``attention`` an `AttentionBackend` (see
        `attention.py`) that turns this layer's post-RoPE q/k/v into its output and keeps
        keys/values where its cache layout wants them. Returns (out [B,T,D], backend)."""
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # both or neither (qk_norm)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out, attention = attention.attend(layer, q, k, v)
        return self.o_proj(out.reshape(b, t, self.num_heads * self.head_dim)), attention


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: TransformerConfig, *, dtype, param_dtype, rngs: nnx.Rngs,
                 std: float):
        kw = dict(bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs, std=std)
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = Linear(d, f, **kw)
        self.up_proj = Linear(d, f, **kw)
        self.down_proj = Linear(f, d, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: TransformerConfig, *, dtype, param_dtype, rngs: nnx.Rngs,
                 std: float):
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, **kw)
        self.self_attn = Attention(config, **kw, rngs=rngs, std=std)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, **kw)
        self.mlp = MLP(config, **kw, rngs=rngs, std=std)

    def __call__(self, x, cos, sin, attention, layer: int):
        attn, attention = self.self_attn(self.input_layernorm(x), cos, sin, attention, layer)
        x = x + attn
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, attention
