"""Architecture config for the supported causal LMs, read from and written to HF `config.json`.

One frozen dataclass describes Llama 3, Qwen2/Qwen2.5 and Qwen3: they differ only in a few
switches (q/k/v bias, per-head q/k RMSNorm, explicit head_dim, rope scaling). The dataclass is
hashable so it can be a static attribute of the nnx module and a static jit argument.

Anything in a `config.json` that would change the maths but that the model does not implement
(sliding windows, other activations, other rope types, MLP bias, ...) raises a ValueError that
names the field, instead of loading a model that silently computes something else.
"""

from __future__ import annotations

import dataclasses
from typing import Any

FAMILIES = ("llama", "qwen2", "qwen3")
_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_ARCH_OF_FAMILY = {family: arch for arch, family in _ARCHITECTURES.items()}
_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3 style frequency-dependent RoPE scaling (HF `rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: str = "llama3"

    def __post_init__(self):
        if self.rope_type != "llama3":
            raise ValueError(f"rope_scaling.rope_type={self.rope_type!r} is not supported "
                             "(supported: 'default', 'llama3')")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("rope_scaling.high_freq_factor must be > low_freq_factor, got "
                             f"{self.high_freq_factor} <= {self.low_freq_factor}")


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Decoder-only transformer hyper-parameters (HF names in comments where they differ).

    `attention_bias` is the bias on q/k/v projections and `attention_out_bias` the bias on the
    output projection: Qwen2 always has (True, False); Llama and Qwen3 set both from HF's single
    `attention_bias` flag. `dtype` is the checkpoint's storage dtype (HF `torch_dtype`/`dtype`).
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int  # num_hidden_layers
    num_heads: int  # num_attention_heads
    num_kv_heads: int  # num_key_value_heads
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attention_out_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    dtype: str = "float32"

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family={self.family!r} is not supported (supported: {FAMILIES})")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported (supported: {_DTYPES})")
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", _rope_scaling(self.rope_scaling))
        expected = {
            "llama": None,
            "qwen2": (True, False, False),
            "qwen3": None,
        }[self.family]
        flags = (self.attention_bias, self.attention_out_bias, self.qk_norm)
        if expected is not None and flags != expected:
            raise ValueError(f"qwen2 requires (attention_bias, attention_out_bias, qk_norm) = "
                             f"{expected}, got {flags}")
        if self.family != "qwen2" and self.attention_bias != self.attention_out_bias:
            raise ValueError(f"{self.family}: attention_bias and attention_out_bias must be equal "
                             "(HF has a single attention_bias flag for this family)")
        if self.family == "llama" and self.qk_norm:
            raise ValueError("llama has no qk_norm")
        if self.family == "qwen3" and not self.qk_norm:
            raise ValueError("qwen3 requires qk_norm=True")

    @property
    def architecture(self) -> str:
        return _ARCH_OF_FAMILY[self.family]

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> TransformerConfig:
        """Parses a HF `config.json` dict (transformers v4 or v5 layout)."""
        family = _family_of(d)
        _reject_unsupported(d, family)
        hidden, heads = _req(d, "hidden_size"), _req(d, "num_attention_heads")
        head_dim = d.get("head_dim") or hidden // heads
        theta, scaling = _rope_of(d)
        bias = bool(d.get("attention_bias", False))
        dtype = d.get("dtype") or d.get("torch_dtype") or "float32"
        return cls(
            family=family,
            vocab_size=_req(d, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_req(d, "intermediate_size"),
            num_layers=_req(d, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rope_theta=float(theta),
            rope_scaling=scaling,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=True if family == "qwen2" else bias,
            attention_out_bias=False if family == "qwen2" else bias,
            qk_norm=family == "qwen3",
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"),
            dtype=str(dtype),
        )

    def to_hf_dict(self, dtype: str | None = None) -> dict[str, Any]:
        """A `config.json` dict that transformers 5 loads (and v4, via the top-level keys)."""
        dtype = dtype or self.dtype
        rope: dict[str, Any] = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling is not None:
            rope.update(dataclasses.asdict(self.rope_scaling))
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_dropout": 0.0,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
            "dtype": dtype,
            "torch_dtype": dtype,
            "use_cache": True,
        }
        if self.family != "qwen2":
            d["attention_bias"] = self.attention_bias
        if self.family == "llama":
            d["mlp_bias"] = False
        else:
            d["use_sliding_window"] = False
        return d


def _req(d: dict[str, Any], key: str) -> Any:
    if key not in d:
        raise ValueError(f"config.json is missing required field {key!r}")
    return d[key]


def _family_of(d: dict[str, Any]) -> str:
    archs = d.get("architectures") or []
    if archs:
        if len(archs) != 1 or archs[0] not in _ARCHITECTURES:
            raise ValueError(f"architectures={archs!r} is not supported "
                             f"(supported: {sorted(_ARCHITECTURES)})")
        family = _ARCHITECTURES[archs[0]]
        if d.get("model_type", family) != family:
            raise ValueError(f"model_type={d['model_type']!r} does not match "
                             f"architectures={archs!r}")
        return family
    model_type = d.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"model_type={model_type!r} is not supported (supported: {FAMILIES})")
    return model_type


def _reject_unsupported(d: dict[str, Any], family: str) -> None:
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported (only 'silu')")
    if d.get("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported")
    if d.get("use_sliding_window"):
        raise ValueError("use_sliding_window=True is not supported (full attention only)")
    layer_types = d.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(f"layer_types={layer_types!r} is not supported (full_attention only)")
    prf = d.get("partial_rotary_factor", 1.0)
    if prf != 1.0:
        raise ValueError(f"partial_rotary_factor={prf} is not supported (only 1.0)")


def _rope_of(d: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from v5 `rope_parameters` or v4 top-level `rope_theta`/`rope_scaling`.

    v5 puts theta and the scaling fields in one dict; v4 has theta at the top and an optional
    `rope_scaling` dict (older ones spell `rope_type` as `type`).
    """
    params = d.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise ValueError(f"rope_parameters must be a dict, got {params!r}")
        theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
        return theta, _rope_scaling(params)
    theta = d.get("rope_theta", 10000.0)
    scaling = d.get("rope_scaling")
    return theta, None if scaling is None else _rope_scaling(scaling)


def _rope_scaling(params: dict[str, Any]) -> RopeScaling | None:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        raise ValueError(f"rope_scaling.rope_type={rope_type!r} is not supported "
                         "(supported: 'default', 'llama3')")
    try:
        return RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ValueError(f"rope_scaling (llama3) is missing field {e.args[0]!r}") from None
