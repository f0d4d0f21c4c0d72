"""SmolLM2-135M-Instruct in SplitRL against transformers on chat-rendered GSM8K questions.

- logits (float32): the same argmax at every position, and a max |difference| small against
  the logits' scale. Thirty real layers accumulate more rounding than the tiny random models'
  1e-6 (tests/splitrl/models/test_hf_parity.py); measured here: ~1.5e-4 on logits reaching
  ~40, against a smallest top-2 gap of ~2.6e-3 on these prompts;
- the sampler's greedy tokens equal `transformers.generate`'s greedy tokens, or first differ
  where transformers' own top two logits are a float near-tie;
- generation semantics as transformers has them: `max_new_tokens`, the eos ids of
  `generation_config.json` (several of them), the chat template with and without a system
  prompt, special tokens in prompts and completions.
"""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sampler_service.engine import GenerationEngine
from sampler_service.sampling import SamplingOptions
from sampler_service.server import generation_stop_ids
from splitrl.config import MeshConfig
from splitrl.mesh import build_mesh
from splitrl.models import apply, from_pretrained, left_pad_positions
from splitrl.tokenizer import decode, render_prompt, stop_string_cut

MAX_NEW = 32
IM_START, IM_END = 1, 2  # SmolLM2's ChatML ids; <|im_end|> is its eos and pad


@pytest.fixture(scope="module")
def model(smollm2):
    return from_pretrained(smollm2)


@pytest.fixture(scope="module")
def engine(model, smollm2, smollm2_tokenizer):
    graphdef, state = nnx.split(model)
    mesh = build_mesh(MeshConfig(axes={"tensor": 1}), jax.devices()[:1])
    stops = generation_stop_ids(str(smollm2), model.config, smollm2_tokenizer)
    engine = GenerationEngine(model.config, graphdef, mesh=mesh, max_batch_size=4,
                              max_sequence_length=192, eos_token_ids=stops, pad_token_id=IM_END,
                              segment_steps=16)
    yield engine, engine.place_state(state)
    engine.close()


@pytest.fixture(scope="module")
def greedy(engine, chat_prompts):
    """The engine's greedy completions of the chat prompts, ``MAX_NEW`` tokens at most. The
    tests that ask the engine more ask it for the same batch (every prompt, ``MAX_NEW``
    tokens) and read the first row: one batch shape, so one set of compiled programs."""
    eng, state = engine
    return [row for [row] in eng.generate(state, chat_prompts,
                                          SamplingOptions(temperature=0.0,
                                                          max_new_tokens=MAX_NEW))]


def _left_padded(prompts: list[list[int]]):
    width = max(map(len, prompts))
    tokens = np.full((len(prompts), width), IM_END, np.int32)
    mask = np.zeros((len(prompts), width), bool)
    for i, p in enumerate(prompts):
        tokens[i, width - len(p):] = p
        mask[i, width - len(p):] = True
    return tokens, mask


def _hf_logits(hf, tokens, mask, positions=None) -> np.ndarray:
    import torch

    kwargs = {"attention_mask": torch.tensor(mask, dtype=torch.long)}
    if positions is not None:
        kwargs["position_ids"] = torch.tensor(np.asarray(positions), dtype=torch.long)
    with torch.no_grad():
        return hf(torch.tensor(tokens, dtype=torch.long), **kwargs).logits.numpy()


def _hf_greedy(hf, prompts, generation_config, **kwargs) -> list[list[int]]:
    """transformers' greedy completions (left-padded batch), each cut after its first eos."""
    import torch

    tokens, mask = _left_padded(prompts)
    with torch.no_grad():
        out = hf.generate(torch.tensor(tokens, dtype=torch.long),
                          attention_mask=torch.tensor(mask, dtype=torch.long),
                          generation_config=generation_config, **kwargs)
    eos = set(np.atleast_1d(generation_config.eos_token_id).tolist())
    completions = []
    for row in out[:, tokens.shape[1]:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        completions.append(row[:end])
    return completions


def test_logits_match_transformers_on_chat_rendered_gsm8k(model, hf_smollm2, chat_prompts):
    tokens, mask = _left_padded(chat_prompts)
    positions = left_pad_positions(jnp.asarray(mask))
    graphdef, state = nnx.split(model)
    ours = np.asarray(jax.jit(apply, static_argnums=0)(
        graphdef, state, jnp.asarray(tokens), positions, attention_mask=jnp.asarray(mask))[0])
    ref = _hf_logits(hf_smollm2, tokens, mask, positions)
    ours, ref = ours[mask], ref[mask]
    diff, scale = float(np.abs(ours - ref).max()), float(np.abs(ref).max())
    top2 = np.sort(ref, axis=-1)[:, -2:]
    gap = float((top2[:, 1] - top2[:, 0]).min())
    print(f"SmolLM2 logits vs transformers over {len(ref)} positions: max |diff| {diff:.2e}, "
          f"max |logit| {scale:.1f}, smallest top-2 gap {gap:.2e}")
    assert scale > 10.0  # real logits, not a degenerate model
    assert diff <= 2e-5 * scale, (diff, scale)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_greedy_tokens_match_transformers_generate(greedy, hf_smollm2, smollm2,
                                                   smollm2_tokenizer, hf_smollm2_tokenizer,
                                                   chat_prompts):
    import transformers

    config = transformers.GenerationConfig.from_pretrained(smollm2, max_new_tokens=MAX_NEW,
                                                           do_sample=False, pad_token_id=IM_END)
    ref = _hf_greedy(hf_smollm2, chat_prompts, config)
    for prompt, seq, expected in zip(chat_prompts, greedy, ref, strict=True):
        tokens = list(seq.token_ids)
        if tokens != expected:  # only a float near-tie in transformers' own logits may differ
            k = next(i for i, (a, b) in enumerate(zip(tokens, expected, strict=False)) if a != b)
            ids = np.asarray([prompt + expected[:k]])
            last = _hf_logits(hf_smollm2, ids, np.ones_like(ids, bool))[0, -1]
            gap = float(last[expected[k]] - last[tokens[k]])
            assert gap <= 1e-3, f"greedy diverges at token {k} where transformers prefers " \
                                f"{expected[k]} over {tokens[k]} by {gap}"
            continue
        # max_new_tokens as transformers counts it, and "length" when no eos came first
        assert len(tokens) <= MAX_NEW
        assert seq.finish_reason == ("stop" if tokens[-1] == IM_END else "length")
        assert len(tokens) == MAX_NEW or seq.finish_reason == "stop"
        # completions decode as transformers decodes them, special tokens dropped
        assert decode(smollm2_tokenizer, tokens) == hf_smollm2_tokenizer.decode(
            expected, skip_special_tokens=True)


def test_generation_config_eos_ids_end_completions_as_in_transformers(
        engine, greedy, model, hf_smollm2, smollm2, smollm2_tokenizer, chat_prompts, tmp_path):
    """Two eos ids in generation_config.json, the second one a token the model writes a few
    tokens into its answer: both SplitRL and transformers stop right after it."""
    import transformers

    eng, state = engine
    prompt = chat_prompts[:1]
    tokens = list(greedy[0].token_ids)
    k = next(i for i in range(3, len(tokens)) if tokens[i] not in tokens[:i])
    checkpoint = tmp_path / "smollm2-two-eos"
    shutil.copytree(smollm2, checkpoint, ignore=shutil.ignore_patterns("*.safetensors"))
    (checkpoint / "model.safetensors").symlink_to(smollm2 / "model.safetensors")
    gen = json.loads((checkpoint / "generation_config.json").read_text())
    gen["eos_token_id"] = [IM_END, tokens[k]]
    (checkpoint / "generation_config.json").write_text(json.dumps(gen))

    # What a sampler serving `checkpoint` stops on (sampler_service.server.serve passes these
    # to its engine as eos ids; the engine stops on eos ids and a request's stop ids alike).
    stops = generation_stop_ids(str(checkpoint), model.config, smollm2_tokenizer)
    assert stops == [IM_END, tokens[k]]
    [seq], *_ = eng.generate(state, chat_prompts, SamplingOptions(
        temperature=0.0, max_new_tokens=MAX_NEW, stop_token_ids=stops))
    config = transformers.GenerationConfig.from_pretrained(checkpoint, max_new_tokens=MAX_NEW,
                                                           do_sample=False, pad_token_id=IM_END)
    assert list(seq.token_ids) == tokens[:k + 1] == _hf_greedy(hf_smollm2, prompt, config)[0]
    assert seq.finish_reason == "stop"


def test_stop_strings_end_completions_as_in_transformers(greedy, hf_smollm2, smollm2,
                                                         smollm2_tokenizer, hf_smollm2_tokenizer,
                                                         chat_prompts):
    """A word the model writes mid-answer as the stop string: the sampler's cut
    (`stop_string_cut`, applied by sampler_service.rollout to every completion) keeps what
    transformers' generate(stop_strings=...) generates."""
    import transformers

    prompt = chat_prompts[:1]
    tokens = list(greedy[0].token_ids)
    stop = decode(smollm2_tokenizer, tokens).split()[6]  # a word, not a whole token, maybe
    keep = stop_string_cut(smollm2_tokenizer, tokens, [stop])
    assert keep is not None and keep < len(tokens)
    assert stop in decode(smollm2_tokenizer, tokens[:keep])
    assert stop not in decode(smollm2_tokenizer, tokens[:keep - 1])
    config = transformers.GenerationConfig.from_pretrained(
        smollm2, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=IM_END,
        stop_strings=[stop])
    assert _hf_greedy(hf_smollm2, prompt, config, tokenizer=hf_smollm2_tokenizer)[0] == \
        tokens[:keep]
    assert stop_string_cut(smollm2_tokenizer, tokens, ["never written"]) is None


@pytest.mark.parametrize("system_prompt", [None, "You are a careful math tutor."])
def test_chat_template_renders_and_encodes_as_transformers(smollm2_tokenizer,
                                                           hf_smollm2_tokenizer,
                                                           gsm8k_questions, system_prompt):
    from splitrl.tokenizer import encode_prompt

    question = gsm8k_questions[0]
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": question}]
    expected = hf_smollm2_tokenizer.apply_chat_template(messages, tokenize=False,
                                                     add_generation_prompt=True)
    rendered = render_prompt(smollm2_tokenizer, question, system_prompt=system_prompt,
                             use_chat_template=True)
    assert rendered == expected
    # SmolLM2's template puts its own system turn in when the messages have none
    assert ("You are a helpful AI assistant named SmolLM" in rendered) == (system_prompt is None)
    ids = encode_prompt(smollm2_tokenizer, question, system_prompt=system_prompt,
                        use_chat_template=True)
    hf_ids = hf_smollm2_tokenizer.apply_chat_template(messages, tokenize=True,
                                                   add_generation_prompt=True, return_dict=True)
    assert ids == list(hf_ids["input_ids"])
    # the special tokens written by the template are single ids: 3 turn starts, 2 turn ends
    assert ids.count(IM_START) == 3 and ids.count(IM_END) == 2
