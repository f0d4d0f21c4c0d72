"""Prompts too long for the samplers: measured as the sampler encodes them, handled at load."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from splitrl.config import ConfigError, load_config
from splitrl.tokenizer import encode_prompt, load_tokenizer, train_bpe_tokenizer
from trainer_service.orchestration.data import PromptStream, format_row
from trainer_service.orchestration.prompt_length import fit_split, token_counter

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    corpus = [WORDS, "What is 2+2? Answer with a number.", "You are a careful solver."] * 4
    return train_bpe_tokenizer(corpus, tmp_path_factory.mktemp("tok"), vocab_size=300)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return load_tokenizer(tokenizer_dir)


def row(prompt_id, prompt=None, messages=None):
    return {"prompt_id": prompt_id, "prompt": prompt, "messages": messages, "reference": "4",
            "columns": {}}


def counter(tokenizer, **fmt):
    return token_counter(tokenizer, lambda r: format_row(r, **fmt))


def sampler_tokens(tokenizer, r, **fmt):
    served = format_row(r, **fmt)
    return len(encode_prompt(tokenizer, served["prompt"], served["messages"]))


def test_counts_are_the_samplers_system_prompt_and_template_included(tokenizer):
    rows = [row("a", "What is 2+2?"), row("b", messages=[{"role": "user", "content": WORDS}])]
    for fmt in ({}, {"system_prompt": "You are a careful solver."},
                {"system_prompt": "You are a careful solver.", "chat_template": True}):
        assert counter(tokenizer, **fmt)(rows) == [sampler_tokens(tokenizer, r, **fmt)
                                                  for r in rows]
    plain = sampler_tokens(tokenizer, rows[0])
    assert sampler_tokens(tokenizer, rows[0], chat_template=True) > plain  # the template costs


def test_drop_leaves_the_row_out_and_logs_its_id(tokenizer, caplog):
    rows = [row(f"short-{i}", "What is 2+2?") for i in range(4)]
    rows.insert(2, row("long-1", " ".join([WORDS] * 5)))
    limit = sampler_tokens(tokenizer, rows[0]) + 2
    with caplog.at_level(logging.WARNING):
        kept, report = fit_split(rows, split="train", limit=limit, policy="drop",
                                 count=counter(tokenizer), tokenizer=tokenizer)
    assert [r["prompt_id"] for r in kept] == [f"short-{i}" for i in range(4)]
    assert report.dropped == ["long-1"] and report.too_long[0][0] == "long-1"
    assert report.too_long[0][1] > limit
    assert any(getattr(rec, "prompt_id", None) == "long-1" for rec in caplog.records)
    assert "1 of 5 train prompts are longer" in caplog.text


def test_truncate_left_keeps_the_end_of_the_text_and_the_system_prompt(tokenizer):
    fmt = {"system_prompt": "You are a careful solver."}
    text = " ".join([WORDS] * 4) + " What is 2+2?"
    long_row = row("long", text)
    limit = sampler_tokens(tokenizer, row("x", "What is 2+2?"), **fmt) + 10
    kept, report = fit_split([long_row], split="train", limit=limit, policy="truncate_left",
                             count=counter(tokenizer, **fmt), tokenizer=tokenizer)
    cut = kept[0]
    assert report.truncated == ["long"] and report.dropped == []
    assert text.endswith(cut["prompt"]) and len(cut["prompt"]) < len(text)
    assert cut["prompt"].endswith("What is 2+2?")
    served = format_row(cut, **fmt)
    assert served["prompt"].startswith("You are a careful solver.\n\n")
    n = sampler_tokens(tokenizer, cut, **fmt)
    assert limit - 2 <= n <= limit  # as much of the text as fits (tokens may merge by one)


def test_truncate_left_on_chat_trims_the_earliest_turns_first(tokenizer):
    messages = [{"role": "system", "content": "You are a careful solver."},
                {"role": "user", "content": " ".join([WORDS] * 3)},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "What is 2+2?"}]
    fmt = {"chat_template": True}
    full = sampler_tokens(tokenizer, row("c", messages=messages), **fmt)
    limit = full - 10
    kept, _ = fit_split([row("c", messages=messages)], split="train", limit=limit,
                        policy="truncate_left", count=counter(tokenizer, **fmt),
                        tokenizer=tokenizer)
    cut = kept[0]["messages"]
    assert cut[0] == messages[0] and cut[2:] == messages[2:]
    assert messages[1]["content"].endswith(cut[1]["content"])
    assert sampler_tokens(tokenizer, kept[0], **fmt) <= limit


def test_truncate_left_drops_a_row_whose_system_prompt_alone_does_not_fit(tokenizer):
    own_system = row("sys", messages=[{"role": "system", "content": " ".join([WORDS] * 3)},
                                      {"role": "user", "content": "2+2?"}])
    rows = [row("fits", "What is 2+2?"), own_system, row("long", "What is 2+2? " + WORDS)]
    limit = sampler_tokens(tokenizer, rows[0])
    kept, report = fit_split(rows, split="train", limit=limit, policy="truncate_left",
                             count=counter(tokenizer), tokenizer=tokenizer)
    assert [r["prompt_id"] for r in kept] == ["fits", "long"]
    assert report.truncated == ["long"] and report.dropped == ["sys"]
    with pytest.raises(ValueError, match="every train prompt is longer than 3 tokens"):
        fit_split(rows[1:2], split="train", limit=3, policy="truncate_left",
                  count=counter(tokenizer), tokenizer=tokenizer)


def test_error_policy_refuses_naming_the_rows(tokenizer):
    rows = [row("ok", "2+2?"), row("long-7", " ".join([WORDS] * 4))]
    with pytest.raises(ValueError, match=r"1 of 2 train prompts are longer than 8 tokens.*"
                                         r"long-7 \(\d+ tokens\).*long_prompt_policy=error"):
        fit_split(rows, split="train", limit=8, policy="error", count=counter(tokenizer),
                  tokenizer=tokenizer)


def write_split(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("policy,expected_size", [("drop", 3), ("truncate_left", 4)])
def test_a_run_serves_no_prompt_longer_than_the_samplers_take(tmp_path, tokenizer_dir, tokenizer,
                                                               policy, expected_size):
    model_dir = shutil.copytree(tokenizer_dir, tmp_path / "model")
    data = tmp_path / "data"
    data.mkdir()
    short = [{"question": f"What is {i}+2?", "answer": str(i + 2)} for i in range(3)]
    long = {"question": " ".join([WORDS] * 6) + " What is 2+2?", "answer": "4"}
    write_split(data / "train.jsonl", short[:1] + [long] + short[1:])
    write_split(data / "test.jsonl", [long, *short])
    cfg = load_config(None, [
        "trainer.data.task=files", f"trainer.data.path={data}", "sampler.max_sequence_length=40",
        "sampling.max_new_tokens=8", f"trainer.data.long_prompt_policy={policy}",
        "trainer.data.system_prompt=You are a careful solver."])
    assert cfg.prompt_token_limit() == 32  # max_sequence_length - max_new_tokens, by default
    stream = PromptStream.for_run(cfg, tokenizer=load_tokenizer(model_dir))
    assert stream.size == expected_size
    served = stream.next_batch(stream.size) + stream.eval_rows()
    assert len(served) == 2 * expected_size
    for r in served:
        assert len(encode_prompt(tokenizer, r["prompt"], r["messages"])) <= 32
    metrics = stream.length_metrics()
    assert metrics["data/long_prompts_dropped" if policy == "drop"
                   else "data/long_prompts_truncated"] == 2.0  # one in each split


def test_an_explicit_limit_beyond_the_samplers_is_a_config_error():
    with pytest.raises(ConfigError, match=r"max_prompt_tokens: 40 \+ sampling.max_new_tokens=8 "
                                          r"exceeds sampler.max_sequence_length=40"):
        load_config(None, ["sampler.max_sequence_length=40", "sampling.max_new_tokens=8",
                           "trainer.data.max_prompt_tokens=40"])
    cfg = load_config(None, ["sampler.max_sequence_length=40", "sampling.max_new_tokens=8",
                             "trainer.data.max_prompt_tokens=20"])
    assert cfg.prompt_token_limit() == 20
