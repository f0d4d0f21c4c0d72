"""Policy losses, KL estimators, TIS and aggregation against hand-computed values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from splitrl.config import AlgorithmConfig
from trainer_service.learning import advantages as adv_lib
from trainer_service.learning import losses as L

E = np.exp
# Two completions of 4 target positions plus one fully masked row (e.g. a filtered completion).
# log-ratios logp - old:      row 0: [0.5, -0.5, 0.1, pad]   A = +1
#                             row 1: [0.5, -0.5, pad, pad]   A = -1
#                             row 2: all padding             A = +2
LOG_RATIO = np.array(
    [[0.5, -0.5, 0.1, 7.0], [0.5, -0.5, 3.0, -9.0], [1.0, 1.0, 1.0, 1.0]], np.float32
)
MASK = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], np.float32)
ADV = np.array([1.0, -1.0, 2.0], np.float32)
OLD = np.array([[-1.0, -2.0, -0.5, -3.0], [-0.2, -1.5, -2.0, -1.0], [-1, -1, -1, -1]], np.float32)
LOGP = OLD + LOG_RATIO

# grpo per-token losses with eps_low = 0.2, eps_high = 0.28, by hand:
#   r = e^0.5,  A = +1: max(-e^0.5, -1.28)    = -1.28       (clipped high)
#   r = e^-0.5, A = +1: max(-e^-0.5, -0.8)    = -e^-0.5
#   r = e^0.1,  A = +1:                         -e^0.1
#   r = e^0.5,  A = -1: max(e^0.5, 1.2)       =  e^0.5      (dual-clip 1.5 -> 1.5)
#   r = e^-0.5, A = -1: max(e^-0.5, 0.8)      =  0.8        (clipped low)
ROW0 = [-1.28, -E(-0.5), -E(0.1)]
ROW1 = [E(0.5), 0.8]
GRPO_BY_MODE = {
    "token-mean": (sum(ROW0) + sum(ROW1)) / 5,
    "seq-mean-token-mean": (sum(ROW0) / 3 + sum(ROW1) / 2) / 2,
    "seq-mean-token-sum": (sum(ROW0) + sum(ROW1)) / 2,
    "constant": (sum(ROW0) + sum(ROW1)) / (2 * 3),  # C = 3, the generation budget
}


def _loss(**kw):
    kw.setdefault("loss", "grpo")
    return L.compute_loss(
        jnp.asarray(kw.pop("logp", LOGP)), jnp.asarray(kw.pop("old", OLD)),
        jnp.asarray(kw.pop("advantages", ADV)), jnp.asarray(kw.pop("mask", MASK)), **kw,
    )


def test_registries_hold_every_configurable_name():
    assert set(L.POLICY_LOSSES) == {"grpo", "gspo", "gspo-token"}
    assert set(L.AGGREGATIONS) == {
        "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "constant"
    }
    assert L.resolve_eps("grpo", None, 0.28) == (0.2, 0.28)
    assert L.resolve_eps("gspo", None, None) == (3e-4, 4e-4)
    with pytest.raises(ValueError, match="unknown loss 'ppo'"):
        _loss(loss="ppo")
    with pytest.raises(ValueError, match="unknown aggregation 'sum'"):
        _loss(aggregation="sum")


@pytest.mark.parametrize("mode", sorted(GRPO_BY_MODE))
def test_grpo_clip_higher_every_aggregation_matches_hand_values(mode):
    loss, m = _loss(aggregation=mode, eps_low=0.2, eps_high=0.28, constant_normalizer=3)
    np.testing.assert_allclose(loss, GRPO_BY_MODE[mode], rtol=1e-6)
    np.testing.assert_allclose(m["policy_loss"], GRPO_BY_MODE[mode], rtol=1e-6)
    np.testing.assert_allclose(m["clip_frac_high"], 1 / 5)
    np.testing.assert_allclose(m["clip_frac_low"], 1 / 5)
    np.testing.assert_allclose(m["ratio_mean"], (2 * E(0.5) + 2 * E(-0.5) + E(0.1)) / 5, rtol=1e-6)
    np.testing.assert_allclose(m["ratio_min"], E(-0.5), rtol=1e-6)
    np.testing.assert_allclose(m["ratio_max"], E(0.5), rtol=1e-6)


def test_constant_normaliser_is_dr_grpo_budget():
    loss, _ = _loss(aggregation="constant", constant_normalizer=10, eps_low=0.2, eps_high=0.28)
    np.testing.assert_allclose(loss, (sum(ROW0) + sum(ROW1)) / (2 * 10), rtol=1e-6)
    with pytest.raises(ValueError, match="constant_normalizer must be > 0"):
        _loss(aggregation="constant")


def test_constant_normaliser_defaults_to_the_generation_budget_not_the_padded_width():
    # The padded width depends on the prompt: a 3-token and a 20-token prompt with the same
    # 4-token completions gave C = 7 and C = 31. Dr.GRPO divides by the fixed budget.
    settings = L.loss_settings(AlgorithmConfig(aggregation="constant"), generation_budget=8)
    assert settings["constant_normalizer"] == 8
    completion = np.array([0.5, -0.25, 1.0, 0.125], np.float32)
    losses = []
    for prompt_len in (3, 20):
        width = prompt_len + len(completion)
        values = np.zeros((1, width), np.float32)
        values[0, prompt_len:] = completion
        mask = np.zeros((1, width), np.float32)
        mask[0, prompt_len:] = 1
        losses.append(float(L.aggregate(jnp.asarray(values), jnp.asarray(mask), "constant",
                                        constant_normalizer=settings["constant_normalizer"])))
    assert losses[0] == losses[1] == pytest.approx(completion.sum() / 8)
    explicit = L.loss_settings(AlgorithmConfig(aggregation="constant", constant_normalizer=5),
                               generation_budget=8)
    assert explicit["constant_normalizer"] == 5
    with pytest.raises(ValueError, match="needs algorithm.constant_normalizer"):
        L.loss_settings(AlgorithmConfig(aggregation="constant"))


def test_grpo_dual_clip_bounds_negative_advantage_loss():
    loss, m = _loss(aggregation="token-mean", eps_low=0.2, eps_high=0.28, dual_clip=1.5)
    np.testing.assert_allclose(loss, (sum(ROW0) + 1.5 + 0.8) / 5, rtol=1e-6)
    np.testing.assert_allclose(m["dual_clip_frac"], 1 / 5)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        _loss(dual_clip=0.9)


def test_masked_positions_never_reach_loss_or_gradient():
    nan_logp = np.where(MASK > 0, LOGP, np.nan).astype(np.float32)
    for name in L.POLICY_LOSSES:
        f = lambda lp, n=name: _loss(loss=n, logp=lp, eps_low=0.2, eps_high=0.28)[0]  # noqa: E731
        np.testing.assert_allclose(f(jnp.asarray(nan_logp)), f(jnp.asarray(LOGP)), rtol=1e-6)
        g = np.asarray(jax.grad(f)(jnp.asarray(nan_logp)))
        assert np.all(np.isfinite(g)) and np.all(g[MASK == 0] == 0), name


def test_gspo_sequence_ratio_is_geometric_mean_of_token_ratios():
    terms = L.gspo_loss(jnp.asarray(LOGP), jnp.asarray(OLD), jnp.asarray(ADV), jnp.asarray(MASK),
                        eps_low=0.2, eps_high=0.28)
    for i, n in [(0, 3), (1, 2)]:
        token_ratios = E(LOG_RATIO[i, :n].astype(np.float64))
        geo_mean = np.prod(token_ratios) ** (1 / n)
        np.testing.assert_allclose(terms.ratio[i, :n], geo_mean, rtol=1e-6)


def test_gspo_paper_defaults_clip_at_sequence_level():
    # s_0 = e^(0.1/3) > 1 + 4e-4 with A > 0 -> clipped to -(1 + 4e-4); s_1 = e^0 = 1 -> +1.
    loss, m = _loss(loss="gspo", aggregation="seq-mean-token-mean")
    np.testing.assert_allclose(loss, (-(1 + 4e-4) + 1.0) / 2, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(m["clip_frac_high"], 3 / 5)  # all three tokens of row 0
    loss, _ = _loss(loss="gspo", aggregation="seq-mean-token-mean", eps_low=0.2, eps_high=0.28)
    np.testing.assert_allclose(loss, (-E(0.1 / 3) + 1.0) / 2, rtol=1e-6)
    with pytest.raises(ValueError, match="one advantage per sequence"):
        _loss(loss="gspo", advantages=np.ones((3, 4), np.float32))


def test_gspo_token_value_equals_gspo_and_gradient_is_per_token():
    kw = dict(aggregation="seq-mean-token-mean", eps_low=0.5, eps_high=0.5)  # nothing clipped
    f = lambda lp, name, a: _loss(loss=name, logp=lp, advantages=a, **kw)[0]  # noqa: E731
    lp = jnp.asarray(LOGP)
    assert f(lp, "gspo-token", ADV) == pytest.approx(float(f(lp, "gspo", ADV)), rel=1e-6)
    terms = L.gspo_token_loss(lp, jnp.asarray(OLD), jnp.asarray(ADV), jnp.asarray(MASK),
                              eps_low=0.5, eps_high=0.5)
    s = E(np.array([0.1 / 3, 0.0]))
    np.testing.assert_allclose(terms.ratio[0, :3], s[0], rtol=1e-6)
    # Same advantage on every token: identical gradients, -(1/S)(1/n_i) A_i s_i on each token.
    g_seq = np.asarray(jax.grad(f)(lp, "gspo", ADV))
    g_tok = np.asarray(jax.grad(f)(lp, "gspo-token", ADV))
    np.testing.assert_allclose(g_tok, g_seq, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(g_seq[0, :3], -(1 / 2) * (1 / 3) * 1.0 * s[0], rtol=1e-5)
    np.testing.assert_allclose(g_seq[1, :2], -(1 / 2) * (1 / 2) * -1.0 * s[1], rtol=1e-5)
    # Per-token advantages: token t's gradient is -(1/S)(1/n_i) A_i,t s_i, different per token.
    a_tok = np.array([[1.0, 2.0, -1.0, 0], [0.5, -3.0, 0, 0], [0, 0, 0, 0]], np.float32)
    g = np.asarray(jax.grad(f)(lp, "gspo-token", a_tok))
    np.testing.assert_allclose(g[0, :3], -(1 / 2) * (1 / 3) * a_tok[0, :3] * s[0], rtol=1e-5)
    np.testing.assert_allclose(g[1, :2], -(1 / 2) * (1 / 2) * a_tok[1, :2] * s[1], rtol=1e-5)
    assert len(set(np.round(g[0, :3], 6))) == 3


@pytest.mark.parametrize(
    "estimator,expected",
    [("k1", 0.5), ("k2", 0.125), ("k3", E(-0.5) + 0.5 - 1.0)],  # d = ref - logp = -0.5
)
def test_kl_estimators_and_beta_term(estimator, expected):
    logp, ref = jnp.full((1, 2), -1.0), jnp.full((1, 2), -1.5)
    np.testing.assert_allclose(L.kl_penalty(logp, ref, estimator), expected, rtol=1e-6)
    base, _ = _loss(aggregation="token-mean", eps_low=0.2, eps_high=0.28)
    ref = LOGP + 0.5  # d = +0.5 on every token
    total, m = _loss(aggregation="token-mean", eps_low=0.2, eps_high=0.28, beta=0.1,
                     kl_estimator=estimator, ref=jnp.asarray(ref))
    per_token = {"k1": -0.5, "k2": 0.125, "k3": E(0.5) - 0.5 - 1.0}[estimator]
    np.testing.assert_allclose(m["kl"], per_token, rtol=1e-5)
    np.testing.assert_allclose(total, base + 0.1 * per_token, rtol=1e-5)
    with pytest.raises(ValueError, match="needs reference logprobs"):
        _loss(beta=0.1)


def test_truncated_importance_weights_multiply_policy_term():
    # old - sampler per token: row 0 [0.3, 1.0, -2.0], row 1 [0.0, 2.0]; cap 2.
    diff = np.array([[0.3, 1.0, -2.0, 0.0], [0.0, 2.0, 0.0, 0.0], [0, 0, 0, 0]], np.float32)
    w = np.array([[E(0.3), 2.0, E(-2.0)], [1.0, 2.0]], dtype=object)
    loss, m = _loss(aggregation="token-mean", eps_low=0.2, eps_high=0.28, tis_cap=2.0,
                    sampler=jnp.asarray(OLD - diff))
    expected = (np.dot(ROW0, w[0]) + np.dot(ROW1, w[1])) / 5
    np.testing.assert_allclose(loss, expected, rtol=1e-6)
    np.testing.assert_allclose(m["tis_capped_frac"], 2 / 5)
    np.testing.assert_allclose(m["tis_weight_mean"], (sum(w[0]) + sum(w[1])) / 5, rtol=1e-6)
    # k3 with d = old - sampler, on the 5 completion tokens
    d = np.array([0.3, 1.0, -2.0, 0.0, 2.0])
    np.testing.assert_allclose(m["sampler_kl"], np.mean(E(d) - d - 1), rtol=1e-6)
    with pytest.raises(ValueError, match="no sampler logprobs"):
        _loss(tis_cap=2.0)


def test_entropy_bonus_is_subtracted():
    ent = np.full((3, 4), 0.7, np.float32)
    base, _ = _loss(aggregation="token-mean", eps_low=0.2, eps_high=0.28)
    total, m = _loss(aggregation="token-mean", eps_low=0.2, eps_high=0.28,
                     entropy=jnp.asarray(ent), entropy_coef=0.01)
    np.testing.assert_allclose(total, base - 0.01 * 0.7, rtol=1e-6)
    np.testing.assert_allclose(m["entropy"], 0.7, rtol=1e-6)


def test_logratio_clamp_keeps_the_loss_finite():
    logp = OLD + np.where(MASK > 0, 500.0, 0.0).astype(np.float32)
    for name in L.POLICY_LOSSES:
        loss, m = _loss(loss=name, logp=logp, advantages=-ADV, tis_cap=2.0,
                        sampler=jnp.asarray(OLD - 500.0), beta=0.1, ref=jnp.asarray(OLD))
        assert np.isfinite(loss), name
        np.testing.assert_allclose(m["ratio_max"], E(20.0), rtol=1e-5)


@pytest.mark.parametrize("mode", sorted(GRPO_BY_MODE))
def test_micro_batches_with_global_normalisers_add_up_to_the_batch(mode):
    rng = np.random.default_rng(0)
    logp = rng.normal(-1, 0.3, (6, 5)).astype(np.float32)
    old = logp + rng.normal(0, 0.2, (6, 5)).astype(np.float32)
    mask = (rng.random((6, 5)) < 0.7).astype(np.float32)
    mask[4] = 0
    adv = rng.normal(size=6).astype(np.float32)
    kw = dict(aggregation=mode, beta=0.05, ref=jnp.asarray(old - 0.1), entropy=-jnp.asarray(logp),
              entropy_coef=0.01, tis_cap=1.5, sampler=jnp.asarray(old + 0.05),
              constant_normalizer=5)
    for name in L.POLICY_LOSSES:
        full, fm = L.compute_loss(logp, old, adv, mask, loss=name, **kw)
        counts = dict(num_tokens=mask.sum(), num_sequences=(mask.sum(-1) > 0).sum())
        parts = []
        for rows in (slice(0, 2), slice(2, 6)):
            sub = {k: (v[rows] if k in ("ref", "entropy", "sampler") else v)
                   for k, v in kw.items()}
            parts.append(L.compute_loss(logp[rows], old[rows], adv[rows], mask[rows], loss=name,
                                        **sub, **counts))
        np.testing.assert_allclose(parts[0][0] + parts[1][0], full, rtol=1e-5, atol=1e-7)
        for key in ("policy_loss", "kl", "entropy", "clip_frac_low", "ratio_mean"):
            np.testing.assert_allclose(parts[0][1][key] + parts[1][1][key], fm[key], rtol=1e-5)


def test_single_completion_and_zero_variance_groups_give_no_policy_gradient():
    rewards = np.array([1.0, 0.0, 0.0, 3.0, 2.0, 2.0], np.float32)
    groups = np.array([0, 0, 0, 1, 2, 2])  # mixed, single completion, zero variance
    a = np.asarray(adv_lib.compute_advantages("grpo", rewards, groups))
    np.testing.assert_array_equal(a[3:], 0.0)
    mask = np.ones((6, 3), np.float32)
    old = np.full((6, 3), -1.0, np.float32)
    for name in L.POLICY_LOSSES:
        f = lambda lp, n=name: L.compute_loss(lp, old, a, mask, loss=n)[0]  # noqa: E731
        g = np.asarray(jax.grad(f)(jnp.asarray(old)))  # on-policy: r = 1
        np.testing.assert_array_equal(g[3:], 0.0)
        assert np.all(np.abs(g[:3]) > 0), name
