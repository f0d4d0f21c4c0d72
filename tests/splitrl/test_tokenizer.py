"""Tokenizers trained with `tokenizers` load in transformers and behave as the services need."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from splitrl import tokenizer as tk
from splitrl.tasks import get_task


@pytest.fixture(scope="module")
def gsm8k_texts(shared_data):
    lines = (shared_data / "gsm8k" / "train.jsonl").read_text().splitlines()[:2000]
    return [json.loads(line)["question"] for line in lines]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory, gsm8k_texts):
    out = tk.train_bpe_tokenizer(gsm8k_texts, tmp_path_factory.mktemp("bpe"), vocab_size=512)
    return tk.load_tokenizer(out)


@pytest.fixture(scope="module")
def char_dir(tmp_path_factory):
    return tk.train_char_tokenizer(get_task("arithmetic").corpus(), tmp_path_factory.mktemp("ch"))


def test_bpe_has_requested_size_and_chatml_specials(bpe):
    assert len(bpe) == 512
    assert bpe.eos_token == bpe.pad_token == "<|endoftext|>"
    assert [bpe.convert_tokens_to_ids(t) for t in tk.SPECIAL_TOKENS] == [0, 1, 2]
    assert tk.eos_token_ids(bpe) == [0, 2]


def test_bpe_round_trips_gsm8k_text(bpe, shared_data):
    rows = [json.loads(line) for line in
            (shared_data / "gsm8k" / "test.jsonl").read_text().splitlines()[:200]]
    for text in [r["question"] for r in rows] + [r["answer"] for r in rows]:
        assert tk.decode(bpe, bpe.encode(text, add_special_tokens=False)) == text


@pytest.mark.parametrize("text", ["1080", "It costs $1,234.50 in 2024", "x=987654321"])
def test_every_digit_is_its_own_token(bpe, text):
    tokens = bpe.convert_ids_to_tokens(bpe.encode(text, add_special_tokens=False))
    digit_tokens = [t for t in tokens if any(c.isdigit() for c in t)]
    assert all(len(t) == 1 for t in digit_tokens), tokens
    assert len(digit_tokens) == sum(c.isdigit() for c in text)


@pytest.mark.parametrize("model_type", [None, "qwen2"])
def test_transformers_and_tokenizers_agree(tmp_path, gsm8k_texts, model_type):
    """For model_type qwen2, transformers rebuilds Qwen2's pipeline around our vocabulary."""
    out = tk.train_bpe_tokenizer(gsm8k_texts, tmp_path, vocab_size=512)
    if model_type is not None:
        (out / "config.json").write_text(json.dumps({"model_type": model_type}))
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(str(out))
    if model_type == "qwen2":
        assert type(loaded).__name__ == "Qwen2Tokenizer"
    raw = Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in gsm8k_texts[:200] + ["a  1", "héllo\n\n  x 12", "e\u0301 1,080.5"]:
        assert loaded.encode(text, add_special_tokens=False) == raw.encode(text).ids


def test_chat_template_renders_chatml_with_system_prompt(bpe):
    text = tk.render_prompt(bpe, "What is 3+4?", system_prompt="Be brief.",
                            use_chat_template=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nWhat is 3+4?<|im_end|>\n<|im_start|>assistant\n")


def test_encode_prompt_with_chat_template_has_no_doubled_special_tokens(bpe):
    ids = tk.encode_prompt(bpe, "3+4=", use_chat_template=True)
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    im_start = bpe.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(im_start) == 2 and ids[0] == im_start
    assert bpe.eos_token_id not in ids
    assert tk.decode(bpe, ids, skip_special_tokens=False) == tk.render_prompt(
        bpe, "3+4=", use_chat_template=True)


def test_encode_prompt_accepts_messages_and_plain_text(bpe):
    msgs = [{"role": "user", "content": "hi"}]
    assert tk.encode_prompt(bpe, messages=msgs) == tk.encode_prompt(bpe, "hi",
                                                                      use_chat_template=True)
    plain = tk.encode_prompt(bpe, "3+4=", system_prompt="Add.")
    assert tk.decode(bpe, plain) == "Add.\n\n3+4="
    with pytest.raises(ValueError, match="text or messages"):
        tk.encode_prompt(bpe)


def test_arithmetic_character_vocabulary_is_small_and_exact(char_dir):
    tok = tk.load_tokenizer(char_dir)
    assert len(tok) < 32
    ids = tk.encode_prompt(tok, "3+4=")
    assert tok.convert_ids_to_tokens(ids) == ["3", "+", "4", "="]
    assert tk.decode(tok, [*tok.encode("7", add_special_tokens=False), tok.eos_token_id]) == "7"
    for digit in "0123456789":
        assert len(tok.encode(digit, add_special_tokens=False)) == 1
    # a character outside the vocabulary is dropped (as transformers' Qwen2 tokenizer drops it)
    assert tok.encode("3x", add_special_tokens=False) == tok.encode("3", add_special_tokens=False)
    assert tok.convert_tokens_to_ids("<unk>") == tok.unk_token_id == 3  # the id stays reserved
    assert tk.eos_token_ids(char_dir) == [0, 2]


def test_bpe_refuses_a_vocab_smaller_than_the_byte_alphabet(tmp_path):
    with pytest.raises(ValueError, match="too small"):
        tk.train_bpe_tokenizer(["abc"], tmp_path, vocab_size=100)


def test_byte_level_bytes_are_the_utf8_bytes_of_any_cut_of_the_text(bpe):
    text = "Größe 5 m², café ✓ 数学 = 42"
    ids = bpe.encode(text, add_special_tokens=False)
    raw = tk.ByteLevelBytes(bpe)
    assert raw(ids) == text.encode()
    cut = [raw(ids[:k]) for k in range(len(ids) + 1)]  # cut between tokens: maybe mid-character
    assert all(text.encode().startswith(piece) for piece in cut)
    assert any("\ufffd" in tk.decode(bpe, ids[:k]) for k in range(len(ids)))  # the case it is for
    assert raw(ids) == raw(ids) and raw([*ids, 99999]) == text.encode()  # cached; unknown id: none


def test_byte_level_bytes_skip_special_tokens_or_keep_their_text(bpe):
    raw = tk.ByteLevelBytes(bpe)
    ids = [1, *bpe.encode("4", add_special_tokens=False), 0]
    assert raw(ids) == b"4"
    assert raw(ids, skip_special=False) == f"{tk.SPECIAL_TOKENS[1]}4{tk.SPECIAL_TOKENS[0]}".encode()


def test_byte_level_bytes_of_other_tokenizers_are_none():
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({"[UNK]": 0, "one": 1, "two": 2}, unk_token="[UNK]"))
    words.pre_tokenizer, words.decoder = pre_tokenizers.Whitespace(), decoders.WordPiece()
    tok = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]")
    assert tk.ByteLevelBytes(tok)(tok.encode("one two", add_special_tokens=False)) is None



def test_stop_string_cut_ends_at_the_token_that_completes_the_first_stop(char_dir):
    tok = tk.load_tokenizer(str(char_dir))
    ids = tok.encode("1+2=3+4=9", add_special_tokens=False)  # one token per character
    assert len(ids) == 9
    assert tk.stop_string_cut(tok, ids, ["="]) == 4
    assert tk.stop_string_cut(tok, ids, ["3+4"]) == 7
    assert tk.stop_string_cut(tok, ids, ["9"]) == 9
    assert tk.stop_string_cut(tok, ids, ["=9", "+2"]) == 3  # whichever is written first
    assert tk.stop_string_cut(tok, ids, ["x"]) is None
    assert tk.stop_string_cut(tok, ids, []) is None
