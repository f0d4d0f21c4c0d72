"""Reward models in the reward service: a ``reward.functions`` entry scores with a
``reward.models`` checkpoint, weighted like any function, batched across requests.

The reward model is the tiny one `splitrl init-model --score-labels 1` writes; its forward is
checked against transformers in tests/splitrl/models/test_sequence_classifier.py.
"""

from __future__ import annotations

import threading

import jax.numpy as jnp
import numpy as np
import pytest

from reward_service.scoring import Item, RewardScorer
from splitrl.config import RewardConfig
from splitrl.init_model import init_model

# One emulated device of the test process's eight, as a reward service on one device has.
MESH = {"axes": {"fsdp": 1}, "device_fraction": 0.125}
COMPLETIONS = ["5", "6", "12+3=15", "", "2+3=5 5 5 5 5 5"]


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    return init_model(tmp_path_factory.mktemp("rm") / "tiny-rm", preset="tiny",
                      vocab="arithmetic", score_labels=1, seed=1)


@pytest.fixture(scope="module")
def scorer(reward_model):
    cfg = RewardConfig.model_validate({
        "functions": [{"name": "rm", "weight": 2.0}, {"name": "exact_answer"}],
        "models": [{"name": "rm", "path": str(reward_model), "max_batch_tokens": 256,
                    "max_length": 40}],
        "mesh": MESH, "workers": 1})
    scorer = RewardScorer(cfg)
    yield scorer
    scorer.close()


def _items(prompt: str = "2+3=", group: str = "g") -> list[Item]:
    return [Item(prompt=prompt, completion=c, reference="5", group_id=group, item_id=str(i))
            for i, c in enumerate(COMPLETIONS)]


def test_reward_model_scores_the_chat_rendered_conversation(scorer, reward_model):
    from splitrl.models.sequence_classifier import load_sequence_classifier
    from splitrl.tokenizer import encode_rendered, load_tokenizer

    results = scorer.score(_items())
    tokenizer = load_tokenizer(reward_model)
    model = load_sequence_classifier(reward_model)
    for result, completion in zip(results, COMPLETIONS, strict=True):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "2+3="}, {"role": "assistant", "content": completion}],
            tokenize=False)
        ids = encode_rendered(tokenizer, text)
        want = float(model(jnp.asarray([ids], jnp.int32), jnp.asarray([len(ids)]))[0, 0])
        assert result.statuses["rm"] == "ok"
        assert result.scores["rm"] == pytest.approx(want, abs=1e-5)
        assert result.total == pytest.approx(2.0 * result.scores["rm"]
                                              + result.scores["exact_answer"])
    assert len({r.scores["rm"] for r in results}) == len(COMPLETIONS)


def test_scores_are_the_same_alone_or_batched_with_other_requests(scorer):
    alone = [scorer.score([item], ["rm"])[0].scores["rm"] for item in _items()]
    together = [r.scores["rm"] for r in scorer.score(_items(), ["rm"])]
    assert together == alone  # bitwise: one program shape per length, whoever shares it
    concurrent: dict[str, list[float]] = {}

    def request(prompt: str) -> None:
        concurrent[prompt] = [r.scores["rm"] for r in scorer.score(_items(prompt, prompt))]

    threads = [threading.Thread(target=request, args=(p,)) for p in ("2+3=", "7+8=", "1+1=")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert concurrent["2+3="] == alone
    assert concurrent["7+8="] != alone


def test_an_input_over_max_length_scores_an_error_and_the_rest_score(scorer):
    from prometheus_client import REGISTRY

    def errors():
        return REGISTRY.get_sample_value("splitrl_reward_model_errors_total", {"model": "rm"})

    before = errors() or 0.0
    items = [Item(prompt="2+3=", completion="5"), Item(prompt="2+3=", completion="1" * 60)]
    ok, long = scorer.score(items, ["rm"])
    assert ok.statuses["rm"] == "ok"
    assert long.statuses["rm"] == "error" and long.scores["rm"] == 0.0
    assert "max_length=40" in long.reasons["rm"]
    assert errors() == before + 1
    forwards = REGISTRY.get_sample_value("splitrl_reward_model_batch_rows_count", {"model": "rm"})
    assert forwards and forwards > 0  # per-model metrics: forwards and their batch sizes


def test_reward_model_listed_with_its_weight(scorer, reward_model):
    described = {spec.name: (spec.weight, text, style)
                 for spec, text, style in scorer.describe()}
    assert described["rm"] == (2.0, f"reward model {reward_model}", "model")


def test_reward_model_config_errors_name_the_entry(reward_model):
    with pytest.raises(ValueError, match=r"reward.models\[0\].name: 'rm' is not used"):
        RewardConfig.model_validate({"functions": [{"name": "exact_answer"}],
                                     "models": [{"name": "rm", "path": str(reward_model)}]})
    cfg = RewardConfig.model_validate({
        "functions": [{"name": "rm", "options": {"x": 1}}],
        "models": [{"name": "rm", "path": str(reward_model)}], "mesh": MESH})
    with pytest.raises(ValueError, match=r"reward.functions\[0\].options: 'rm' is a reward"):
        RewardScorer(cfg)
    cfg = RewardConfig.model_validate({
        "functions": [{"name": "rm"}],
        "models": [{"name": "rm", "path": str(reward_model), "label": 1}], "mesh": MESH})
    with pytest.raises(ValueError, match="label 1 is not one of the 1 outputs"):
        RewardScorer(cfg)


def test_length_buckets_and_rows():
    from reward_service.reward_models import length_bucket, rows_for

    assert [length_bucket(n) for n in (1, 16, 17, 33, 64)] == [16, 16, 32, 64, 64]
    assert rows_for(16, 256) == 16 and rows_for(512, 256) == 1
    assert np.all(np.diff([rows_for(b, 4096) for b in (16, 32, 64)]) < 0)
