"""Tokenizers trained with `tokenizers`, saved as directories `transformers` loads.

No hub is reachable here, so the tiny checkpoints carry their own tokenizer. Two kinds:

- **byte-level BPE** (`train_bpe_tokenizer`): covers any text; digits are always single tokens
  so arithmetic is learnable.
- **character vocabulary** (`train_char_tokenizer`): a BPE model with no merges over the
  characters of the training text; any other character is dropped. A random tiny model has to
  hit the answer token by chance to get any GRPO signal, so the arithmetic task uses this
  (16 tokens instead of 512).

Both use Qwen2's text pipeline (NFC, its pre-tokenization regex, which isolates every digit, and
byte-level symbols). That is deliberate: for a `qwen2` checkpoint `transformers` 5 ignores the
pipeline in tokenizer.json and rebuilds that one around the saved vocabulary and merges, so any
other pipeline would tokenize differently in transformers than in `tokenizers`. With this one
they agree for every family, and `splitrl.fast_tokenizer` can read tokenizer.json directly.

Both have the ChatML special tokens `<|endoftext|>` (eos and pad), `<|im_start|>`, `<|im_end|>`
and a ChatML `chat_template` in `tokenizer_config.json`. Helpers the services share:
`load_tokenizer`, `encode_prompt`, `decode`, `eos_token_ids`.
"""

from __future__ import annotations

import bisect
import json
import os
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

if TYPE_CHECKING:  # transformers is imported only when a tokenizer is loaded
    from transformers import PreTrainedTokenizerBase

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END)

# ChatML, as Qwen2 uses it (without tools).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

DEFAULT_MODEL_MAX_LENGTH = 4096

# Qwen2's pre-tokenization: contractions, letter runs (with one leading non-letter), single
# digits (`\p{N}` alone: numbers are always split into digits), punctuation runs, whitespace.
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _byte_level_pipeline(tok: Tokenizer) -> Tokenizer:
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        # A no-op after the split above, which already isolates digits; it keeps numbers split
        # into single digits if the pattern is ever changed.
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def train_bpe_tokenizer(texts: Iterable[str], out_dir: str | os.PathLike, *,
                        vocab_size: int = 512, min_frequency: int = 2) -> Path:
    """Trains a byte-level BPE of at most `vocab_size` tokens (specials included) on `texts`
    and saves it to `out_dir`. Returns the directory.

    Fewer tokens come out when the text has too few distinct pairs to merge.
    """
    n_base = len(SPECIAL_TOKENS) + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < n_base:
        raise ValueError(f"vocab_size={vocab_size} is too small for a byte-level BPE "
                         f"(needs >= {n_base}: 256 bytes + {len(SPECIAL_TOKENS)} special tokens)")
    tok = _byte_level_pipeline(Tokenizer(models.BPE()))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return _save(tok, out_dir, unk_token=None)


def train_char_tokenizer(texts: Iterable[str], out_dir: str | os.PathLike, *,
                         chat_template: str = CHAT_TEMPLATE) -> Path:
    """Saves a character vocabulary of the characters in `texts` to `out_dir` (with
    `chat_template`, ChatML by default).

    Ids: the special tokens, then `<unk>`, then the characters (as byte-level symbols, so a
    space is 'Ġ'; a non-ASCII character is several byte symbols) in sorted order. It is a BPE
    model with no merges: every known character is one token and any other character is
    dropped, as transformers' Qwen2 tokenizer drops it (the model has no unknown token, so
    `tokenizers` and transformers encode alike; `<unk>` stays in the vocabulary and the config,
    so its id is the one earlier tokenizers had).
    """
    normalize = normalizers.NFC().normalize_str
    to_symbols = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    chars = {c for text in texts for c in normalize(text)}
    symbols = sorted({s for c in chars for s in to_symbols.pre_tokenize_str(c)[0][0]})
    vocab = {t: i for i, t in enumerate((*SPECIAL_TOKENS, UNK_TOKEN, *symbols))}
    tok = _byte_level_pipeline(Tokenizer(models.BPE(vocab=vocab, merges=[])))
    tok.add_special_tokens([*SPECIAL_TOKENS, UNK_TOKEN])
    return _save(tok, out_dir, unk_token=UNK_TOKEN, chat_template=chat_template)


def _save(tok: Tokenizer, out_dir: str | os.PathLike, *, unk_token: str | None,
          chat_template: str = CHAT_TEMPLATE) -> Path:
    """Writes tokenizer.json and a tokenizer_config.json (specials, chat template)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.save(str(out / "tokenizer.json"))
    specials = [*SPECIAL_TOKENS] + ([unk_token] if unk_token else [])
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": unk_token,
        "additional_special_tokens": [IM_START, IM_END],
        "added_tokens_decoder": {
            str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False,
                                      "rstrip": False, "single_word": False, "special": True}
            for t in specials
        },
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "model_max_length": DEFAULT_MODEL_MAX_LENGTH,
        "padding_side": "left",
        "split_special_tokens": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN,
         "additional_special_tokens": [IM_START, IM_END],
         **({"unk_token": unk_token} if unk_token else {})}, indent=2) + "\n")
    return out


def has_tokenizer(model_dir: str | os.PathLike) -> bool:
    """Whether ``model_dir`` holds tokenizer files (``splitrl.model_path.TOKENIZER_FILES``)."""
    from splitrl.model_path import missing_files

    return not missing_files(Path(model_dir), config=False, weights=False)


def load_tokenizer(path: str | os.PathLike, tokenizer_class: str | None = None):
    """The checkpoint's tokenizer from a local directory (never touches the hub for one) or a
    hub name (honours HF_HUB_OFFLINE). A directory without tokenizer files, a path that does not
    exist, or a hub id the hub (or its cache) does not have raises
    ``splitrl.model_path.ModelPathError`` naming the path and what is missing.

    Without ``tokenizer_class``, a directory with a ``tokenizer.json`` loads as a
    :class:`splitrl.fast_tokenizer.FastTokenizer`: the tokens and chat template transformers
    gives, without importing transformers (and through AutoTokenizer torch) in every process
    that tokenizes. Other tokenizers (SentencePiece or tiktoken files only, a tokenizer with
    its own code, a hub name) load with `AutoTokenizer`; with ``tokenizer_class``
    (``model.tokenizer_class``) that `transformers` class loads it."""
    from splitrl.model_path import hub_error, incomplete, local_dir, missing_files

    local = local_dir(path)
    if local is not None:
        missing = missing_files(local, config=False, weights=False)
        if missing:
            raise incomplete(local, missing)
        if tokenizer_class is None:
            from splitrl.fast_tokenizer import FastTokenizer, readable

            if readable(local):
                return FastTokenizer.from_dir(local)
    try:
        if tokenizer_class is None:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(str(path), local_files_only=local is not None)
        return tokenizer_class_named(tokenizer_class).from_pretrained(
            str(path), local_files_only=local is not None)
    except (OSError, ValueError) as e:
        if local is None:
            raise hub_error(path, e) from None
        raise


def tokenizer_class_named(name: str) -> type[PreTrainedTokenizerBase]:
    """The tokenizer class `transformers` exports as ``name``; ValueError if there is none."""
    import transformers
    from transformers import PreTrainedTokenizerBase

    cls = getattr(transformers, name, None) if name.isidentifier() else None
    if not (isinstance(cls, type) and issubclass(cls, PreTrainedTokenizerBase)):
        raise ValueError(f"model.tokenizer_class: expected a tokenizer class that transformers "
                         f"{transformers.__version__} exports (e.g. Qwen2Tokenizer, "
                         f"TokenizersBackend), got {name!r}")
    return cls


def build_messages(text: str | None = None, messages: Sequence[dict] | None = None,
                   system_prompt: str | None = None) -> list[dict[str, str]]:
    """Chat messages for a prompt: `messages` as given, or one user turn of `text`; a system
    turn with `system_prompt` goes first unless the messages already start with one."""
    if messages is None:
        if text is None:
            raise ValueError("a prompt needs text or messages, got neither")
        msgs = [{"role": "user", "content": text}]
    else:
        msgs = [{"role": m["role"], "content": m["content"]} for m in messages]
    if system_prompt is not None and not (msgs and msgs[0]["role"] == "system"):
        msgs.insert(0, {"role": "system", "content": system_prompt})
    return msgs


def render_prompt(tokenizer, text: str | None = None, messages: Sequence[dict] | None = None,
                  system_prompt: str | None = None, use_chat_template: bool = False,
                  tools: Sequence[dict] | None = None) -> str:
    """The prompt as the string the model sees.

    With the chat template (or when `messages` are given) it is rendered with a generation
    prompt, and with `tools` (JSON schemas) for templates that describe them. Plain text with a
    `system_prompt` becomes `system_prompt + "\\n\\n" + text`.
    """
    if messages is not None or use_chat_template:
        if tokenizer.chat_template is None:
            raise ValueError("the tokenizer has no chat_template; send plain text instead")
        msgs = build_messages(text, messages, system_prompt)
        return tokenizer.apply_chat_template(msgs, tools=list(tools) if tools else None,
                                             tokenize=False, add_generation_prompt=True)
    if text is None:
        raise ValueError("a prompt needs text or messages, got neither")
    return text if system_prompt is None else f"{system_prompt}\n\n{text}"


def encode_prompt(tokenizer, text: str | None = None, messages: Sequence[dict] | None = None,
                  system_prompt: str | None = None, use_chat_template: bool = False) -> list[int]:
    """Token ids of a prompt (see `render_prompt`). Special tokens written in the rendered text
    (`<|im_start|>`...) become their ids; no BOS/EOS is added on top."""
    return encode_rendered(tokenizer, render_prompt(tokenizer, text, messages, system_prompt,
                                                    use_chat_template))


def encode_rendered(tokenizer, rendered: str) -> list[int]:
    """Token ids of a prompt already rendered by `render_prompt`."""
    return list(tokenizer.encode(rendered, add_special_tokens=False))


def lost_characters(tokenizer, texts: Sequence[str]) -> list[Counter]:
    """Per text, the characters the tokenizer loses on the way to token ids: those missing
    from ``decode(encode(text))`` (a vocabulary without them drops them, or maps them to an
    unknown token). Whitespace is not counted (decoders
    may clean spaces up). Empty for a byte-level BPE, which encodes every string."""
    import unicodedata

    if not texts:
        return []
    texts = [unicodedata.normalize("NFC", t) for t in texts]
    ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    unk = tokenizer.unk_token_id  # decodes to "<unk>", whose letters would hide lost ones
    decoded = tokenizer.batch_decode([[i for i in x if i != unk] for x in ids],
                                     skip_special_tokens=False)
    lost = []
    for text, back in zip(texts, decoded, strict=True):
        missing = Counter(text) - Counter(unicodedata.normalize("NFC", back))
        lost.append(Counter({c: n for c, n in missing.items() if not c.isspace()}))
    return lost


def longest_token_chars(tokenizer) -> int:
    """The most characters of text one token of ``tokenizer`` stands for (its longest vocabulary
    entry: byte-level BPE writes one character per byte, SentencePiece one per character).
    Prompts longer than a multiple of this can be refused without tokenizing them."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1) or 1


def decode(tokenizer, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """Text of token ids, special tokens dropped by default."""
    return tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


def stop_string_cut(tokenizer, ids: Sequence[int], stop_strings: Sequence[str]) -> int | None:
    """How many of ``ids`` a completion keeps when it ends at the first of ``stop_strings`` it
    writes, as `transformers.generate(stop_strings=...)` ends it: up to and including the token
    whose text completes the string (special tokens count as their text). None when the text
    holds none of them. A binary search over prefixes: a few decodes per completion."""
    def has_stop(n: int) -> bool:
        text = decode(tokenizer, ids[:n], skip_special_tokens=False)
        return any(stop in text for stop in stop_strings)

    if not stop_strings or not has_stop(len(ids)):
        return None
    # has_stop is monotone in n (a longer prefix keeps the stop string): the first n it holds for
    return bisect.bisect_left(range(len(ids) + 1), True, lo=1, key=has_stop)


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte <-> printable character table used by byte-level BPE, inverted."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


_BYTE_DECODER = _bytes_to_unicode()


class ByteLevelBytes:
    """The raw bytes token ids stand for under a byte-level BPE tokenizer: what a completion
    cut inside a UTF-8 character really is, where its decoded text shows U+FFFD.

    ``ByteLevelBytes(tokenizer)(ids, skip_special)`` is None for other tokenizers. Each token's
    bytes are worked out once and kept (an early policy writes such completions all the time,
    and they are on the sampler's scoring path: not a round trip through the tokenizer per
    token)."""

    def __init__(self, tokenizer):
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = decoder is not None and (
            "ByteLevel" in type(decoder).__name__ + repr(decoder))
        self._tokenizer = tokenizer
        self._special = set(tokenizer.all_special_ids) if self.byte_level else set()
        self._bytes: dict[int, bytes] = {}

    def __call__(self, ids: Sequence[int], skip_special: bool = True) -> bytes | None:
        if not self.byte_level:
            return None
        out = []
        for i in ids:
            i = int(i)
            if skip_special and i in self._special:
                continue
            piece = self._bytes.get(i)
            if piece is None:
                piece = self._bytes[i] = self._token_bytes(i)
            out.append(piece)
        return b"".join(out)

    def _token_bytes(self, token_id: int) -> bytes:
        token = self._tokenizer.convert_ids_to_tokens(token_id)
        if token is None:  # not in the vocabulary
            return b""
        if all(c in _BYTE_DECODER for c in token):
            return bytes(_BYTE_DECODER[c] for c in token)
        return token.encode()  # an added token written as plain text


def eos_token_ids(tokenizer_or_dir) -> list[int]:
    """Ids that end a completion: the tokenizer's eos, then `<|im_end|>` (end of a chat turn)
    when the vocabulary has it. Accepts a tokenizer or a tokenizer directory."""
    tok = tokenizer_or_dir
    if isinstance(tok, str | os.PathLike):
        tok = load_tokenizer(tok)
    ids: list[int] = []
    if tok.eos_token_id is not None:
        ids.append(int(tok.eos_token_id))
    im_end = tok.convert_tokens_to_ids(IM_END)
    if isinstance(im_end, int) and im_end != tok.unk_token_id and im_end not in ids:
        ids.append(im_end)
    return ids
