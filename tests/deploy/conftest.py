"""Render every overlay once per session (kubectl kustomize, offline) from a scratch copy."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from deploy_helpers import OVERLAYS, copy_deploy

from splitrl_app import k8s


@pytest.fixture(scope="session")
def kubectl() -> str:
    exe = shutil.which("kubectl")
    if exe is None:
        pytest.skip("kubectl is not installed (it renders the kustomize overlays)")
    return exe


@pytest.fixture(scope="session")
def deploy_root(tmp_path_factory) -> Path:
    return copy_deploy(tmp_path_factory.mktemp("deploy"))


@pytest.fixture(scope="session")
def rendered(kubectl, deploy_root) -> dict[str, list[dict]]:
    """overlay name -> rendered objects, through ``splitrl k8s render``'s code path."""
    out = {}
    for name in OVERLAYS:
        text = k8s.render(name, root=deploy_root)
        out[name] = [d for d in yaml.safe_load_all(text) if d]
    return out
