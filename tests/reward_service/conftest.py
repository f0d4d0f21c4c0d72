"""A reward server in its own process, shared by the gRPC tests of this session."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from reward_server_setup import MARKER, SERVER_CONFIG

from splitrl_app.launch.ports import free_port, release_port

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


@dataclass
class RunningServer:
    address: str
    process: subprocess.Popen
    log_path: Path

    @property
    def hang_marker(self) -> Path:
        """Written by ``hang_when_asked`` once a worker is stuck in it."""
        return self.log_path.parent / MARKER

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture(scope="session")
def reward_server(tmp_path_factory) -> RunningServer:
    """``python -m reward_service`` on 127.0.0.1, stopped with SIGTERM at the end."""
    from splitrl.serving import check_health

    tmp = tmp_path_factory.mktemp("reward_server")
    config = tmp / "reward.yaml"
    settings = yaml.safe_load(yaml.safe_dump(SERVER_CONFIG))
    for function in settings["reward"]["functions"]:
        if function.get("options", {}).get("marker") == MARKER:
            function["options"]["marker"] = str(tmp / MARKER)
    config.write_text(yaml.safe_dump(settings))
    port = free_port()
    address = f"127.0.0.1:{port}"
    log_path = tmp / "server.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(REPO)]))
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "reward_service", "--config", str(config),
             f"services.reward_address={address}"],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
        )
    server = RunningServer(address, process, log_path)
    deadline = time.monotonic() + 90
    while not check_health(address, "splitrl.v1.Reward", timeout_s=1.0):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"reward server did not become healthy:\n{server.log()[-3000:]}")
        time.sleep(0.2)
    yield server
    process.send_signal(signal.SIGTERM)
    try:
        code = process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail(f"reward server ignored SIGTERM:\n{server.log()[-3000:]}")
    release_port(port)
    assert code == 0, f"reward server exited with {code}:\n{server.log()[-3000:]}"


@pytest.fixture(scope="session")
def reward_stub(reward_server):
    from splitrl.serving import make_channel
    from splitrl.v1 import reward_pb2_grpc

    channel = make_channel(reward_server.address, max_message_bytes=64 * 1024 * 1024)
    yield reward_pb2_grpc.RewardStub(channel)
    channel.close()
