"""The splash attention kernel (Pallas, TPU) in Pallas interpret mode on this CPU, against the
dense path: values and gradients with GQA, padding and packed segments, alone, under the
shard_map over a mesh, and as the model's attention (`CausalLM(attention="splash")`); and
`attention="auto"` leaves CPU on the dense path bit for bit."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import left_padded_batch, randomize
from flax import nnx
from jax.sharding import Mesh

from splitrl import models
from splitrl.models import causal_mask, dense_attend
from splitrl.models.attention import attend
from splitrl.models.splash import _shard_axes, block_size, splash_attend
from splitrl.platforms import libtpu_installed


def _inputs(b=2, t=37, h=4, kh=2, dh=16, seed=0):
    """GQA q/k/v; row 0 packs two segments (a prefill's packed prompts), row 1 is
    left-padded (5 tokens, segment 0) before its real tokens (segment 1). Returns q, k, v,
    segments, the dense mask of the same attention, and which queries are real."""
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal((b, t, n, dh)), jnp.float32)
               for n in (h, kh, kh))
    segments = np.ones((b, t), np.int32)
    segments[0, 20:] = 2
    segments[1, :5] = 0
    valid = segments > 0
    mask = np.array(causal_mask(jnp.arange(t), jnp.arange(t), jnp.asarray(valid)))
    mask &= segments[:, :, None] == segments[:, None, :]
    return q, k, v, jnp.asarray(segments), jnp.asarray(mask), jnp.asarray(valid)


def _loss(f, real, weights):
    """A scalar of f(q, k, v) over the real queries only (padding queries mean nothing)."""
    def fn(q, k, v):
        return jnp.sum(jnp.where(real[..., None, None], f(q, k, v) * weights, 0.0))
    return fn


def _check_values_and_gradients(kernel, q, k, v, mask, real):
    weights = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)
    dense = lambda q, k, v: dense_attend(q, k, v, mask)
    got, want = jax.jit(kernel)(q, k, v), jax.jit(dense)(q, k, v)
    np.testing.assert_allclose(np.asarray(got)[np.asarray(real)],
                               np.asarray(want)[np.asarray(real)], rtol=1e-5, atol=2e-5)
    got_grads = jax.jit(jax.grad(_loss(kernel, real, weights), argnums=(0, 1, 2)))(q, k, v)
    want_grads = jax.jit(jax.grad(_loss(dense, real, weights), argnums=(0, 1, 2)))(q, k, v)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert float(jnp.abs(w).max()) > 0
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=5e-5)


def test_splash_kernel_matches_dense_values_and_gradients():
    q, k, v, segments, mask, real = _inputs()
    kernel = lambda q, k, v: splash_attend(q, k, v, segments, interpret=True)
    _check_values_and_gradients(kernel, q, k, v, mask, real)


def test_splash_under_shard_map_over_the_mesh_matches_dense():
    """Rows over fsdp, heads (4 query, 2 key/value) over tensor: each device runs the kernel
    on its own rows and heads, and the whole equals the dense path."""
    q, k, v, segments, mask, real = _inputs()
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("fsdp", "tensor"))
    kernel = lambda q, k, v: splash_attend(q, k, v, segments, interpret=True)
    with jax.set_mesh(mesh):
        _check_values_and_gradients(kernel, q, k, v, mask, real)


def test_shard_axes_split_only_what_divides():
    sizes = {"data": 1, "fsdp": 2, "tensor": 2}
    assert _shard_axes(sizes, rows=4, heads=8, kv_heads=2) == (("fsdp",), "tensor")
    assert _shard_axes(sizes, rows=3, heads=8, kv_heads=2) == (None, "tensor")
    # 9 query / 3 key-value heads (SmolLM2) do not divide by 2: every tensor shard has all
    assert _shard_axes(sizes, rows=4, heads=9, kv_heads=3) == (("fsdp",), None)
    assert _shard_axes({"data": 2, "fsdp": 2}, rows=8, heads=4, kv_heads=4) == (
        ("data", "fsdp"), None)


def test_block_size_is_whole_lanes_up_to_512():
    assert [block_size(n) for n in (1, 37, 128, 129, 600, 4096)] == [128, 128, 128, 256, 512,
                                                                       512]


def _model(config, attention):
    model = models.init_random(config, seed=3)
    randomize(model, seed=4)
    graphdef, state = nnx.split(model)
    graphdef = nnx.split(models.abstract_model(config, attention=attention))[0]
    return graphdef, state


def test_model_with_splash_attention_matches_dense_logits_and_gradients(tiny_config):
    """The whole model (2 layers, GQA, left padding) with attention="splash" against "auto"
    (the dense path on CPU): logits of real tokens and the parameter gradients of a loss
    over them."""
    tokens, mask = left_padded_batch([11, 4], 11, seed=5)
    positions = models.left_pad_positions(mask)

    def loss(graphdef):
        def fn(state):
            logits = nnx.merge(graphdef, state)(tokens, positions, attention_mask=mask)[0]
            return jnp.sum(jnp.where(mask[..., None], logits, 0.0) ** 2) * 1e-3, logits
        return jax.jit(jax.value_and_grad(fn, has_aux=True))

    (_, got), got_grads = loss(_model(tiny_config, "splash")[0])(_model(tiny_config, "splash")[1])
    graphdef, state = _model(tiny_config, "auto")
    (_, want), want_grads = loss(graphdef)(state)
    real = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], rtol=1e-4,
                               atol=1e-4)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-3, atol=2e-5)


@pytest.mark.parametrize("with_mesh", [False, True])
def test_auto_attention_on_cpu_is_the_dense_path_bitwise(with_mesh):
    """"auto" on CPU is `dense_attend`'s program bit for bit, with or without a mesh set
    (with one, the kernel branch exists for TPU only and is not lowered for CPU)."""
    q, k, v, segments, mask, _ = _inputs()
    mesh = Mesh(np.array(jax.devices()[:1]), ("fsdp",))
    auto = jax.jit(lambda q, k, v: attend(q, k, v, mask, segments, "auto"))
    with jax.set_mesh(mesh) if with_mesh else _no_mesh():
        got = auto(q, k, v)
    want = jax.jit(lambda q, k, v: dense_attend(q, k, v, mask))(q, k, v)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _no_mesh():
    import contextlib

    return contextlib.nullcontext()


def test_unknown_attention_implementation_is_rejected(tiny_config):
    with pytest.raises(ValueError, match="attention: expected one of"):
        models.CausalLM(tiny_config, rngs=nnx.Rngs(0), attention="flash")


@pytest.mark.skipif(not libtpu_installed(), reason="libtpu (the TPU compiler) is not "
                    "installed: pip install -e '.[tpu-plan]'")
@pytest.mark.parametrize("attention, kernels", [
    ("auto", {"splash_mha_fwd_segmented_residuals", "splash_mha_dq_segmented_no_residuals",
              "splash_mha_dkv_segmented_no_residuals"}),
    ("xla", set()),
])
def test_trainer_on_a_tpu_lowers_its_train_step_with_the_splash_kernels(attention, kernels):
    """The learner's train step for a v5e 2x2 slice (fsdp=2 x tensor=2; lowered, not compiled:
    `splitrl plan`'s TPU tests compile it): "auto" has splash's forward and both backward
    kernels in it, "xla" none."""
    from splitrl.config import load_config
    from splitrl_app.planning import tpu_target
    from tests.conftest import REPO_ROOT
    from trainer_service.learning.learner import Learner

    config = models.TransformerConfig(family="llama", vocab_size=256, hidden_size=256,
                                      intermediate_size=512, num_layers=2, num_heads=4,
                                      num_kv_heads=2, head_dim=64)
    cfg = load_config(str(REPO_ROOT / "splitrl" / "configs" / "demo.yaml"),
                      [f"model.attention={attention}"])
    mesh = Mesh(np.array(tpu_target("v5e:2x2").devices).reshape(2, 2), ("fsdp", "tensor"))
    learner = Learner.from_config(models.abstract_model(config), cfg, mesh)
    text = learner.lower_train_step(rows=4, length=256)["grad_step"].as_text()
    assert set(re.findall(r'kernel_name\s*=\s*"([^"]+)"', text)) == kernels


@pytest.mark.slow  # the interpreted kernel's backward inside a whole train step (~20 s of CPU)
def test_learner_train_step_with_splash_on_an_fsdp_mesh_matches_the_dense_step():
    """The trainer's own step with model.attention "splash" on two CPU devices (fsdp=2: the
    kernel runs under the shard_map over the learner's mesh, each device on its rows) against
    the same step on the dense path: loss, gradient norm and updated parameters."""
    from tests.trainer_service.trainer_helpers import make_learner, mesh_of, rollout_batch

    batch = rollout_batch(0)
    steps = {}
    for attention in ("auto", "splash"):
        learner = make_learner(mesh_of(2), attention=attention)
        metrics = learner.train_step(batch)
        steps[attention] = metrics, jax.device_get(learner.params)
    (want, want_params), (got, got_params) = steps["auto"], steps["splash"]
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-4, err_msg=key)
    for name, value in want_params.items():
        np.testing.assert_allclose(got_params[name], value, rtol=1e-4, atol=1e-6, err_msg=name)
