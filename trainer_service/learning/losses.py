"""GRPO-family policy losses, KL penalties and loss aggregation: pure jnp functions.

Notation (all arrays are [B, T], one row per completion, aligned on *target* tokens):
  logp      log pi_theta(y_t | y_<t), the policy being optimised (carries the gradient)
  old       log pi_old(y_t | y_<t), the policy the trust region is measured against (no gradient)
  sampler   log pi_sampler(y_t | y_<t) as reported by the sampler that generated y
  ref       log pi_ref(y_t | y_<t), the frozen reference policy of the KL penalty
  A         advantages, [B] (one per completion) or [B, T] (per token; gspo-token and grpo)
  m         mask, 1 on completion tokens whose logprob counts, 0 on prompt and padding

Which logprobs are `old`: the learner passes the *trainer's own* logprobs of the batch under the
parameters at the start of the train step (computed in the first epoch's forward pass, so free;
reused by later epochs). The sampler's logprobs then only enter through truncated importance
sampling (TIS, Yao et al. 2025), a per-token weight on the policy-gradient term that corrects for
the sampler/trainer mismatch (different numerics, or a stale weight version):

    w_t = min(exp(old_t - sampler_t), tis_cap)        (no gradient; absent when tis_cap is None)

The weight is per token for every loss (for gspo it multiplies the sequence loss at each token).
A caller with no trainer recomputation may pass the sampler's logprobs as `old` and no TIS; the
clip then acts directly on pi_theta / pi_sampler. Metric "sampler_kl" is the k3 estimate of
KL(pi_sampler || pi_old) on the sampled tokens, a gauge of that mismatch.

Every log-ratio is clamped to [-logratio_clamp, logratio_clamp] before exp, so one wildly
off-policy token cannot overflow the loss.

The total loss is

    loss = agg(w * policy_loss) + beta * agg(kl) - entropy_coef * agg(entropy)

with `agg` one of AGGREGATIONS. Normalisers (token and sequence counts) can be passed in for the
whole batch, which makes the loss of a micro-batch exactly its share of the full batch's loss:
summing the micro-batch losses (and gradients, and metrics other than *_min / *_max) gives the
full-batch values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from splitrl.registry import Registry

# Paper defaults for (eps_low, eps_high) when the config leaves them as None.
DEFAULT_EPS: dict[str, tuple[float, float]] = {
    "grpo": (0.2, 0.2),  # PPO / GRPO
    "gspo": (3e-4, 4e-4),  # GSPO paper, sequence-level ratios are much closer to 1
    "gspo-token": (3e-4, 4e-4),
}


class PolicyTerms(NamedTuple):
    """What a policy loss returns, all [B, T] (values at masked-out positions are meaningless)."""

    loss: jnp.ndarray  # per-token policy-gradient loss (before TIS weight and aggregation)
    ratio: jnp.ndarray  # the importance ratio that was clipped (token or sequence ratio)
    clipped_low: jnp.ndarray  # bool: ratio < 1 - eps_low and A < 0 (gradient cut)
    clipped_high: jnp.ndarray  # bool: ratio > 1 + eps_high and A > 0 (gradient cut)
    dual_clipped: jnp.ndarray  # bool: ratio > dual_clip and A < 0 (gradient cut)


PolicyLossFn = Callable[..., PolicyTerms]
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("loss")
register_policy_loss = POLICY_LOSSES.register
get_policy_loss = POLICY_LOSSES.get


def resolve_eps(loss: str, eps_low: float | None, eps_high: float | None) -> tuple[float, float]:
    """(eps_low, eps_high) with None replaced by the loss's paper default."""
    low, high = DEFAULT_EPS[loss]
    return (low if eps_low is None else eps_low, high if eps_high is None else eps_high)


# ----------------------------------------------------------------------------- policy losses


def _clipped_objective(ratio, adv, eps_low, eps_high, dual_clip):
    """PPO clipped surrogate as a loss, with optional dual-clip (Ye et al., 2020).

        L = max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high))
        if dual_clip = c (> 1) and A < 0:  L = min(L, -A * c)
    """
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = jnp.maximum(unclipped, clipped)
    clipped_low = (ratio < 1.0 - eps_low) & (adv < 0)
    clipped_high = (ratio > 1.0 + eps_high) & (adv > 0)
    if dual_clip is None:
        dual_clipped = jnp.zeros_like(clipped_low)
    else:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1 (it bounds -A * r for A < 0), got {dual_clip}")
        loss = jnp.where(adv < 0, jnp.minimum(loss, -adv * dual_clip), loss)
        dual_clipped = (ratio > dual_clip) & (adv < 0)
    return loss, clipped_low, clipped_high, dual_clipped


def _token_advantages(advantages, shape):
    advantages = jnp.asarray(advantages, jnp.float32)
    if advantages.ndim == 1:
        advantages = advantages[:, None]
    return jnp.broadcast_to(advantages, shape)


def _seq_log_ratio(logp, old, mask, clamp):
    """(1/|y|) sum_t m_t (logp_t - old_t), clamped: the log of GSPO's sequence ratio."""
    valid = mask > 0
    length = jnp.maximum(valid.sum(-1), 1)
    total = jnp.where(valid, logp - old, 0.0).sum(-1)
    return jnp.clip(total / length, -clamp, clamp)


@register_policy_loss("grpo")
def grpo_loss(
    logp, old, advantages, mask, *, eps_low, eps_high, dual_clip=None, logratio_clamp=20.0
) -> PolicyTerms:
    """GRPO / PPO token-level clipped loss (DAPO's clip-higher is eps_high > eps_low).

        r_t = exp(clamp(logp_t - old_t))
        L_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high))   [+ dual-clip]
    """
    ratio = jnp.exp(jnp.clip(logp - old, -logratio_clamp, logratio_clamp))
    adv = _token_advantages(advantages, logp.shape)
    loss, low, high, dual = _clipped_objective(ratio, adv, eps_low, eps_high, dual_clip)
    return PolicyTerms(loss, ratio, low, high, dual)


@register_policy_loss("gspo")
def gspo_loss(
    logp, old, advantages, mask, *, eps_low, eps_high, dual_clip=None, logratio_clamp=20.0
) -> PolicyTerms:
    """GSPO (Zheng et al., 2025): one clipped importance ratio per sequence.

        s_i = exp(clamp((1/|y_i|) sum_t m_t (logp_t - old_t)))   (geometric mean of r_t)
        L_i = max(-A_i s_i, -A_i clip(s_i, 1 - eps_low, 1 + eps_high))   [+ dual-clip]

    L_i is returned at every token of row i; aggregation "seq-mean-token-mean" then gives the
    paper's (1/G) sum_i L_i. Advantages must be per sequence ([B]).
    """
    advantages = jnp.asarray(advantages, jnp.float32)
    if advantages.ndim != 1:
        raise ValueError(f"gspo needs one advantage per sequence [B], got {advantages.shape}")
    seq_ratio = jnp.exp(_seq_log_ratio(logp, old, mask, logratio_clamp))
    loss, low, high, dual = _clipped_objective(seq_ratio, advantages, eps_low, eps_high, dual_clip)
    return PolicyTerms(*(jnp.broadcast_to(x[:, None], logp.shape) for x in (
        loss, seq_ratio, low, high, dual)))


@register_policy_loss("gspo-token")
def gspo_token_loss(
    logp, old, advantages, mask, *, eps_low, eps_high, dual_clip=None, logratio_clamp=20.0
) -> PolicyTerms:
    """GSPO-token: sequence-ratio value, per-token gradient (allows per-token advantages).

        s_i,t = sg(s_i) * exp(logp_t - sg(logp_t))       (value = s_i, d s_i,t / d logp_t = s_i)
        L_i,t = max(-A_i,t s_i,t, -A_i,t clip(s_i,t, 1 - eps_low, 1 + eps_high))   [+ dual-clip]

    With A_i,t = A_i for every t and "seq-mean-token-mean" aggregation its gradient equals
    gspo's; with per-token advantages each token gets its own.
    """
    sg = jax.lax.stop_gradient
    seq_log_ratio = _seq_log_ratio(logp, old, mask, logratio_clamp)
    ratio = jnp.exp(sg(seq_log_ratio)[:, None] + logp - sg(logp))
    adv = _token_advantages(advantages, logp.shape)
    loss, low, high, dual = _clipped_objective(ratio, adv, eps_low, eps_high, dual_clip)
    return PolicyTerms(loss, ratio, low, high, dual)


# ----------------------------------------------------------------------------- KL and TIS

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_penalty(logp, ref, estimator: str, *, logratio_clamp: float = 20.0) -> jnp.ndarray:
    """Per-token estimate of KL(pi_theta || pi_ref) from samples of pi_theta (Schulman, 2020).

    With d_t = clamp(ref_t - logp_t):
        k1 = -d_t                    (unbiased, high variance, can be negative)
        k2 = d_t^2 / 2               (biased, low variance)
        k3 = exp(d_t) - d_t - 1      (unbiased, >= 0; GRPO's choice)
    """
    d = jnp.clip(ref - logp, -logratio_clamp, logratio_clamp)
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d**2
    if estimator == "k3":
        return jnp.exp(d) - d - 1.0
    raise ValueError(f"unknown kl_estimator {estimator!r}; expected one of {KL_ESTIMATORS}")


def tis_weights(old, sampler, cap: float, *, logratio_clamp: float = 20.0) -> jnp.ndarray:
    """Truncated importance weight w_t = min(exp(clamp(old_t - sampler_t)), cap), no gradient."""
    if cap <= 0:
        raise ValueError(f"tis_cap must be > 0, got {cap}")
    w = jnp.exp(jnp.clip(old - sampler, -logratio_clamp, logratio_clamp))
    return jax.lax.stop_gradient(jnp.minimum(w, cap))


# ----------------------------------------------------------------------------- aggregation

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "constant")


def aggregate(
    values,
    mask,
    mode: str,
    *,
    num_tokens=None,
    num_sequences=None,
    constant_normalizer: int | None = None,
) -> jnp.ndarray:
    """Reduce per-token values [B, T] to a scalar. With N = sum m, S = #rows with any m:

        token-mean           sum_i,t m x / N                        (DAPO)
        seq-mean-token-mean  (1/S) sum_i [sum_t m x / sum_t m]      (GRPO paper, GSPO)
        seq-mean-token-sum   (1/S) sum_i sum_t m x
        constant             sum_i,t m x / (S * C)                  (Dr.GRPO; C =
                             constant_normalizer, the generation budget max_new_tokens:
                             a fixed number, never the padded width, which depends on
                             prompt lengths and bucketing)

    num_tokens / num_sequences override N / S (pass the full batch's counts when `values` is a
    micro-batch so the micro-batch results add up to the full-batch value).
    """
    mask = mask.astype(jnp.float32)
    values = values.astype(jnp.float32)
    if num_tokens is None:
        num_tokens = mask.sum()
    if num_sequences is None:
        num_sequences = (mask.sum(-1) > 0).sum()
    num_tokens = jnp.maximum(num_tokens, 1)
    num_sequences = jnp.maximum(num_sequences, 1)
    row_sum = jnp.where(mask > 0, values, 0.0).sum(-1)
    if mode == "token-mean":
        return row_sum.sum() / num_tokens
    if mode == "seq-mean-token-mean":
        return (row_sum / jnp.maximum(mask.sum(-1), 1.0)).sum() / num_sequences
    if mode == "seq-mean-token-sum":
        return row_sum.sum() / num_sequences
    if mode == "constant":
        c = constant_normalizer
        if c is None or c <= 0:
            raise ValueError("aggregation 'constant' divides by a fixed generation budget: "
                             f"constant_normalizer must be > 0 (e.g. max_new_tokens), got {c}")
        return row_sum.sum() / (num_sequences * c)
    raise ValueError(f"unknown aggregation {mode!r}; expected one of {AGGREGATIONS}")


# ----------------------------------------------------------------------------- total loss


def compute_loss(
    logp,
    old,
    advantages,
    mask,
    *,
    loss: str = "grpo",
    aggregation: str = "token-mean",
    eps_low: float | None = None,
    eps_high: float | None = None,
    dual_clip: float | None = None,
    logratio_clamp: float = 20.0,
    constant_normalizer: int | None = None,
    beta: float = 0.0,
    kl_estimator: str = "k3",
    ref: jnp.ndarray | None = None,
    sampler: jnp.ndarray | None = None,
    tis_cap: float | None = None,
    entropy: jnp.ndarray | None = None,
    entropy_coef: float = 0.0,
    num_tokens=None,
    num_sequences=None,
) -> tuple[jnp.ndarray, dict[str, jnp.ndarray]]:
    """loss = agg(w * L) + beta * agg(kl) - entropy_coef * agg(entropy)   (see module doc).

    L is POLICY_LOSSES[loss]; w the TIS weight (1 unless tis_cap and sampler are given); kl
    uses `kl_estimator` against `ref` (required iff beta > 0). Returns (loss, metrics); metric
    values are normalised by the same N / S as the loss, so they add up over micro-batches,
    except "ratio_min" / "ratio_max" (combine with min / max).
    """
    mask = mask.astype(jnp.float32)
    if num_tokens is None:
        num_tokens = mask.sum()
    if num_sequences is None:
        num_sequences = (mask.sum(-1) > 0).sum()
    # Values at masked-out positions (prompt, padding) may be anything, even nan: zero them
    # before any arithmetic so they reach neither the loss nor the gradient.
    clean = lambda x: None if x is None else jnp.where(mask > 0, x, 0.0)  # noqa: E731
    logp, old, ref, sampler, entropy = map(clean, (logp, old, ref, sampler, entropy))
    agg = lambda x: aggregate(  # noqa: E731
        x, mask, aggregation, num_tokens=num_tokens, num_sequences=num_sequences,
        constant_normalizer=constant_normalizer,
    )
    token_mean = lambda x: jnp.where(mask > 0, x, 0).astype(jnp.float32).sum() / jnp.maximum(  # noqa: E731
        num_tokens, 1
    )

    policy_loss_fn = get_policy_loss(loss)
    eps_low, eps_high = resolve_eps(loss, eps_low, eps_high)
    terms = policy_loss_fn(
        logp, old, advantages, mask, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip,
        logratio_clamp=logratio_clamp,
    )
    policy = terms.loss
    metrics: dict[str, jnp.ndarray] = {}
    if sampler is not None:  # how far the sampler's numbers are from the trainer's pi_old
        metrics["sampler_kl"] = token_mean(
            kl_penalty(sampler, old, "k3", logratio_clamp=logratio_clamp)
        )
    if tis_cap is not None:
        if sampler is None:
            raise ValueError("tis_cap is set but no sampler logprobs were given")
        w = tis_weights(old, sampler, tis_cap, logratio_clamp=logratio_clamp)
        policy = policy * w
        metrics["tis_weight_mean"] = token_mean(w)
        metrics["tis_capped_frac"] = token_mean(w >= tis_cap)
    policy_loss = agg(policy)
    total = policy_loss
    metrics["policy_loss"] = policy_loss

    if beta != 0.0:
        if ref is None:
            raise ValueError(f"beta={beta} needs reference logprobs (ref); got None")
        kl = kl_penalty(logp, ref, kl_estimator, logratio_clamp=logratio_clamp)
        total = total + beta * agg(kl)
        metrics["kl"] = token_mean(kl)
    elif ref is not None:
        metrics["kl"] = token_mean(kl_penalty(logp, ref, kl_estimator))

    if entropy is not None:
        if entropy_coef != 0.0:
            total = total - entropy_coef * agg(entropy)
        metrics["entropy"] = token_mean(entropy)
    elif entropy_coef != 0.0:
        raise ValueError(f"entropy_coef={entropy_coef} needs per-token entropy; got None")

    valid = mask > 0
    metrics.update(
        loss=total,
        clip_frac_low=token_mean(terms.clipped_low),
        clip_frac_high=token_mean(terms.clipped_high),
        dual_clip_frac=token_mean(terms.dual_clipped),
        ratio_mean=token_mean(terms.ratio),
        ratio_min=jnp.min(jnp.where(valid, terms.ratio, jnp.inf)),
        ratio_max=jnp.max(jnp.where(valid, terms.ratio, -jnp.inf)),
    )
    return total, jax.tree.map(jax.lax.stop_gradient, metrics)


def loss_settings(algorithm, generation_budget: int | None = None) -> dict:
    """compute_loss keyword arguments from an AlgorithmConfig (splitrl.config).

    `constant_normalizer` unset means Dr.GRPO's constant: the generation budget
    (`sampling.max_new_tokens`), which the caller passes as `generation_budget`.
    """
    constant = algorithm.constant_normalizer
    if constant is None:
        constant = generation_budget
    if algorithm.aggregation == "constant" and constant is None:
        raise ValueError("algorithm.aggregation 'constant' needs algorithm.constant_normalizer "
                         "or the generation budget (sampling.max_new_tokens)")
    return dict(
        loss=algorithm.loss,
        aggregation=algorithm.aggregation,
        eps_low=algorithm.eps_low,
        eps_high=algorithm.eps_high,
        dual_clip=algorithm.dual_clip,
        logratio_clamp=algorithm.logratio_clamp,
        constant_normalizer=constant,
        beta=algorithm.beta,
        kl_estimator=algorithm.kl_estimator,
        tis_cap=algorithm.tis_cap,
        entropy_coef=algorithm.entropy_coef,
    )
