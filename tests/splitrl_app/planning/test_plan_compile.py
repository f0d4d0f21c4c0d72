"""`splitrl plan` compiling the real programs: on this CPU (the memory model against a real
learner's live arrays, exit codes) and for a TPU v5e 2x2 through libtpu.

The TPU tests need libtpu (the TPU compiler, no TPU): the `test` extra installs it, so CI runs
them; without it they skip saying how to install it.
"""

from __future__ import annotations

import json
import math

import jax
import pytest

from splitrl.config import load_config
from splitrl.init_model import init_model
from splitrl.mesh import build_mesh
from splitrl.models import from_pretrained, param_shapes
from splitrl.models import load_config as load_model_config
from splitrl_app import cli
from splitrl_app.planning import (
    cpu_target,
    format_reports,
    libtpu_installed,
    plan_run,
    tpu_target,
)
from tests.conftest import REPO_ROOT

DEMO = str(REPO_ROOT / "splitrl" / "configs" / "demo.yaml")


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory):
    """The demo's tiny Qwen2 (what `make demo` trains)."""
    return init_model(tmp_path_factory.mktemp("models") / "tiny-arith", family="qwen2",
                      preset="tiny", vocab="arithmetic", seed=0)


def _bytes_by_param(config, itemsize):
    """All parameter bytes, and those of vectors (norm weights, biases: 1-D per layer)."""
    shapes = param_shapes(config)
    total = sum(math.prod(s.shape) for s in shapes.values()) * itemsize
    one_d = sum(math.prod(s.shape) for n, s in shapes.items()
                if len(s.shape) - n.startswith("model.layers.") == 1) * itemsize
    return total, one_d


def _per_device_bytes(arrays) -> int:
    per_device: dict = {}
    for a in arrays:
        for shard in a.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values())


def test_cpu_plan_predicts_parameter_and_optimizer_bytes_of_a_real_learner(demo_model):
    from splitrl_app.planning.services import TrainerPlanner
    from trainer_service.learning.learner import Learner

    # The demo trainer's fsdp=4 mesh: half of this test process's 8 CPU devices. What the
    # plan reports for parameters and optimizer state (`measure` adds the compiled
    # temporaries to these; the TPU tests below compile).
    cfg = load_config(DEMO, [f"model.path={demo_model}", "trainer.mesh.device_fraction=0.5"])
    planner = TrainerPlanner(cfg, load_model_config(demo_model), cpu_target())
    predicted = planner.held(planner.rows)
    assert dict(planner.mesh.shape) == {"fsdp": 4}

    model = from_pretrained(demo_model, dtype=cfg.model.dtype)
    before = {id(a) for a in jax.live_arrays()}
    learner = Learner.from_config(model, cfg, build_mesh(cfg.trainer.mesh))
    new = [a for a in jax.live_arrays() if id(a) not in before]
    measured = _per_device_bytes(new)
    assert _per_device_bytes(jax.tree.leaves(learner.params)) == predicted["parameters"]
    want = predicted["parameters"] + predicted["optimizer state"]
    assert abs(measured - want) <= 0.10 * measured, (measured, want)


@pytest.fixture(scope="module")
def one_layer_config(tmp_path_factory):
    """A one-layer Llama-shaped config.json and nothing else (a plan needs no weights): the
    TPU compiler takes seconds for it, not minutes. Matrix sides are multiples of 128, so
    TPU tiling pads them little and the compiler's argument sizes are comparable."""
    path = tmp_path_factory.mktemp("plan") / "config.json"
    path.write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128,
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "eos_token_id": 2, "max_position_embeddings": 256}))
    return path


def test_plan_exit_codes_say_whether_it_fits(one_layer_config, capsys):
    args = ["plan", "--platform", "cpu", "--only", "sampler", "--no-search", "--config", DEMO,
            "--model", str(one_layer_config), "sampler.mesh.device_fraction=0.25",
            "sampler.max_batch_size=32"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "sampler: cpu" in out and ": fits" in out and "kv cache" in out
    assert cli.main(args[:1] + ["--hbm-gib", "0.0001"] + args[1:]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_cpu_plan_gives_each_service_the_devices_of_its_own_mesh(one_layer_config, capsys):
    """demo.yaml's trainer (fsdp=4) and samplers (tensor=2) planned together on CPU. The
    sampler's batch is the one test_plan_exit_codes_say_whether_it_fits plans on the same two
    devices: one sampler program set, compiled once (the suite's compilation cache)."""
    args = ["plan", "--platform", "cpu", "--no-search", "--config", DEMO,
            "--model", str(one_layer_config), "sampler.max_batch_size=32"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "trainer: cpu (4 x cpu" in out and "mesh fsdp=4" in out
    assert "sampler: cpu (2 x cpu" in out and "mesh tensor=2" in out


def test_a_service_that_cannot_be_planned_keeps_the_others_report(one_layer_config, capsys):
    """This test process has 8 CPU devices (a fresh `splitrl plan` would emulate 16): the
    sampler's mesh of 16 cannot be built, and the trainer's report is still printed."""
    args = ["plan", "--platform", "cpu", "--no-search", "--config", DEMO,
            "--model", str(one_layer_config), "sampler.mesh.axes={tensor: 16}"]
    assert cli.main(args) == 2
    captured = capsys.readouterr()
    assert "trainer: cpu (4 x cpu" in captured.out and "peak per device" in captured.out
    assert "splitrl plan: sampler: mesh.axes {'tensor': 16} need 16 devices" in captured.err


def test_plan_compiles_a_reward_model_on_the_reward_mesh(tmp_path, capsys):
    """With reward.models, `splitrl plan` compiles each reward model's forward on reward.mesh:
    its decoder's parameters fsdp-sharded over the mesh, at the rows max_batch_tokens gives the
    longest input bucket."""
    rm = init_model(tmp_path / "rm", preset="tiny", vocab="arithmetic", score_labels=1)
    args = ["plan", "--platform", "cpu", "--only", "reward", "--no-search", "--json",
            f"reward.models=[{{name: rm, path: '{rm}', max_batch_tokens: 512, "
            "max_length: 100}]", "reward.functions=[{name: rm}]",
            "reward.mesh.axes={fsdp: 2}"]
    assert cli.main(args) == 0
    (report,) = json.loads(capsys.readouterr().out)
    assert report["service"] == "reward" and report["mesh"] == {"fsdp": 2}
    assert report["rows"] == 4 and "4 sequences x 128 tokens" in report["shape"]
    from splitrl.models.sequence_classifier import load_classifier_config

    config = load_classifier_config(rm)
    whole = 4 * (sum(math.prod(s.shape) for s in param_shapes(config.decoder).values())
                 + config.decoder.hidden_size)  # float32 decoder + the score head
    # Per device: the fsdp-sharded matrices are halved, the norms and the head are whole.
    assert whole / 2 < report["bytes"]["parameters"] < whole
    assert report["bytes"]["temporaries"] > 0
    assert cli.main(["plan", "--platform", "cpu", "--only", "reward"]) == 2
    assert "no reward.models to plan" in capsys.readouterr().err


def test_plan_refuses_a_model_path_without_config_json(tmp_path, capsys):
    assert cli.main(["plan", "--platform", "cpu", "--model", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err


needs_libtpu = pytest.mark.skipif(
    not libtpu_installed(),
    reason="libtpu (the TPU compiler) is not installed: pip install -e '.[tpu-plan]' "
    "(the test extra includes it, which is how CI gets it)")


@pytest.fixture(scope="module")
def tpu_reports(one_layer_config):
    """One v5e 2x2 slice split by device fractions: the trainer on chips 0-1 (fsdp), the
    sampler on chips 2-3 (tensor parallel); compiled once for every assertion below."""
    cfg = load_config(DEMO, [
        "trainer.micro_batch_size=32", "trainer.mesh.axes={fsdp: 2}",
        "trainer.mesh.device_fraction=0.5", "sampler.mesh.device_fraction=0.5",
        "sampler.mesh.device_offset=2", "sampler.max_batch_size=32"])
    target = tpu_target("v5e:2x2")
    reports = plan_run(cfg, load_model_config(one_layer_config.parent),
                       {"trainer": target, "sampler": target}, search=False)
    return {r.service: r for r in reports}


@needs_libtpu
def test_tpu_train_step_memory_report_counts_the_model_parameters(tpu_reports,
                                                                  one_layer_config):
    r = tpu_reports["trainer"]
    assert r.target.device_kind == "TPU v5 lite" and r.mesh == {"fsdp": 2}
    m = r.measurement
    assert m.fits and {p.name for p in m.programs} == {"grad_step", "apply_update"}
    # model.attention "auto" on TPU: the splash kernel, forward and backward (docs/attention.md)
    kernels = {p.name: set(p.kernels) for p in m.programs}
    assert kernels["grad_step"] == {"splash_mha_fwd_segmented_residuals",
                                    "splash_mha_dq_segmented_no_residuals",
                                    "splash_mha_dkv_segmented_no_residuals"}
    assert kernels["apply_update"] == set()
    assert "Pallas kernels in grad_step: splash_mha_dkv" in format_reports([r])
    total, one_d = _bytes_by_param(load_model_config(one_layer_config.parent), 4)  # float32
    # fsdp over 2 chips halves every matrix; 1-D norm weights stay whole on each chip.
    assert total / 2 <= m.categories["parameters"] <= total / 2 + one_d / 2
    assert m.categories["gradients"] == m.categories["parameters"]
    assert m.categories["optimizer state"] >= 2 * m.categories["parameters"]  # Adam mu, nu
    # The compiler's own count of the update's inputs (params, Adam state, gradients; TPU
    # tiles pad small arrays) agrees with the plan's.
    update = next(p for p in m.programs if p.name == "apply_update")
    state = sum(m.categories[k] for k in ("parameters", "optimizer state", "gradients"))
    assert state <= update.arguments <= 2 * state


@needs_libtpu
def test_tpu_sampler_report_has_parameters_and_a_kv_cache_updated_in_place(tpu_reports,
                                                                           one_layer_config):
    r = tpu_reports["sampler"]
    assert r.target.device_kind == "TPU v5 lite" and r.mesh == {"tensor": 2}
    m = r.measurement
    assert m.fits and [p.name for p in m.programs] == ["prefill", "admit", "decode"]
    # head_dim 64: sampler.decode_attention "auto" keeps the XLA decode (the paged kernel
    # tiles heads by 128; tests/sampler_service/test_paged_cache.py plans one that runs it)
    assert all(p.kernels == () for p in m.programs)
    config = load_model_config(one_layer_config.parent)
    total, one_d = _bytes_by_param(config, 4)
    assert total / 2 <= m.categories["parameters"] <= total / 2 + one_d / 2
    assert m.categories["push staging"] == m.categories["parameters"]
    # The engine's cache at its widest: 32 rows x 32 slots (sampler.max_sequence_length),
    # keys and values of every layer, KV heads split over the 2 chips.
    assert m.categories["kv cache"] == (32 * 32 * 2 * config.num_layers * config.num_kv_heads
                                        * config.head_dim * 4 // 2)
    decode = next(p for p in m.programs if p.name == "decode")
    # The compiler's own count of decode's inputs: the weights and the cache (+ row inputs).
    held = m.categories["parameters"] + m.categories["kv cache"]
    assert held <= decode.arguments <= 2 * held
    # The cache is donated and written in place by admit and through decode's loop: neither
    # holds a second copy of it (in the compiler's own layout, that was all of it again).
    admit = next(p for p in m.programs if p.name == "admit")
    for program in (admit, decode):
        assert program.temporaries < m.categories["kv cache"] / 2, program
    assert m.peak == sum(m.categories.values()) < r.target.hbm_bytes


@pytest.mark.slow  # three CPU compiles of the train step (~30 s)
def test_layer_extrapolation_matches_the_full_compile(one_layer_config, tmp_path):
    """--extrapolate-layers (compiles of 2 and 3 layers) against the 4-layer model compiled
    whole: the sharding-derived bytes agree exactly, XLA's temporaries within 10%."""
    config = json.loads(one_layer_config.read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 4}))
    cfg = load_config(DEMO, ["trainer.mesh.device_fraction=0.5"])
    model_config = load_model_config(tmp_path)
    [full] = plan_run(cfg, model_config, {"trainer": cpu_target()}, search=False)
    [extrapolated] = plan_run(cfg, model_config, {"trainer": cpu_target()}, search=False,
                              extrapolate_layers=True)
    full, extrapolated = full.measurement.categories, extrapolated.measurement.categories
    assert full.keys() == extrapolated.keys()
    for name in ("parameters", "optimizer state", "gradients", "batch"):
        assert extrapolated[name] == full[name], name
    assert abs(extrapolated["temporaries"] - full["temporaries"]) <= 0.10 * full["temporaries"]


def test_the_launch_estimate_agrees_with_a_cpu_compile_of_the_train_step(one_layer_config):
    """`splitrl up`'s estimate (arithmetic only) against the plan's compile of the same train
    step on this CPU: parameter bytes within 1% (biases are left out), the step's temporaries
    within 20% (the per-token model was fitted to such compiles at other shapes)."""
    from splitrl_app.planning import Target
    from splitrl_app.planning.estimate import ModelShape, train_row_bytes, trainer_estimate
    from splitrl_app.planning.services import TrainerPlanner

    cfg = load_config(DEMO, ["trainer.mesh.axes={fsdp: 1}", "trainer.micro_batch_size=4",
                             "sampler.max_sequence_length=128", "sampling.max_new_tokens=8"])
    config = load_model_config(one_layer_config.parent)
    planner = TrainerPlanner(cfg, config, Target("cpu", tuple(jax.devices("cpu")[:1]), 2**30))
    compiled = planner.measure(4).categories
    shape = ModelShape.from_model_dir(one_layer_config.parent)
    estimated = trainer_estimate(cfg, shape, 4, devices=1, capacity=1).categories
    assert _bytes_by_param(config, 4)[0] == compiled["parameters"]
    assert abs(estimated["parameters"] - compiled["parameters"]) <= 0.01 * compiled["parameters"]
    assert estimated["optimizer state"] == 2 * estimated["parameters"]
    assert estimated["temporaries"] == 4 * train_row_bytes(shape, 128)
    assert abs(estimated["temporaries"] - compiled["temporaries"]) <= (
        0.20 * compiled["temporaries"]), (estimated["temporaries"], compiled["temporaries"])
