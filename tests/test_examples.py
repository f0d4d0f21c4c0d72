"""The example configs (examples/) are valid configs: they load, with their recipe applied."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitrl.config import load_config

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").rglob("*.yaml"))


def test_there_are_examples():
    assert len(EXAMPLES) >= 2


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_config_loads_with_the_grpo_recipe(path):
    cfg = load_config(path, [])
    assert cfg.trainer.data.task == "gsm8k" and cfg.trainer.data.chat_template
    assert cfg.trainer.data.options == {"instruction": "hash"}
    assert [f.name for f in cfg.reward.functions] == ["math_accuracy", "format"]
    assert cfg.algorithm.eps_low == 0.2 and cfg.algorithm.beta == 0.001  # recipe grpo + own KL
    assert cfg.trainer.micro_batch_size is not None
