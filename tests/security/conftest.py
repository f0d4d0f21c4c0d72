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
    running = start_services(directory, model)
    yield running
    codes = {name: service.stop() for name, service in running.items()}
    for name, service in running.items():
        assert service.proc.returncode is not None, name
    # Every service stops cleanly on SIGTERM after what it went through.
    bad = {name: code for name, code in codes.items() if code not in (0, -15)}
    assert not bad, {name: running[name].tail() for name in bad}
