"""The tokenizer class every service of a local run loads (``model.tokenizer_class``)."""

from __future__ import annotations

from pathlib import Path

from splitrl.config import Config


def pin_tokenizer_class(cfg: Config):
    """Sets ``model.tokenizer_class`` (when the config leaves it null) to the class
    AutoTokenizer chooses for the model, so every service this launcher starts loads that
    class directly: the same tokenizer, without the torch import that AutoTokenizer's class
    resolution costs each process (``splitrl.tokenizer.load_tokenizer``). Resolved once, here,
    and remembered for these tokenizer files (``splitrl.tokenizer.remembered_tokenizer_class``),
    so the next launch does not import torch either. Left null for a model directory without
    a tokenizer or a tokenizer class from the checkpoint's own code; the services then decide
    as before. Returns the tokenizer when resolving loaded it, else None."""
    from splitrl.tokenizer import (
        exported_class_name,
        has_tokenizer,
        load_tokenizer,
        remember_tokenizer_class,
        remembered_tokenizer_class,
    )

    path = cfg.model.path
    if cfg.model.tokenizer_class is not None:
        return None
    if Path(path).is_dir() and not has_tokenizer(path):
        return None
    cfg.model.tokenizer_class = remembered_tokenizer_class(path)
    if cfg.model.tokenizer_class is not None:
        return None
    try:
        tokenizer = load_tokenizer(path)
    except (ValueError, OSError):
        return None  # the services report it, each in its own terms
    cfg.model.tokenizer_class = exported_class_name(tokenizer)
    if cfg.model.tokenizer_class is not None:
        remember_tokenizer_class(path, cfg.model.tokenizer_class)
    return tokenizer
