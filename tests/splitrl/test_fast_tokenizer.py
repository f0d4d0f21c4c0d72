"""A checkpoint's tokenizer.json read with `tokenizers` (``splitrl.fast_tokenizer``) gives what
transformers gives for the same directory: the same ids, text, vocabulary, special tokens and
rendered chat template; loading it imports no transformers. ``model.tokenizer_class`` still
loads a transformers class, and a wrong name is refused by name."""

from __future__ import annotations

import shutil

import pytest
from transformers import AutoTokenizer

from splitrl import tokenizer as tk
from splitrl.agreement import tokenizer_identity
from splitrl.fast_tokenizer import FastTokenizer
from splitrl.init_model import init_model
from tests.fresh_python import python_prints

TEXTS = ["3+4=", "What is 12 + 7?", "It costs $1,234.50 in 2024.", "  spaced\n\nlines\t!",
         "<|im_start|>user\nhi<|im_end|>", "éàü 漢字 🙂", "e\u0301 x", "", " 1 2 3 ",
         "Don't stop , they're here !", "tab\tand\r\nCRLF"]
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Adds two numbers — exactly.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]
CONVERSATIONS = [
    [{"role": "user", "content": "1+2="}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3+4?"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "7"},
     {"role": "user", "content": "again, ünïcode 数"}],
    [{"role": "user", "content": "add 2 and 3"},
     {"role": "assistant", "content": "", "tool_calls": None},
     {"role": "tool", "name": "add", "content": "5"}],
]
# A template that uses what transformers' Jinja environment adds or sets: trimmed blocks,
# loop controls, its tojson (non-ASCII kept), the special tokens, generation blocks, tools.
FEATURE_TEMPLATE = """
{%- for message in messages %}
    {%- if message['role'] == 'system' %}{% continue %}{% endif %}
    {% generation %}<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>{% endgeneration %}
    {%- if loop.index > 3 %}{% break %}{% endif %}
{% endfor %}
{%- if tools %}{{ tools | tojson }}{{ tools[0] | tojson(indent=2) }}{% endif %}
{{- eos_token }}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module", params=[("qwen2", "arithmetic"), ("qwen3", "default"),
                                        ("llama", "default"), ("smollm2", None)])
def model_dir(request, tmp_path_factory, shared_data):
    family, vocab = request.param
    if family == "smollm2":
        return request.getfixturevalue("smollm2")
    return init_model(tmp_path_factory.mktemp(family) / "m", family=family, preset="tiny",
                      vocab=vocab, data_dir=shared_data)


@pytest.fixture(scope="module")
def pair(model_dir):
    """(ours, transformers') for one checkpoint."""
    ours = tk.load_tokenizer(model_dir)
    assert isinstance(ours, FastTokenizer)
    return ours, AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def test_ids_and_text_are_transformers(pair):
    ours, theirs = pair
    for text in TEXTS:
        for specials in (False, True):
            ids = theirs.encode(text, add_special_tokens=specials)
            assert ours.encode(text, add_special_tokens=specials) == ids, (text, specials)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                ids, skip_special_tokens=skip)
    assert (ours(TEXTS, add_special_tokens=False)["input_ids"]
            == theirs(TEXTS, add_special_tokens=False)["input_ids"])
    every = list(range(len(theirs)))
    assert ours.decode(every) == theirs.decode(every)
    assert ours.batch_decode([every[:5], every[5:9]]) == theirs.batch_decode([every[:5],
                                                                              every[5:9]])


def test_vocabulary_and_special_tokens_are_transformers(pair):
    ours, theirs = pair
    assert ours.get_vocab() == theirs.get_vocab() and len(ours) == len(theirs)
    every = list(range(len(theirs)))
    assert ours.convert_ids_to_tokens(every) == theirs.convert_ids_to_tokens(every)
    assert ours.convert_ids_to_tokens(3) == theirs.convert_ids_to_tokens(3)
    named = [ours.eos_token, "<|im_end|>", "no-such-token"]
    assert ours.convert_tokens_to_ids(named) == theirs.convert_tokens_to_ids(named)
    for name in ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id", "eos_token"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert set(ours.all_special_ids) == set(theirs.all_special_ids)
    assert set(ours.all_special_tokens) == set(theirs.all_special_tokens)
    # a sampler and a trainer that loaded it either way agree on it
    assert tokenizer_identity(ours) == tokenizer_identity(theirs)
    assert tk.eos_token_ids(ours) == tk.eos_token_ids(theirs)
    assert tk.longest_token_chars(ours) == tk.longest_token_chars(theirs)


def test_the_chat_template_renders_as_transformers_renders_it(pair):
    ours, theirs = pair
    assert ours.chat_template == theirs.chat_template
    for messages in CONVERSATIONS:
        for tools in (None, TOOLS):
            for prompt in (False, True):
                kwargs = dict(tools=tools, add_generation_prompt=prompt)
                text = theirs.apply_chat_template(messages, tokenize=False, **kwargs)
                assert ours.apply_chat_template(messages, tokenize=False, **kwargs) == text
                assert ours.apply_chat_template(messages, **kwargs) == theirs.encode(
                    text, add_special_tokens=False)
    assert (tk.render_prompt(ours, "3+4=", system_prompt="Add.", use_chat_template=True)
            == tk.render_prompt(theirs, "3+4=", system_prompt="Add.", use_chat_template=True))
    # transformers' output options are refused, not passed into the template unseen
    with pytest.raises(TypeError, match="return_dict not supported"):
        ours.apply_chat_template(CONVERSATIONS[0], return_dict=True)


def test_template_features_render_as_in_transformers(arith_model, tmp_path):
    """Jinja's settings and the helpers transformers gives templates, on a template using
    them; a template's raise_exception is the same error."""
    directory = tmp_path / "tok"
    shutil.copytree(arith_model, directory)
    (directory / "chat_template.jinja").write_text(FEATURE_TEMPLATE)  # before the config's
    ours, theirs = tk.load_tokenizer(directory), AutoTokenizer.from_pretrained(str(directory))
    for messages in CONVERSATIONS:
        for tools in (None, TOOLS):
            kwargs = dict(tools=tools, add_generation_prompt=True, tokenize=False)
            assert (ours.apply_chat_template(messages, **kwargs)
                    == theirs.apply_chat_template(messages, **kwargs))
    (directory / "chat_template.jinja").write_text(
        "{{ raise_exception('no system turns: ' ~ messages[0]['role']) }}")
    ours, theirs = tk.load_tokenizer(directory), AutoTokenizer.from_pretrained(str(directory))
    import jinja2

    for tok in (ours, theirs):
        with pytest.raises(jinja2.TemplateError, match="no system turns: user"):
            tok.apply_chat_template(CONVERSATIONS[0], tokenize=False)


def test_loading_imports_neither_transformers_nor_torch(arith_model):
    code = ("import sys\n"
            "from splitrl.tokenizer import load_tokenizer, render_prompt\n"
            f"tok = load_tokenizer({str(arith_model)!r})\n"
            "assert render_prompt(tok, '3+4=', use_chat_template=True)\n"
            "print('transformers' in sys.modules, 'torch' in sys.modules)\n")
    assert python_prints(code) == ["False False"]


def test_a_named_class_loads_through_transformers(arith_model):
    named = tk.load_tokenizer(arith_model, "Qwen2Tokenizer")
    assert type(named).__name__ == "Qwen2Tokenizer"
    ours = tk.load_tokenizer(arith_model)
    assert named.encode("3+4=x", add_special_tokens=False) == ours.encode(
        "3+4=x", add_special_tokens=False)


@pytest.mark.parametrize("name", ["NoSuchTokenizer", "Qwen2Config", "not a name", "__class__"])
def test_a_name_that_is_no_tokenizer_class_is_refused_by_name(arith_model, name):
    with pytest.raises(ValueError, match=rf"model.tokenizer_class: .*got {name!r}"):
        tk.load_tokenizer(arith_model, name)
