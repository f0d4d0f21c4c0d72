"""RolloutWorker without gRPC or devices: sampling defaults, validation, UTF-8 handling."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest

from sampler_service.rollout import RequestError, RolloutWorker
from splitrl.config import SamplingConfig
from splitrl.v1 import common_pb2


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from splitrl.tokenizer import load_tokenizer, train_bpe_tokenizer

    path = train_bpe_tokenizer(["héllo wörld ünïcode ✓ 1+2=3"] * 4,
                               tmp_path_factory.mktemp("tok"), vocab_size=300, min_frequency=1)
    return load_tokenizer(path)


def _worker(tokenizer=None, vocab=300):
    engine = SimpleNamespace(max_batch_size=8, max_sequence_length=32)
    weights = SimpleNamespace(config=SimpleNamespace(vocab_size=vocab), version=0)
    return RolloutWorker(engine, weights, tokenizer=tokenizer,
                         sampling=SamplingConfig(max_new_tokens=5, stop_token_ids=[4]),
                         reward=None, sampler_id="s")


def test_zero_fields_take_the_documented_defaults():
    worker = _worker()
    opts = worker.sampling_options(common_pb2.SamplingParams())
    assert opts.is_greedy and opts.max_new_tokens == 5 and opts.stop_token_ids == (4,)
    assert opts.top_p == 1.0 and opts.top_k == 0
    a = worker.sampling_options(common_pb2.SamplingParams(temperature=0.7))
    b = worker.sampling_options(common_pb2.SamplingParams(temperature=0.7))
    assert not a.is_greedy and a.seed != b.seed  # no seed given: a fresh one per request
    seeded = worker.sampling_options(common_pb2.SamplingParams(has_seed=True, seed=0, top_p=0.5,
                                                               top_k=5, max_new_tokens=3))
    assert (seeded.seed, seeded.top_p, seeded.top_k, seeded.max_new_tokens) == (0, 0.5, 5, 3)


@pytest.mark.parametrize(("params", "fragment"), [
    (dict(temperature=float("nan")), "sampling.temperature"),
    (dict(top_k=-1), "sampling.top_k"),
    (dict(top_p=-0.1), "sampling.top_p"),
    (dict(max_new_tokens=32), "sampling.max_new_tokens"),
    (dict(stop_token_ids=[300]), "sampling.stop_token_ids"),
])
def test_bad_sampling_params_are_invalid_argument(params, fragment):
    with pytest.raises(RequestError) as e:
        _worker().sampling_options(common_pb2.SamplingParams(**params))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and fragment in e.value.message


@pytest.mark.parametrize("temperature", [1e-38, 1e-30, 9e-6])
def test_temperatures_that_overflow_the_logits_are_refused_with_the_bound(temperature):
    # 1e-38 used to pass and sample token 0 with logprob -inf for every row.
    with pytest.raises(RequestError) as e:
        _worker().sampling_options(common_pb2.SamplingParams(temperature=temperature))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.temperature: expected 0 (greedy) or 1e-05 <= temperature <= 100" in (
        e.value.message)
    assert not _worker().sampling_options(common_pb2.SamplingParams(temperature=1e-5)).is_greedy


def test_text_prompts_need_a_tokenizer_and_roles_are_checked(tokenizer):
    with pytest.raises(RequestError) as e:
        _worker().prepare([common_pb2.Prompt(text="hi")], 4)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "no tokenizer" in e.value.message
    worker = _worker(tokenizer)
    (p,) = worker.prepare([common_pb2.Prompt(text="héllo", reference="r")], 4)
    assert p.prompt_id == "0" and p.text == "héllo" and p.token_ids
    with pytest.raises(RequestError, match=r"prompts\[0\]\.messages\[0\]\.role"):
        worker.prepare([common_pb2.Prompt(messages=[common_pb2.ChatMessage(content="x")])], 4)
    (chat,) = worker.prepare([common_pb2.Prompt(
        messages=[common_pb2.ChatMessage(role="user", content="1+2=")])], 4)
    assert chat.text.startswith("<|im_start|>user") and chat.text.endswith("assistant\n")


def test_invalid_utf8_completions_carry_their_raw_bytes(tokenizer):
    worker = _worker(tokenizer)
    ids = tokenizer.encode("✓", add_special_tokens=False)
    text, raw = worker._decode(ids)
    assert text == "✓" and raw is None
    # The first byte of a 3-byte character alone is not valid UTF-8.
    # (byte-level BPE: the first character of a token string stands for its first byte)
    first_byte = tokenizer.convert_tokens_to_ids(tokenizer.convert_ids_to_tokens(ids)[0][0])
    text, raw = worker._decode([first_byte])
    assert "\ufffd" in text and raw == "✓".encode()[:1]
