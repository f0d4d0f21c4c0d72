"""What ``model.path`` names: a local Hugging Face directory, or a model on the hub.

A path that is a directory is used as it is and never sent to the hub; a name that is not a
directory here and reads as a hub id (``name`` or ``org/name``) goes to the hub, or to its
cache under ``HF_HUB_OFFLINE=1``. Anything else is a mistake, and the error says which path
was looked at and what is missing there, before `transformers` turns it into a message about
the network ("couldn't connect to huggingface.co"), repo id syntax or sentencepiece.

Imports no JAX: the launcher's preflight and the tokenizer use it.
"""

from __future__ import annotations

import os
from pathlib import Path

CONFIG_FILE = "config.json"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
# Any of these lets `transformers` build a tokenizer (a fast tokenizer, or the files a slow one
# or its conversion reads).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "spiece.model", "tokenizer.tiktoken")


class ModelPathError(FileNotFoundError):
    """``model.path`` names no model that can be loaded; the message says where it looked."""


def looks_like_hub_id(text: str) -> bool:
    """Whether ``text`` has the shape of a hub id: ``name`` or ``org/name``, not a path that
    starts at the root, the home or the current directory."""
    parts = text.split("/")
    return (0 < len(parts) <= 2 and all(parts) and ".." not in parts
            and not text.startswith((".", "~")) and "\\" not in text)


def local_dir(path: str | os.PathLike) -> Path | None:
    """The directory ``path`` names, or None for a hub id that is not a directory here.

    Raises :class:`ModelPathError` for a path that is neither (an absolute or ``./`` path that
    does not exist, a file)."""
    text = str(path)
    local = Path(text).expanduser()
    if local.is_dir():
        return local
    if local.exists():
        raise ModelPathError(f"model path {text!r} is a file; expected a Hugging Face model "
                             f"directory (with {CONFIG_FILE}, weights and tokenizer files)")
    if looks_like_hub_id(text):
        return None
    raise ModelPathError(f"model path {text!r}: no such directory ({local.absolute()})")


def missing_files(directory: Path, *, config: bool = True, weights: bool = True,
                  tokenizer: bool = True) -> list[str]:
    """What a model directory lacks of the parts asked for, as phrases (``no config.json``...);
    empty when complete."""
    missing = []
    if config and not (directory / CONFIG_FILE).is_file():
        missing.append(f"no {CONFIG_FILE}")
    if weights and not any((directory / f).is_file() for f in WEIGHT_FILES):
        missing.append(f"no weights ({' or '.join(WEIGHT_FILES)})")
    if tokenizer and not any((directory / f).is_file() for f in TOKENIZER_FILES):
        missing.append(f"no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    return missing


def incomplete(directory: Path, missing: list[str]) -> ModelPathError:
    where = "" if directory.is_absolute() else f" ({directory.absolute()})"
    return ModelPathError(f"model directory {str(directory)!r}{where} has "
                          f"{', '.join(missing)}: not a complete Hugging Face model")


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def hub_error(path: str | os.PathLike, error: Exception | str) -> ModelPathError:
    """Why a hub id that is not a local directory could not be loaded, in words that say both
    places it was looked for."""
    where = Path(str(path)).absolute()
    hub = "the hub's local cache (HF_HUB_OFFLINE is set)" if _offline() else "the hub"
    text = str(error).strip()
    reason = text.splitlines()[0] if text else type(error).__name__
    return ModelPathError(f"model path {str(path)!r}: no such directory ({where}), and not in "
                          f"{hub} as a model id either ({reason})")


def checkpoint_dir(path: str | os.PathLike, *, weights: bool = True) -> Path:
    """The local directory with the checkpoint ``path`` names: the directory itself, or for a
    hub id the hub's snapshot of it (from its cache under ``HF_HUB_OFFLINE=1``). Raises
    :class:`ModelPathError` when it has no config.json (or, with ``weights``, no weights)."""
    local = local_dir(path)
    if local is None:
        from huggingface_hub import snapshot_download

        files = ["*.json", *(["*.safetensors"] if weights else [])]
        try:
            local = Path(snapshot_download(str(path), allow_patterns=files))
        except (OSError, ValueError) as e:
            raise hub_error(path, e) from None
    missing = missing_files(local, weights=weights, tokenizer=False)
    if missing:
        raise incomplete(local, missing)
    return local


def model_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be a run's model (a missing directory, no config.json, no weights,
    no tokenizer files), or None. Checks files only, nothing is loaded. A hub id is looked up
    in the hub's cache when offline; online the loaders ask the hub."""
    try:
        local = local_dir(path)
    except ModelPathError as e:
        return str(e)
    if local is None:
        if not _offline():
            return None
        from huggingface_hub import try_to_load_from_cache

        try:
            cached = try_to_load_from_cache(str(path), CONFIG_FILE)
        except ValueError as e:  # not a valid repo id after all
            return str(hub_error(path, e))
        return None if isinstance(cached, str) else str(hub_error(path, "no cached config.json"))
    missing = missing_files(local)
    return str(incomplete(local, missing)) if missing else None
