"""Real reward, sampler and trainer processes with the shared token, shared by this folder."""

from __future__ import annotations

import pytest
from services import start_services

from splitrl.init_model import init_model


@pytest.fixture(scope="session")
def services(tmp_path_factory):
    directory = tmp_path_factory.mktemp("security")
    model = init_model(directory / "tiny-arith", family="qwen2", preset="tiny",
                       vocab="arithmetic", seed=0)
    launcher, running = start_services(directory, model)
    try:
        yield running
    finally:
        launcher.stop()
    # Every service stops cleanly on SIGTERM after what it went through.
    codes = {name: s.proc.returncode for name, s in running.items()}
    bad = {name: code for name, code in codes.items() if code != 0}
    assert not bad, {name: (code, running[name].tail()) for name, code in bad.items()}
