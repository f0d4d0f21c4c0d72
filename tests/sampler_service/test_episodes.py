"""Multi-turn episodes in the sampler (``sampler_service.episodes``): the trajectory is the
generated ids followed by the chat template's observation ids, the loss mask covers exactly the
model's tokens, limits end episodes, and lock-step turns for reproducible requests.

The tokenizer, chat template, environment (``lookup``, in real isolated workers) and renderer
are the real ones; the model is replaced by a scripted policy (`ScriptedEngine`: it calls the
tool, then answers with the digit the observation showed), because what is under test is the
bookkeeping around turns, and a random model calls tools only by chance. The e2e test
(tests/e2e/test_tools.py) runs the real engine."""

from __future__ import annotations

import queue
import threading

import pytest

from sampler_service.episodes import Episodes, Trajectory, turn_seed
from sampler_service.requests import FinishedGroup, GeneratedSequence
from sampler_service.sampling import SamplingOptions
from splitrl.config import EnvironmentConfig
from splitrl.init_model import init_model
from splitrl.tokenizer import eos_token_ids, load_tokenizer


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory):
    return init_model(tmp_path_factory.mktemp("tools") / "m", vocab="lookup")


@pytest.fixture(scope="module")
def tokenizer(tools_model):
    return load_tokenizer(tools_model)


class ScriptedEngine:
    """Answers each prompt like a model that learned the task: ``!`` (call) then the end of
    the turn, or, once an observation ``=d`` is in its context, ``d`` then the end. Records
    every request (prompts, seeds, exclusive) and delivers from a thread, as the engine does."""

    def __init__(self, tokenizer, always_call: bool = False, call_end: str | None = None,
                 new_version_per_request: bool = False):
        self.tok = tokenizer
        self.stop = eos_token_ids(tokenizer)[-1]
        self.always_call = always_call
        # the token after "!" (default: the end of the turn), e.g. what a stop string cuts
        self.call_end = self.stop if call_end is None else tokenizer.convert_tokens_to_ids(
            call_end)
        self.new_version_per_request = new_version_per_request  # a push between turns
        self.requests: list[tuple[list[list[int]], list[int], bool]] = []
        self.version = 3

    def turn(self, prompt: list[int]) -> list[int]:
        eq = self.tok.convert_tokens_to_ids("=")
        if eq in prompt and not self.always_call:
            return [prompt[len(prompt) - 1 - prompt[::-1].index(eq) + 1], self.stop]
        return [self.tok.convert_tokens_to_ids("!"), self.call_end]

    def submit(self, prompts, options, n, *, seeds, exclusive, sink):
        self.requests.append(([list(p) for p in prompts], list(seeds), exclusive))
        if self.new_version_per_request and len(self.requests) > 1:
            self.version += 1

        def deliver():
            for i, p in enumerate(prompts):
                ids = self.turn(list(p))[:options.max_new_tokens]
                reason = "stop" if ids[-1] == self.stop else "length"
                seqs = [GeneratedSequence(ids, [-0.5] * len(ids), reason, (self.version,))
                        for _ in range(n)]
                sink.put(FinishedGroup(i, seqs, 0.0, 0.001))
            sink.put(None)

        threading.Thread(target=deliver, daemon=True).start()
        return self

    def cancel(self):
        pass


def run(episodes, prompts, n=2, exclusive=True, columns=None, stop_token_ids=(),
        temperature=1.0, stop_strings=(), seeds=None):
    events = queue.SimpleQueue()
    keys = episodes.new_keys(len(prompts), n)
    _, failed = episodes.reset(keys, columns or [{"secret": 7}] * len(prompts))
    options = SamplingOptions(temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=2,
                              stop_token_ids=stop_token_ids, seed=0, greedy=False)
    seeds = [11] * len(prompts) if seeds is None else seeds
    episodes.run(prompts, seeds, keys, options, n, exclusive=exclusive,
                 sink=events, failed=failed, stop_strings=stop_strings)
    groups = {}
    while (event := events.get(timeout=60)) is not None:
        if isinstance(event, BaseException):
            raise event
        groups[event.index] = event.sequences
    return groups


def make(tokenizer, engine, **cfg):
    return Episodes(EnvironmentConfig(name="lookup", workers=1, **cfg), tokenizer, engine, 32,
                    stop_token_ids=eos_token_ids(tokenizer))


def test_trajectory_is_generated_ids_then_rendered_observation_ids(tokenizer):
    engine = ScriptedEngine(tokenizer)
    episodes = make(tokenizer, engine, options={"call_reward": 0.25})
    try:
        prompt = tokenizer.encode("?", add_special_tokens=False)
        groups = run(episodes, [prompt, prompt], columns=[{"secret": 7}, {"secret": 3}])
        obs7 = episodes.renderer.ids([("lookup", "7")])
        assert obs7 == tokenizer.encode("=7", add_special_tokens=False)
        for index, digit in ((0, "7"), (1, "3")):
            for t in groups[index]:
                assert isinstance(t, Trajectory)
                call = engine.turn(prompt)
                obs = episodes.renderer.ids([("lookup", digit)])
                answer = [tokenizer.convert_tokens_to_ids(digit), engine.stop]
                assert t.token_ids == call + obs + answer
                assert t.model_token_mask == [True] * 2 + [False] * len(obs) + [True] * 2
                assert t.logprobs == [-0.5, -0.5] + [0.0] * len(obs) + [-0.5, -0.5]
                assert t.answer_ids == answer and t.episode_end == "answer"
                assert [(x.start, x.generated, x.observation) for x in t.turns] == [
                    (0, 2, len(obs)), (2 + len(obs), 2, 0)]
                assert t.turns[0].tool_calls[0]["status"] == "ok"
                assert [m["role"] for m in t.messages] == ["assistant", "tool", "assistant"]
                assert t.messages[1] == {"role": "tool", "name": "lookup", "content": digit}
                assert t.env_reward == 0.25 and t.weight_versions == (3,)
        # Lock-step: the first turn is one request (n rows per prompt); the second turn of all
        # four episodes is one more, in (prompt, sample) order, with per-turn seeds.
        first, second = engine.requests
        assert first[0] == [prompt, prompt] and first[2] is True
        assert len(second[0]) == 4 and second[2] is True
        assert second[1] == [turn_seed(11, j, 1) for _ in range(2) for j in range(2)]
    finally:
        episodes.close()


def test_limits_end_episodes(tokenizer):
    engine = ScriptedEngine(tokenizer, always_call=True)
    episodes = make(tokenizer, engine, max_turns=3, truncation="mask")
    try:
        prompt = tokenizer.encode("?", add_special_tokens=False)
        (t, _), = run(episodes, [prompt], exclusive=False).values()
        assert t.episode_end == "max_turns" and len(t.turns) == 3 and t.truncated
        assert not any(t.model_token_mask)  # truncation: mask
    finally:
        episodes.close()
    episodes = make(tokenizer, engine, max_tool_calls=1)
    try:
        (t, _), = run(episodes, [prompt]).values()
        assert t.episode_end == "max_tool_calls" and len(t.turns) == 2
        assert sum(t.model_token_mask) == 4
    finally:
        episodes.close()
    episodes = make(tokenizer, engine, max_total_tokens=5)
    try:
        (t, _), = run(episodes, [prompt]).values()
        assert t.episode_end == "max_total_tokens" and len(t.token_ids) == 5
        assert t.finish_reason == "length"
    finally:
        episodes.close()


def test_a_failed_reset_ends_its_episode_after_one_turn(tokenizer):
    engine = ScriptedEngine(tokenizer)
    episodes = make(tokenizer, engine)
    try:
        prompt = tokenizer.encode("?", add_special_tokens=False)
        (t, _), = run(episodes, [prompt], columns=[{}]).values()  # no `secret`: reset raises
        assert t.episode_end == "reset_failed" and len(t.turns) == 1
    finally:
        episodes.close()


def test_a_turn_ends_at_a_stop_string_and_the_episode_goes_on(tokenizer):
    """``sampling.stop_strings`` end a turn as they end a single-turn completion: the turn
    "!9" (no stop token: its budget ran out) is cut after "!", a call, and the episode goes
    on; without the stop string the same turn ends the episode (``length``)."""
    engine = ScriptedEngine(tokenizer, call_end="9")
    episodes = make(tokenizer, engine)
    try:
        prompt = tokenizer.encode("?", add_special_tokens=False)
        (t, _), = run(episodes, [prompt], stop_strings=["!"]).values()
        bang = tokenizer.convert_tokens_to_ids("!")
        assert t.token_ids[:1] == [bang] and t.turns[0].generated == 1
        assert t.episode_end == "answer" and t.turns[0].tool_calls[0]["status"] == "ok"
        assert t.logprobs[:1] == [-0.5] and t.model_token_mask[:2] == [True, False]
        (t, _), = run(episodes, [prompt]).values()
        assert t.episode_end == "length" and t.token_ids == [bang, engine.call_end]
    finally:
        episodes.close()


def test_a_trajectory_records_the_weight_version_of_each_turn(tokenizer):
    """With a push between two turns (in-flight updates, async runs), each turn records the
    version it was generated with and the trajectory all of them, oldest first: what the
    trainer's staleness check and importance ratios read."""
    engine = ScriptedEngine(tokenizer, new_version_per_request=True)
    episodes = make(tokenizer, engine)
    try:
        prompt = tokenizer.encode("?", add_special_tokens=False)
        for t in run(episodes, [prompt], n=1, exclusive=False)[0]:
            assert [turn.weight_versions for turn in t.turns] == [(3,), (4,)]
            assert t.weight_versions == (3, 4)
    finally:
        episodes.close()


def test_tool_latency_never_changes_a_reproducible_requests_trajectories(tools_model,
                                                                        tokenizer):
    """The real engine and a random model: the same reproducible episodes with no tool delay
    and with delays that reorder the tools' returns give bitwise the same trajectories (turns
    are keyed by episode and turn, and lock-step turns decode together whatever the timing)."""
    import jax
    from flax import nnx

    from sampler_service.engine import GenerationEngine
    from splitrl.config import MeshConfig
    from splitrl.mesh import build_mesh
    from splitrl.models import from_pretrained

    model = from_pretrained(tools_model)
    graphdef, state = nnx.split(model)
    mesh = build_mesh(MeshConfig(axes={"tensor": 1}), jax.devices()[:1])
    engine = GenerationEngine(model.config, graphdef, mesh=mesh, max_batch_size=64,
                              max_sequence_length=32, eos_token_ids=eos_token_ids(tokenizer),
                              pad_token_id=0, weights=lambda: (0, state))
    # A random model starts a turn with "!" (a call) by chance: at a high temperature (nearly
    # uniform draws), with every other token ending the turn, about one turn in 24 is a call.
    bang = tokenizer.convert_tokens_to_ids("!")
    stops = tuple(t for t in range(model.config.vocab_size) if t != bang)
    prompt = tokenizer.encode("?", add_special_tokens=False)
    columns = [{"secret": i} for i in range(16)]
    runs = []
    try:
        for latency in (0.0, 0.05):
            episodes = Episodes(EnvironmentConfig(
                name="tests.splitrl.environment_fixtures:DelayedLookup",
                options={"latency_s": latency}, workers=4, max_turns=3), tokenizer, engine,
                32, stop_token_ids=eos_token_ids(tokenizer))
            try:
                runs.append(run(episodes, [prompt] * 16, n=8, columns=columns,
                                stop_token_ids=stops, temperature=30.0,
                                seeds=list(range(16))))
            finally:
                episodes.close()
    finally:
        engine.close()
    quick, slow = ([(t.token_ids, t.logprobs, t.model_token_mask, t.episode_end)
                    for i in sorted(r) for t in r[i]] for r in runs)
    assert quick == slow
    calls = sum(len(turn.tool_calls) for ts in runs[0].values() for t in ts for turn in t.turns)
    assert calls >= 2  # the delays had calls to reorder
