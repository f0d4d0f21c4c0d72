"""matplotlib and the kubernetes client are extras (plots, k8s): the services run without
them, and a command that needs one says which extra to install."""

from __future__ import annotations

import sys

import pytest

from splitrl.extras import MissingExtra, require
from splitrl_app import k8s
from tests.fresh_python import python_prints


def test_the_services_import_without_the_cli_extras():
    # None in sys.modules makes an import of that package fail as if it were not installed.
    lines = python_prints(
        "import sys\n"
        "sys.modules['matplotlib'] = sys.modules['kubernetes'] = None\n"
        "import sampler_service.server, reward_service.server, trainer_service.server\n"
        "import splitrl_app.launch.up, splitrl_app.cli, splitrl_app.k8s\n"
        "print('imported')\n")
    assert lines[-1] == "imported"


def test_a_missing_extra_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingExtra, match=r"pip install 'splitrl\[plots\]'"):
        require("matplotlib", "plots", "plotting a run")


def test_splitrl_k8s_without_the_client_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "kubernetes", None)
    assert k8s.main(["status"]) == 1
    assert "pip install 'splitrl[k8s]'" in capsys.readouterr().err
