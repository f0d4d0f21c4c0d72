"""The gke-tpu overlay, planned: its run config (the ConfigMap plus each container's arguments,
as the pods load them) compiles and fits on the TPU slices its node pools request (read from
the rendered manifests' nodeSelectors), with the model the pods' init container writes.

Needs libtpu (the TPU compiler, no TPU; the test extra installs it, which is how CI runs
this) and kubectl (renders the overlay offline).
"""

from __future__ import annotations

import pytest
from deploy_helpers import find, pod_spec
from test_k8s_manifests import _config_for

from splitrl.models import load_config as load_model_config
from splitrl_app import cli
from splitrl_app.planning import format_reports, libtpu_installed, plan_run, tpu_target
from splitrl_app.planning.targets import gke_topology

pytestmark = [
    pytest.mark.slow,  # compiles the trainer for 16 chips and the sampler for 4 (~1 min)
    pytest.mark.skipif(not libtpu_installed(), reason="libtpu (the TPU compiler) is not "
                       "installed: pip install -e '.[tpu-plan]' (the test extra includes it)"),
]


def test_gke_tpu_overlay_compiles_and_fits_on_the_slices_its_node_pools_request(
        rendered, tmp_path, monkeypatch, capsys):
    docs = rendered["gke-tpu"]
    reports, model_dir = [], tmp_path / "model"
    for kind, name in (("Job", "trainer"), ("Deployment", "sampler")):
        workload, _, _, cfg = _config_for(docs, tmp_path, kind, name, name, monkeypatch)
        if not model_dir.exists():  # the init container's own command, into a scratch dir
            init = next(c for c in pod_spec(workload)["initContainers"]
                        if c["name"] == "init-model")
            assert cli.main([str(model_dir) if a == cfg.model.path else a
                             for a in init["args"]]) == 0
        target = tpu_target(gke_topology(pod_spec(workload)["nodeSelector"]))
        reports += plan_run(cfg, load_model_config(model_dir), {name: target}, search=False)
    print(format_reports(reports))
    by_service = {r.service: r for r in reports}
    trainer, sampler = by_service["trainer"], by_service["sampler"]
    # The trainer Job's 4 hosts x 4 chips compile as one program over the 4x4 slice.
    job = find(docs, "Job", "trainer")
    assert len(trainer.target.devices) == 16 == 4 * job["spec"]["completions"]
    assert trainer.mesh == {"fsdp": 16} and sampler.mesh == {"tensor": 4}
    assert trainer.target.device_kind == sampler.target.device_kind == "TPU v5 lite"
    for r in reports:
        assert r.fits, format_reports([r])
        assert r.measurement.categories["parameters"] > 0
    assert "DOES NOT FIT" not in capsys.readouterr().out
