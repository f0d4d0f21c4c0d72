"""GenerationEngine: greedy equals a no-cache reference, seeds, top-k support, logprobs, n per
prompt from one prefill, EOS / stop tokens, length limits, refusals, and a 2-device
tensor-parallel mesh. (Admission timing, exclusive requests and the budget:
test_continuous_batching.py.)

Programs are shared between tests (same buckets) to keep compilation to a handful.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import threading
import weakref
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sampler_service import _programs
from sampler_service.engine import GenerationEngine
from sampler_service.sampling import SamplingOptions
from splitrl.config import MeshConfig
from splitrl.mesh import build_mesh
from splitrl.models import TransformerConfig, apply, init_random

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [20]]
CONFIG = dict(family="qwen2", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2,
              num_heads=4, num_kv_heads=2, head_dim=8, attention_bias=True)


def tiny_model():
    # std 0.3 makes the random model's next-token distribution far from uniform.
    return init_random(TransformerConfig(**CONFIG), seed=0, std=0.3)


def make_engine(model, mesh, **kw):
    # One segment length for every test's engines: it is part of the decode program's shape.
    args = dict(max_batch_size=8, max_sequence_length=32, eos_token_ids=(), pad_token_id=0,
                segment_steps=4)
    args.update(kw)
    graphdef, state = nnx.split(model)
    engine = GenerationEngine(model.config, graphdef, mesh=mesh, **args)
    return engine, engine.place_state(state)


@pytest.fixture(scope="module")
def setup():
    model = tiny_model()
    mesh = build_mesh(MeshConfig(axes={"tensor": 1}), jax.devices()[:1])
    engine, state = make_engine(model, mesh)
    return model, mesh, engine, state


_REF_LEN = 32


@jax.jit
def _full_forward(state, tokens):
    logits, _ = apply(_GRAPHDEF, state, tokens)
    return logits


_GRAPHDEF = nnx.split(tiny_model())[0]


def full_logits(model, tokens):
    """Last-position logits of the model's full forward (no cache) for one sequence.

    The sequence is right-padded to a fixed length (one compile); causal attention makes the
    padding invisible to position len - 1.
    """
    padded = np.zeros((1, _REF_LEN), np.int32)
    padded[0, :len(tokens)] = tokens
    logits = _full_forward(nnx.state(model), jnp.asarray(padded))
    return np.asarray(logits[0, len(tokens) - 1], np.float64)


def greedy_reference(model, prompt, max_new, stops=()):
    seq, out = list(prompt), []
    for _ in range(max_new):
        tok = int(np.argmax(full_logits(model, seq)))
        out.append(tok)
        seq.append(tok)
        if tok in stops:
            break
    return out


def log_softmax(x):
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def test_greedy_equals_full_forward_reference_and_stops_at_length(setup):
    model, _, engine, state = setup
    out = engine.generate(state, PROMPTS, SamplingOptions(greedy=True, max_new_tokens=12))
    for prompt, (seq,) in zip(PROMPTS, out, strict=True):
        assert seq.token_ids == greedy_reference(model, prompt, 12)
        assert seq.finish_reason == "length" and len(seq.logprobs) == 12
        ref_lp = [log_softmax(full_logits(model, prompt + seq.token_ids[:i]))[t]
                  for i, t in enumerate(seq.token_ids)]
        np.testing.assert_allclose(seq.logprobs, ref_lp, atol=1e-4)


def test_stop_token_ends_the_sequence_with_finish_reason_stop(setup):
    model, _, engine, state = setup
    free = engine.generate(state, PROMPTS, SamplingOptions(greedy=True, max_new_tokens=12))
    stop = free[1][0].token_ids[4]
    out = engine.generate(state, PROMPTS,
                          SamplingOptions(greedy=True, max_new_tokens=12, stop_token_ids=[stop]))
    for prompt, (seq,) in zip(PROMPTS, out, strict=True):
        expect = greedy_reference(model, prompt, 12, stops=(stop,))
        assert seq.token_ids == expect
        assert seq.finish_reason == ("stop" if expect[-1] == stop else "length")
    seq = out[1][0]
    assert seq.finish_reason == "stop" and seq.token_ids[-1] == stop
    assert stop not in seq.token_ids[:-1] and len(seq.token_ids) <= 5


def test_engine_eos_ids_stop_generation(setup):
    model, mesh, engine, state = setup
    greedy = SamplingOptions(greedy=True, max_new_tokens=12)
    free = engine.generate(state, PROMPTS, greedy)[0][0].token_ids
    eos = free[2]
    eos_engine, eos_state = make_engine(model, mesh, eos_token_ids=[eos])
    seq = eos_engine.generate(eos_state, PROMPTS, greedy)[0][0]
    assert seq.finish_reason == "stop" and seq.token_ids[-1] == eos
    assert seq.token_ids == free[:free.index(eos) + 1]


SAMPLED = SamplingOptions(temperature=0.7, top_k=3, max_new_tokens=10, seed=123)


def test_sampled_logprobs_match_full_forward_and_stay_in_top_k(setup):
    model, _, engine, state = setup
    out = engine.generate(state, PROMPTS[:2], SAMPLED, n=4)
    for prompt, seqs in zip(PROMPTS[:2], out, strict=True):
        for seq in seqs:
            assert len(seq.token_ids) == 10 and seq.finish_reason == "length"
            for i, tok in enumerate(seq.token_ids):
                logits = full_logits(model, prompt + seq.token_ids[:i])
                assert tok in np.argsort(-logits)[:3]
                # Reported under softmax(logits / T) before top-k truncation.
                assert abs(seq.logprobs[i] - log_softmax(logits / 0.7)[tok]) <= 1e-4


def test_n_samples_per_prompt_come_from_one_prefill_and_differ(setup):
    _, _, engine, state = setup
    before = engine.stats["prefills"]
    out = engine.generate(state, PROMPTS[:2], SAMPLED, n=4)
    assert engine.stats["prefills"] - before == 2
    for seqs in out:
        assert len(seqs) == 4
        assert len({tuple(s.token_ids) for s in seqs}) == 4


def test_same_seed_reproduces_regardless_of_batching(setup):
    model, mesh, engine, state = setup
    a = engine.generate(state, PROMPTS[:2], SAMPLED, n=4)
    b = engine.generate(state, PROMPTS[:2], SAMPLED, n=4)
    assert a == b
    other = engine.generate(state, PROMPTS[:2], SamplingOptions(**{**SAMPLED.__dict__,
                                                                    "seed": 124}), n=4)
    assert other != a
    # One prompt per batch (max_batch_size = n): same samples as the 2-prompt batch.
    small, small_state = make_engine(model, mesh, max_batch_size=4)
    c = small.generate(small_state, PROMPTS[:2], SAMPLED, n=4)
    assert small.max_batch_size == 4 and small.stats["peak_active_sequences"] == 4
    for sa, sc in zip(a, c, strict=True):
        for x, y in zip(sa, sc, strict=True):
            assert x.token_ids == y.token_ids
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)


def test_a_weight_state_is_served_once_and_let_go_with_it(setup):
    """The engine's batches take a weight state's leaves as the programs read them (on CPU
    each layer's views) from one entry made on first use, not again per request; a state its
    owner drops (a replaced weight version) takes its entry with it, holding nothing alive."""
    model, _, engine, state = setup
    served = engine.scheduler.served
    assert all(s.served is served for s in engine.schedulers)
    leaves, programs = served.get(state)
    engine.generate(state, PROMPTS[:1], SAMPLED)
    assert served.get(state)[0] is leaves and served.get(state)[1] is programs
    newer = engine.place_state(nnx.state(model))  # another version's state object
    newer_leaves = served.get(newer)[0]
    assert newer_leaves is not leaves and served.get(newer)[0] is newer_leaves
    last_view = weakref.ref(newer_leaves[-1])  # a layer's parameter, apart (CPU)
    del newer, newer_leaves
    gc.collect()
    assert last_view() is None


def test_pushed_weights_are_served_ahead_of_the_next_batch(setup, monkeypatch):
    """`serve_ahead` (a push's transport calls it once it has answered) makes the newest
    weights' served form on a thread of its own: the next batch takes it as made instead of
    making it between the request's arrival and its prefill, and decodes what the same state
    decodes when served on demand."""
    model, mesh, _, state = setup
    made: list[str] = []  # the thread that made each served form
    make = _programs.served_weights

    def recorded(weights, layers_apart):
        made.append(threading.current_thread().name)
        return make(weights, layers_apart)

    monkeypatch.setattr(_programs, "served_weights", recorded)
    serving = [0, state]
    engine, _ = make_engine(model, mesh, weights=lambda: tuple(serving))
    try:
        pushed = engine.place_state(nnx.state(model))  # a new version's state object
        serving[:] = [1, pushed]
        engine.serve_ahead().join(timeout=60)
        assert made == ["serve-ahead"]
        (ahead,) = engine.submit(PROMPTS[:1], SAMPLED).result()
        assert made == ["serve-ahead"]  # the batch found it made
        (pinned,) = engine.generate(pushed, PROMPTS[:1], SAMPLED, version=1)
        assert [s.token_ids for s in ahead] == [s.token_ids for s in pinned]
        assert made == ["serve-ahead"]  # the same state: one served form for both paths
    finally:
        engine.close()


def test_chunked_prefill_gives_the_same_tokens_as_one_prefill(setup):
    """Prompts prefilled in chunks of at most 16 packed tokens give the tokens of one packed
    prefill of them all, greedy and sampled: a row's noise is keyed by (prompt seed, sample
    index, admission version), not by the chunk that prefilled it, so the same seed draws the
    same tokens (logprobs equal up to the last bits of differently shaped prefills)."""
    model, mesh, _, _ = setup
    prompts = PROMPTS + [[30, 31, 32, 33, 34, 35], [40, 41, 42, 43, 44, 45, 46, 47, 48], [50]]
    engine, state = make_engine(model, mesh, max_batch_size=16)  # every row admitted at once
    chunked, chunked_state = make_engine(model, mesh, max_batch_size=16,
                                         prefill_chunk_tokens=16)
    for options, n in ((SamplingOptions(max_new_tokens=6), 1), (SAMPLED, 2)):
        before = engine.stats["prefill_chunks"]
        whole = engine.generate(state, prompts, options, n=n)
        assert engine.stats["prefill_chunks"] - before == 1
        before = chunked.stats["prefill_chunks"]
        parts = chunked.generate(chunked_state, prompts, options, n=n)
        # prompts of 3 + 10 + 1 and 6 + 9 + 1 tokens: two packed rows of 16, one per chunk
        assert chunked.stats["prefill_chunks"] - before == 2
        for a, b in zip(whole, parts, strict=True):
            for x, y in zip(a, b, strict=True):
                assert x.token_ids == y.token_ids
                np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)


def test_too_long_prompt_is_rejected_with_index_and_lengths(setup):
    _, _, engine, state = setup
    prompts = [[1, 2], list(range(1, 28))]
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt length 27 \+ max_new_tokens 8 "
                                         r"= 35 exceeds max_sequence_length 32"):
        engine.generate(state, prompts, SamplingOptions(max_new_tokens=8))
    with pytest.raises(ValueError, match=r"prompts\[0\]: token ids must be in \[0, 96\)"):
        engine.generate(state, [[96]], SamplingOptions())
    with pytest.raises(ValueError, match=r"n: expected an integer >= 1"):
        engine.generate(state, [[1]], SamplingOptions(), n=0)


def test_requests_that_can_never_fit_are_refused_with_the_numbers(setup):
    model, mesh, engine, state = setup
    with pytest.raises(ValueError, match=r"n: 9 completions of one prompt are decoded "
                                         r"together, but at most 8 rows fit"):
        engine.generate(state, [[1]], SamplingOptions(), n=9)
    # 32 slots x 256 bytes, + one layer's keys (the CPU's cache holds each layer apart)
    with pytest.raises(ValueError, match=r"kv_cache_bytes 1000 holds no sequence of "
                                         r"max_sequence_length 32 \(one needs 10240 bytes"):
        make_engine(model, mesh, kv_cache_bytes=1000)


_TP_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax
    sys.path.insert(0, sys.argv[1])
    from tests.sampler_service.test_engine import PROMPTS, make_engine, tiny_model
    from sampler_service.sampling import SamplingOptions
    from splitrl.config import MeshConfig
    from splitrl.mesh import build_mesh
    assert jax.device_count() == 2
    mesh = build_mesh(MeshConfig(axes={"tensor": 2}, strategy="tp"))
    engine, state = make_engine(tiny_model(), mesh)
    sharded = [str(x.sharding.spec) for x in jax.tree.leaves(state)
               if len(x.sharding.device_set) == 2]
    out = engine.generate(state, PROMPTS, SamplingOptions(greedy=True, max_new_tokens=12))
    print(json.dumps({"tokens": [s[0].token_ids for s in out], "sharded": sharded}))
""")


def test_two_device_tensor_parallel_mesh_gives_the_same_greedy_output(setup):
    model = setup[0]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _TP_SCRIPT, str(REPO)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert any("tensor" in spec for spec in result["sharded"])
    assert result["tokens"] == [greedy_reference(model, p, 12) for p in PROMPTS]
