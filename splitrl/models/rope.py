"""Rotary position embeddings, matching Hugging Face's (rotate-half layout, llama3 scaling).

HF rotates pairs (i, i + head_dim/2), not interleaved pairs (2i, 2i+1); checkpoints' q/k
weights are permuted for that layout, so we must use it too. The inverse frequencies are
compile-time constants computed in numpy from the config, so they never appear in the
parameter state that trainer and sampler exchange.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from splitrl.models.config import RopeScaling, TransformerConfig


def inv_frequencies(config: TransformerConfig) -> np.ndarray:
    """Inverse frequencies [head_dim // 2] float32, with llama3 scaling applied if configured."""
    dim = config.head_dim
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    inv_freq = (1.0 / (np.float32(config.rope_theta) ** exponents)).astype(np.float32)
    if config.rope_scaling is not None:
        inv_freq = _llama3_scale(inv_freq, config.rope_scaling)
    return inv_freq.astype(np.float32)


def _llama3_scale(inv_freq: np.ndarray, s: RopeScaling) -> np.ndarray:
    """Llama 3.1 scaling: long wavelengths divided by `factor`, short ones kept, smooth between.

    Same piecewise rule as Meta's reference and HF `_compute_llama3_parameters`.
    """
    old_len = s.original_max_position_embeddings
    low_freq_wavelen = old_len / s.low_freq_factor
    high_freq_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def rope_tables(inv_freq: np.ndarray, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(cos, sin), each [B, T, head_dim // 2] float32, for integer positions [B, T]."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates x [B, T, heads, head_dim] by the tables from `rope_tables` (math in float32)."""
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return out.astype(x.dtype)
