"""Tiny model configs and helpers shared by the model tests (transformers/torch as the oracle)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

VOCAB = 97  # prime, so no chunk size divides it

# name -> transformers config kwargs; together they cover llama3 rope scaling, q/k/v bias
# (Qwen2) and q/k/v/o bias (Llama attention_bias), qk-norm with head_dim != hidden / heads, tied
# and untied embeddings, GQA (incl. one kv head) and plain MHA.
HF_CONFIGS = {
    "llama3_gqa_untied": dict(
        model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
        tie_word_embeddings=False, max_position_embeddings=64, attention_bias=True,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=4.0,
                             low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=8)),
    "qwen2_bias_tied_mha": dict(
        model_type="qwen2", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-6,
        tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    "qwen3_qknorm_gqa_untied": dict(
        model_type="qwen3", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
}


def hf_config(name: str):
    import transformers

    kwargs = dict(HF_CONFIGS[name])
    return transformers.AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)


def hf_random_model(name: str, seed: int = 0):
    """A transformers model with every parameter random (norms and biases too), f32, eval."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(name)).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    return model


def randomize(model, seed: int = 0) -> None:
    """Makes norms and biases of a splitrl model random too (init gives ones and zeros)."""
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    new = [x + 0.3 * jax.random.normal(k, x.shape, x.dtype) if x.ndim == 1 else x
           for x, k in zip(leaves, keys, strict=True)]
    nnx.update(model, jax.tree.unflatten(treedef, new))


def hf_logits(hf_model, tokens, attention_mask=None, positions=None) -> np.ndarray:
    import torch

    kwargs = {}
    if attention_mask is not None:
        kwargs["attention_mask"] = torch.tensor(np.asarray(attention_mask), dtype=torch.long)
    if positions is not None:
        kwargs["position_ids"] = torch.tensor(np.asarray(positions), dtype=torch.long)
    with torch.no_grad():
        return hf_model(torch.tensor(np.asarray(tokens), dtype=torch.long), **kwargs).logits.numpy()


def left_padded_batch(lengths, total: int, seed: int = 0):
    """(tokens [B,total] int32, mask [B,total] bool) with row b's last lengths[b] tokens real."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, VOCAB, (len(lengths), total)).astype(np.int32)
    mask = np.arange(total)[None, :] >= (total - np.asarray(lengths))[:, None]
    tokens = np.where(mask, tokens, 0).astype(np.int32)
    return jnp.asarray(tokens), jnp.asarray(mask)


_jit_apply = None


def run(model, tokens, positions=None, attention_mask=None):
    """Logits of `model` through the jitted pure `apply` (one compile per config and shape)."""
    global _jit_apply
    from splitrl.models import apply

    if _jit_apply is None:
        _jit_apply = jax.jit(apply, static_argnums=0)
    graphdef, state = nnx.split(model)
    return _jit_apply(graphdef, state, tokens, positions, attention_mask=attention_mask)[0]


def standard_batch():
    """The batch most tests use (one shape, so one compile per config): tokens, mask, positions.

    Row 0 is unpadded, rows 1 and 2 are left-padded to 11 tokens.
    """
    from splitrl.models import left_pad_positions

    tokens, mask = left_padded_batch([11, 4, 7], 11, seed=5)
    return tokens, mask, left_pad_positions(mask)


@pytest.fixture(scope="module")
def tiny_config():
    """A splitrl TransformerConfig (llama3 scaling, GQA, untied) without going through HF."""
    from splitrl.models import TransformerConfig

    kwargs = dict(HF_CONFIGS["llama3_gqa_untied"])
    kwargs.pop("model_type")
    return TransformerConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], **kwargs})
