"""`splitrl plan`'s pure parts: topology names, the libtpu pin, the largest-batch search, and
what it says when libtpu is missing (no compilation here)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import tomllib

import pytest

from splitrl_app import cli
from splitrl_app.planning import LIBTPU_MISSING, PlanError, tpu_target
from splitrl_app.planning.memory import Measurement, largest_fitting
from splitrl_app.planning.targets import topology_name
from tests.conftest import REPO_ROOT


@pytest.mark.parametrize("name, expected", [
    ("v5p-8", "v5p:2x2x1"), ("v5p-16", "v5p:2x2x2"), ("v5p-64", "v5p:2x4x4"),
    ("v5p-128", "v5p:4x4x4"), ("v5litepod-4", "v5e:2x2"), ("v5e-16", "v5e:4x4"),
    ("v6e-8", "v6e:2x4"), ("v4-8", "v4:2x2x1"), ("v5e:2x2", "v5e:2x2"),
])
def test_accelerator_types_become_standard_slice_topologies(name, expected):
    assert topology_name(name) == expected


@pytest.mark.parametrize("name", ["v5p-6", "v5p-7", "tpu", "v5e:2y2"])
def test_unknown_topology_names_are_refused_by_name(name):
    with pytest.raises(PlanError, match=re.escape(repr(name))):
        topology_name(name)


def test_tpu_plan_extra_pins_the_libtpu_that_jax_tpu_pins():
    """The extra must follow jax: a jax upgrade that moves libtpu fails here."""
    jax_pin = [r.split(";")[0].strip() for r in importlib.metadata.requires("jax")
               if r.startswith("libtpu") and 'extra == "tpu"' in r]
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert jax_pin and extras["tpu-plan"] == jax_pin
    assert jax_pin[0] in extras["test"]


def test_without_libtpu_plan_says_how_to_install_it(monkeypatch, capsys, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "libtpu" else real(name, *a))
    with pytest.raises(PlanError, match=re.escape("pip install 'splitrl[tpu-plan]'")):
        tpu_target("v5e:2x2")
    code = cli.main(["plan", "--topology", "v5e:2x2", "--model", str(tmp_path)])
    assert code == 2
    assert LIBTPU_MISSING in capsys.readouterr().err


def _linear(fixed: int, per_row: int, capacity: int, calls: list[int]):
    def measure(rows: int) -> Measurement:
        calls.append(rows)
        return Measurement(rows, {"all": fixed + per_row * rows}, [], capacity)
    return measure


@pytest.mark.parametrize("fixed, per_row, base_rows, step", [
    (100, 10, 8, 4),     # base fits, answer above it
    (100, 10, 64, 4),    # base does not fit, answer below it
    (100, 7, 16, 1),
])
def test_search_finds_the_largest_fitting_batch_with_few_compiles(fixed, per_row, base_rows,
                                                                  step):
    capacity, calls, limit = 500, [], 256
    measure = _linear(fixed, per_row, capacity, calls)
    best = (capacity - fixed) // per_row // step * step
    found, failing = largest_fitting(measure, measure(base_rows), step, limit)
    assert found.rows == best and found.fits
    assert failing == best + step
    assert len(calls) <= 1 + 1 + 2  # base, probe, prediction (+ one confirmation)


def test_search_reports_none_when_not_even_one_step_fits():
    calls = []
    measure = _linear(600, 10, 500, calls)
    found, failing = largest_fitting(measure, measure(16), 2, 64)
    assert found is None and failing == 2


def test_search_stops_at_the_limit_when_everything_fits():
    calls = []
    measure = _linear(0, 1, 10**9, calls)
    found, failing = largest_fitting(measure, measure(16), 4, 64)
    assert found.rows == 64 and failing is None


@pytest.mark.parametrize("accelerator, shape, expected", [
    ("tpu-v5-lite-podslice", "2x2", "v5e:2x2"), ("tpu-v5-lite-podslice", "4x4", "v5e:4x4"),
    ("tpu-v5p-slice", "2x2x1", "v5p:2x2x1"), ("tpu-v6e-slice", "2x4", "v6e:2x4"),
])
def test_gke_node_selectors_name_their_slice(accelerator, shape, expected):
    from splitrl_app.planning.targets import gke_topology

    assert gke_topology({"cloud.google.com/gke-tpu-accelerator": accelerator,
                         "cloud.google.com/gke-tpu-topology": shape}) == expected


def test_a_node_selector_without_a_tpu_is_refused_by_its_labels():
    from splitrl_app.planning.targets import gke_topology

    with pytest.raises(PlanError, match="gke-tpu-accelerator"):
        gke_topology({"cloud.google.com/gke-nodepool": "default"})
