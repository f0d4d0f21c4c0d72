"""Advantage estimators against hand-computed numbers."""

import numpy as np
import pytest

from trainer_service.learning import advantages as adv

# Groups: 7 -> [1, 0, 0, 1] (mixed), 3 -> [5] (single completion), 9 -> [2, 2] (zero variance).
REWARDS = np.array([1.0, 0.0, 0.0, 1.0, 5.0, 2.0, 2.0], np.float32)
GROUPS = np.array([7, 7, 7, 7, 3, 9, 9])


def test_registry_names_and_unknown_name_error():
    assert set(adv.ADVANTAGES) == {"grpo", "drgrpo", "rloo"}
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        adv.get_advantage_fn("ppo")


def test_grpo_group_std_normalises_and_zeroes_degenerate_groups():
    a = np.asarray(adv.compute_advantages("grpo", REWARDS, GROUPS, eps=1e-6))
    # group 7: mean 0.5, population std 0.5 -> +-1; groups 3 and 9 have no spread -> 0.
    expected = np.array([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0]) / (0.5 + 1e-6)
    np.testing.assert_allclose(a, expected, rtol=1e-6, atol=1e-7)


def test_grpo_batch_std_uses_one_scale_but_group_mean():
    a = np.asarray(adv.compute_advantages("grpo", REWARDS, GROUPS, std="batch", eps=0.0))
    batch_std = np.std(REWARDS)  # population std over all 7 rewards
    centred = np.array([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0])
    np.testing.assert_allclose(a, centred / batch_std, rtol=1e-6)


def test_drgrpo_is_mean_centred_only():
    r = np.array([3.0, 1.0, 2.0, 10.0], np.float32)
    a = np.asarray(adv.compute_advantages("drgrpo", r, [0, 0, 0, 1]))
    np.testing.assert_allclose(a, [1.0, -1.0, 0.0, 0.0], atol=1e-6)


def test_zero_variance_mask_flags_single_and_constant_groups():
    mask = np.asarray(adv.zero_variance_mask(REWARDS, GROUPS))
    np.testing.assert_array_equal(mask, [False] * 4 + [True] * 3)


def test_bad_shapes_and_std_are_rejected():
    with pytest.raises(ValueError, match="must both be"):
        adv.compute_advantages("grpo", REWARDS, GROUPS[:3])
    with pytest.raises(ValueError, match="'group' or 'batch'"):
        adv.compute_advantages("grpo", REWARDS, GROUPS, std="global")


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo"])
@pytest.mark.parametrize("value", [0.9, 0.1, 1 / 3, 7.3, -2.2])
def test_groups_of_equal_float32_rewards_get_exactly_zero(name, value):
    # In float32, mean([0.9] * 3) != 0.9 and (r - mean) / (std + eps) gave 0.0563 each.
    r = np.full(3, value, np.float32)
    a = np.asarray(adv.compute_advantages(name, r, [0, 0, 0]))
    assert a.dtype == np.float32 and np.all(a == 0.0)
    assert np.all(adv.zero_variance_mask(r, [0, 0, 0]))
    mixed = np.concatenate([r, np.float32([0.9, 0.8])])
    b = np.asarray(adv.compute_advantages(name, mixed, [0, 0, 0, 1, 1]))
    assert np.all(b[:3] == 0.0) and np.all(b[3:] != 0.0)


def test_rloo_baseline_is_the_mean_of_the_other_completions():
    r = np.array([1.0, 0.0, 0.0, 1.0, 5.0, 3.0, 1.0], np.float32)
    a = np.asarray(adv.compute_advantages("rloo", r, [7, 7, 7, 7, 3, 9, 9]))
    # group 7: r_i - mean of the other three; group 3 alone: 0; group 9: 3-1, 1-3.
    expected = [1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3, 0.0, 2.0, -2.0]
    np.testing.assert_allclose(a, expected, rtol=1e-6, atol=1e-7)
