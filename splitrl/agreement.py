"""What a trainer and its samplers must agree on, compared when a sampler registers.

Services started by hand (or each from its own Kubernetes ConfigMap) can be given different
configs. Some differences never matter (a sampler's batch size); some make the run train on
the wrong thing: a sampler that serves another architecture, vocabulary or tokenizer, or ends
completions at other stop tokens. Each side describes itself with :func:`agreed_settings` (the
sampler in ``GetInfo.agreed``, the trainer from its own config, model and tokenizer), and the
trainer refuses a sampler whose settings differ, naming every differing key
(:func:`differences`), before it gets a push or a prompt.

The keys: the config fields the sampler itself falls back on (``sampling.stop_token_ids``: its
stop tokens when a request names none; ``sampling.stop_strings``: where it ends a completion;
``environment``: the multi-turn episodes it runs), the model's architecture and every
``config.json`` field that shapes it (``model.vocab_size``,
``model.num_hidden_layers``...; not its dtype: a sampler may serve bf16 from f32 weights) and
``tokenizer``, a fingerprint of the tokenizer as loaded (vocabulary, special tokens, chat
template). Weights are not compared: a sampler of the same model with other weights is reset
to the trainer's by its first push. Nor is the run's length (``trainer.steps``): a sampler
takes any newer version its trainer pushes (pushes are authenticated and versions only grow),
so a run resumed with more steps keeps its samplers.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

# config.json keys that do not change what the model computes from the weights it is sent.
_NOT_MODEL_SHAPE = frozenset({"dtype", "torch_dtype", "use_cache", "transformers_version"})
NO_TOKENIZER = "(none)"
# Trailing metadata of a refused RegisterSampler (FAILED_PRECONDITION): the differing keys,
# comma-separated, for a client to act on without reading the message.
DIFFERING_KEYS = "splitrl-differing-keys"


def tokenizer_identity(tokenizer: Any) -> str:
    """A fingerprint of a loaded tokenizer: its vocabulary, special tokens and chat template
    (what turns the same prompt into the same ids). ``NO_TOKENIZER`` for None."""
    if tokenizer is None:
        return NO_TOKENIZER
    described = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special": sorted(str(t) for t in getattr(tokenizer, "all_special_tokens", [])),
        "chat_template": getattr(tokenizer, "chat_template", None),
    }
    text = json.dumps(described, sort_keys=True, default=str)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def agreed_settings(config: Any, model_config: Any, tokenizer: Any) -> dict[str, str]:
    """The settings both sides must have equal (see the module docstring), as strings.
    ``config`` is the service's :class:`splitrl.config.Config`, ``model_config`` the loaded
    model's :class:`splitrl.models.ModelConfig`."""
    out = {
        "sampling.stop_token_ids": json.dumps(list(config.sampling.stop_token_ids)),
        "sampling.stop_strings": json.dumps(list(config.sampling.stop_strings)),
        "tokenizer": tokenizer_identity(tokenizer),
        # The sampler runs the episodes (docs/environments.md): what it runs is what trains.
        "environment": json.dumps(None if config.environment is None
                                  else config.environment.model_dump(), sort_keys=True),
    }
    for key, value in sorted(model_config.to_hf_dict().items()):
        if key not in _NOT_MODEL_SHAPE:
            out[f"model.{key}"] = json.dumps(value, sort_keys=True)
    return out


def differences(ours: Mapping[str, str],
                theirs: Mapping[str, str]) -> list[tuple[str, str, str]]:
    """``(key, ours, theirs)`` for every key whose values differ (a key one side does not
    report counts as differing: "(not reported)")."""
    out = []
    for key in sorted(set(ours) | set(theirs)):
        mine, other = ours.get(key, "(not reported)"), theirs.get(key, "(not reported)")
        if mine != other:
            out.append((key, mine, other))
    return out
