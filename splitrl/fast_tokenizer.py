"""A checkpoint's ``tokenizer.json`` read with the `tokenizers` library, without `transformers`.

Every service process that tokenizes (sampler, trainer, reward models, the launcher's data
check) loads the checkpoint's tokenizer at start-up. Importing `transformers` to do it costs
CPU in every process, and AutoTokenizer's class resolution imports torch too when it is
installed (``bench/startup_tricks.py`` measures both). The services need only a small part of
transformers' tokenizer: encode, decode, the vocabulary, the special tokens and the chat
template. :class:`FastTokenizer` is that part, over the same ``tokenizer.json`` (the Rust
tokenizer transformers' fast tokenizers wrap) and the same ``tokenizer_config.json`` /
``chat_template.jinja``, with the chat template rendered in the sandboxed Jinja environment
transformers renders it in (``tests/splitrl/test_fast_tokenizer.py`` checks the two agree on
tokens, text and rendered prompts for every tokenizer SplitRL makes and for SmolLM2).

What it does not cover loads through transformers instead (``splitrl.tokenizer.load_tokenizer``):
a directory without ``tokenizer.json`` (SentencePiece or tiktoken files only), a tokenizer with
its own code (``auto_map``), a hub name, or a class named by ``model.tokenizer_class``. For some
families (Qwen2, Llama) transformers 5 rebuilds the pipeline around the saved vocabulary instead
of reading tokenizer.json's; a checkpoint whose tokenizer.json says something else than that
rebuild tokenizes differently in the two, and ``model.tokenizer_class`` makes the services load
transformers' class.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
TEMPLATE_FILE = "chat_template.jinja"  # transformers 5 writes a single template here
TEMPLATE_DIR = "additional_chat_templates"  # and named ones here, one .jinja file each
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                        "cls_token", "mask_token")


def readable(directory: Path) -> bool:
    """Whether :class:`FastTokenizer` reads ``directory``'s tokenizer as transformers would: a
    ``tokenizer.json``, and no tokenizer code of the checkpoint's own (``auto_map``)."""
    if not (directory / TOKENIZER_FILE).is_file():
        return False
    return "auto_map" not in _read_json(directory / CONFIG_FILE)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _content(token: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(token, Mapping):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _chat_templates(directory: Path, config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """The chat template(s) as transformers finds them: template files first (a single
    ``chat_template.jinja`` is the template, named ones make a dict), else the config's
    ``chat_template`` (a string or a list of ``{"name", "template"}``)."""
    templates: dict[str, str] = {}
    if (directory / TEMPLATE_FILE).is_file():
        templates["default"] = (directory / TEMPLATE_FILE).read_text(encoding="utf-8")
    if (directory / TEMPLATE_DIR).is_dir():
        for path in sorted((directory / TEMPLATE_DIR).glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    template = config.get("chat_template")
    if isinstance(template, list):
        return {t["name"]: t["template"] for t in template}
    return template if isinstance(template, str) else None


class FastTokenizer:
    """The part of a transformers tokenizer SplitRL uses, over a ``tokenizer.json``: the same
    method names and results (``encode``, ``decode``, ``batch_decode``, calling it on a list of
    texts, ``apply_chat_template``, ``get_vocab``, the special token ids), so code written
    against a transformers tokenizer runs on either."""

    def __init__(self, backend: Tokenizer, config: Mapping[str, Any],
                 chat_template: str | dict[str, str] | None):
        self.backend_tokenizer = backend
        self.chat_template = chat_template
        specials = {**config}
        self.special_tokens_map = {name: token for name in NAMED_SPECIAL_TOKENS
                                   if (token := _content(specials.get(name))) is not None}
        extra = specials.get("extra_special_tokens", specials.get("additional_special_tokens"))
        extra_tokens = extra.values() if isinstance(extra, Mapping) else (extra or [])
        self.extra_special_tokens = [t for t in map(_content, extra_tokens) if t is not None]
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces"))

    @classmethod
    def from_dir(cls, directory: str | Path) -> FastTokenizer:
        """The tokenizer of a checkpoint directory (see :func:`readable`)."""
        directory = Path(directory)
        # Special tokens: special_tokens_map.json, then tokenizer_config.json over it (as
        # transformers reads them).
        config = {**_read_json(directory / SPECIAL_TOKENS_FILE), **_read_json(directory /
                                                                              CONFIG_FILE)}
        backend = Tokenizer.from_file(str(directory / TOKENIZER_FILE))
        return cls(backend, config, _chat_templates(directory, config))

    # Special tokens, as attributes like transformers' (None when the tokenizer has none).
    def _special_id(self, name: str) -> int | None:
        token = self.special_tokens_map.get(name)
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens_map.get("pad_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._special_id("unk_token")

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys([*self.special_tokens_map.values(),
                                   *self.extra_special_tokens]))

    @property
    def all_special_ids(self) -> list[int]:
        ids = (self.backend_tokenizer.token_to_id(t) for t in self.all_special_tokens)
        return [i for i in ids if i is not None]

    # The vocabulary.
    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> Any:
        """A token's id (the unknown token's id, or None, for one not in the vocabulary)."""
        if isinstance(tokens, str):
            index = self.backend_tokenizer.token_to_id(tokens)
            return self.unk_token_id if index is None else index
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> Any:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids]

    # Text <-> ids.
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, texts: str | Sequence[str],
                 add_special_tokens: bool = True) -> dict[str, Any]:
        """``{"input_ids": ...}`` of one text or a list of them, as transformers returns it."""
        if isinstance(texts, str):
            return {"input_ids": self.encode(texts, add_special_tokens)}
        encodings = self.backend_tokenizer.encode_batch(list(texts),
                                                        add_special_tokens=add_special_tokens)
        return {"input_ids": [e.ids for e in encodings]}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        text = self.backend_tokenizer.decode([int(i) for i in ids],
                                             skip_special_tokens=skip_special_tokens)
        # transformers skips the clean-up for BPE models (it would remove real spaces)
        if self.clean_up_tokenization_spaces and type(self.backend_tokenizer.model).__name__ \
                != "BPE":
            text = clean_up_tokenization(text)
        return text

    def batch_decode(self, sequences: Sequence[Sequence[int]],
                     skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    # The chat template.
    def apply_chat_template(self, conversation: Sequence[Mapping[str, Any]],
                            tools: Sequence[Mapping[str, Any]] | None = None, *,
                            tokenize: bool = True, add_generation_prompt: bool = False,
                            **template_kwargs: Any) -> Any:
        """The conversation rendered by the chat template, as transformers renders it (the
        template sees ``messages``, ``tools``, ``add_generation_prompt``, the special tokens
        and ``template_kwargs``); its token ids when ``tokenize``. transformers' options that
        shape its output (``return_dict``, ``return_tensors``, padding...) are not supported:
        they raise rather than pass unseen into the template."""
        shaping = sorted(template_kwargs.keys() & _OUTPUT_OPTIONS)
        if shaping:
            raise TypeError(f"apply_chat_template: {', '.join(shaping)} not supported (token ids "
                            "come back as a list; load the tokenizer through transformers, "
                            "model.tokenizer_class, for its other outputs)")
        template = self._template(tools)
        messages = [{k: v for k, v in m.items() if v is not None} for m in conversation]
        for message in messages:  # the names templates read a message's reasoning under
            reasoning = next((message[k] for k in ("reasoning_content", "thinking", "reasoning")
                              if message.get(k) is not None), None)
            if reasoning is not None:
                message.setdefault("thinking", reasoning)
                message["reasoning_content"] = reasoning
        text = compiled_template(template).render(
            messages=messages, tools=[dict(t) for t in tools] if tools is not None else None,
            documents=None, add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens_map, **template_kwargs})
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _template(self, tools: Sequence[Mapping[str, Any]] | None) -> str:
        templates = self.chat_template
        if templates is None:
            raise ValueError("this tokenizer has no chat_template")
        if isinstance(templates, str):
            return templates
        if tools is not None and "tool_use" in templates:
            return templates["tool_use"]
        if "default" in templates:
            return templates["default"]
        raise ValueError(f"this tokenizer has several chat templates and none named 'default': "
                         f"{sorted(templates)}")


# transformers' apply_chat_template options that shape its output rather than the template's.
_OUTPUT_OPTIONS = frozenset({"return_dict", "return_tensors", "padding", "truncation",
                             "max_length", "return_assistant_tokens_mask",
                             "continue_final_message", "tokenizer_kwargs"})


def clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization_spaces`` (spaces before punctuation and
    contractions, as WordPiece decoding leaves them)."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                          (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                          (" 're", "'re")):
        text = text.replace(before, after)
    return text


@lru_cache(maxsize=16)
def compiled_template(template: str):
    """A chat template compiled in the environment transformers renders templates in: Jinja's
    immutable sandbox (templates come from checkpoints: untrusted code), blocks trimmed,
    ``break``/``continue``, a ``tojson`` that keeps non-ASCII text, ``raise_exception`` and
    ``strftime_now``, and ``{% generation %}`` blocks rendered as their content."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}``: marks the assistant's tokens for
        transformers' assistant masks; rendering the text, it is its content."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_content"), [], [], body) \
                .set_lineno(lineno)

        def _content(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
