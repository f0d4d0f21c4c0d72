"""Hugging Face-compatible causal LMs (Llama 3, Qwen2/2.5, Qwen3) in flax.nnx.

Parameters carry their HF names with the decoder layers stacked on a leading layer axis
(`model.layers.self_attn.q_proj.weight` [L, in, out] holds HF's `model.layers.{i}.self_attn.
q_proj.weight` of every layer i, see `stacking.py`), so trainer state, sampler state, partition
rules and the wire share one naming (see `param_names`), and the layers run under a scan.
Shapes follow flax: Linear weights are [in, out] (`lm_head.weight` [D, V]), the embedding
[V, D]; only checkpoint files (`save_pretrained`, `hf_state_dict`, `checkpoint_shapes`) hold
one tensor per layer in torch's [out, in].

    model = from_pretrained("/path/to/hf_dir")            # or init_random(config, seed)
    logits, _ = model(tokens, positions, attention_mask=mask)
    lp, ent = token_logprobs(model, tokens, targets, temperature=0.7)
    save_pretrained(model, "/path/out")

A generation engine with its own cache layout implements an attention backend (one method,
`attend(layer, q, k, v) -> (out, backend)`, see `attention.py`) and calls
`model.forward_with(tokens, positions, backend)`; the simple static cache below is one such
backend:

    graphdef, state = nnx.split(model)
    step = jax.jit(apply, static_argnums=0, donate_argnames="cache")
    cache = init_cache(model.config, batch, max_len)
    logits, cache = step(graphdef, state, prompt, pos, attention_mask=mask, cache=cache,
                         cache_index=0)
"""

from splitrl.models.attention import (
    AttentionBackend,
    DenseAttention,
    KVCacheAttention,
    attend,
    blockwise_attend,
    causal_mask,
    dense_attend,
    slot_attend,
)
from splitrl.models.cache import KVCache, init_cache, left_pad_positions
from splitrl.models.config import RopeScaling, TransformerConfig
from splitrl.models.hf_io import from_pretrained, load_config, save_pretrained
from splitrl.models.logprobs import logprobs_from_hidden, token_logprobs
from splitrl.models.params import (
    checkpoint_shapes,
    from_hf_state_dict,
    hf_from_state,
    hf_state_dict,
    load_hf_state_dict,
    model_from_state,
    param_names,
    param_shapes,
    state_from_hf,
)
from splitrl.models.stacking import layer_views
from splitrl.models.transformer import CausalLM, abstract_model, apply, init_random

__all__ = [
    "AttentionBackend",
    "CausalLM",
    "DenseAttention",
    "KVCache",
    "KVCacheAttention",
    "RopeScaling",
    "TransformerConfig",
    "abstract_model",
    "apply",
    "causal_mask",
    "checkpoint_shapes",
    "dense_attend",
    "attend",
    "blockwise_attend",
    "slot_attend",
    "from_hf_state_dict",
    "from_pretrained",
    "hf_from_state",
    "hf_state_dict",
    "init_cache",
    "init_random",
    "layer_views",
    "left_pad_positions",
    "load_config",
    "load_hf_state_dict",
    "logprobs_from_hidden",
    "model_from_state",
    "param_names",
    "param_shapes",
    "save_pretrained",
    "state_from_hf",
    "token_logprobs",
]
