"""Every algorithm recipe loads from the config and trains one step with its own settings."""

import dataclasses

import numpy as np
import pytest
from trainer_helpers import mesh_of, rollout_batch, tiny_model

from splitrl.config import OptimizerConfig, load_config
from splitrl.recipes import RECIPES
from trainer_service.learning.advantages import compute_advantages
from trainer_service.learning.learner import Learner


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_every_recipe_loads_and_trains_one_step(recipe):
    algorithm = load_config(None, [f"algorithm.recipe={recipe}"]).algorithm
    for key, value in RECIPES[recipe].items():
        assert getattr(algorithm, key) == value, key
    learner = Learner(tiny_model(), algorithm=algorithm, optimizer=OptimizerConfig(lr=1e-2),
                      mesh=mesh_of(1), generation_budget=4)
    batch = rollout_batch(0)
    batch = dataclasses.replace(
        batch, advantages=compute_advantages(algorithm.advantage, batch.rewards, batch.group_ids,
                                             std=algorithm.advantage_std),
        sampler_logprobs=learner.logprobs(batch))
    before = {k: np.asarray(v) for k, v in learner.params.items()}
    metrics = learner.train_step(batch)
    assert learner.version == 1 and np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    moved = [k for k, v in learner.params.items() if not np.array_equal(np.asarray(v), before[k])]
    assert moved, "the step changed no parameter"
    assert learner.loss_settings["loss"] == algorithm.loss
    assert learner.loss_settings["aggregation"] == algorithm.aggregation
