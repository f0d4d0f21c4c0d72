"""The three real services, each in its own process on 127.0.0.1, for the security tests.

One config file drives all three (as in a deployment): a tiny model, one reward function, a
sampler that does not join the trainer (so the trainer stays idle, waiting for samplers, while
serving its API), and the shared auth token. Each process logs JSON lines to its own file.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from splitrl.config import AuthConfig
from splitrl.serving import check_health

REPO = Path(__file__).resolve().parents[2]
TOKEN = "fuzz-and-auth-token"
SERVICES = ("reward", "sampler", "trainer")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServiceProcess:
    name: str
    address: str
    proc: subprocess.Popen
    log_path: Path
    _log_file: object = field(repr=False, default=None)

    def log_lines(self, start: int = 0) -> list[dict]:
        """The JSON log records from byte ``start`` of the log on (other lines skipped)."""
        with open(self.log_path, "rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
        out = []
        for line in text.splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    out.append({"unparsed": line})
            elif line.strip():
                out.append({"raw": line})
        return out

    def log_size(self) -> int:
        return self.log_path.stat().st_size

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()
        return self.proc.returncode


def write_config(directory: Path, model_dir: Path) -> tuple[Path, dict[str, str]]:
    addresses = {name: f"127.0.0.1:{free_port()}" for name in SERVICES}
    config = {
        "run_name": "security",
        "model": {"path": str(model_dir)},
        "sampling": {"max_new_tokens": 2},
        "reward": {"functions": [{"name": "exact_answer"}], "workers": 1, "timeout_s": 5.0},
        "algorithm": {"group_size": 2},
        "trainer": {"steps": 2, "prompts_per_step": 2, "run_dir": str(directory / "run"),
                    "eval_before": False, "eval_after": False,
                    "mesh": {"axes": {"fsdp": 1}, "strategy": "fsdp"}},
        "sampler": {"max_batch_size": 4, "max_sequence_length": 16,
                    "register_with_trainer": False, "reward_timeout_s": 30.0,
                    "mesh": {"axes": {"tensor": 1}, "strategy": "tp"}},
        "services": {"host": "127.0.0.1", "reward_address": addresses["reward"],
                     "trainer_address": addresses["trainer"],
                     "sampler_port": int(addresses["sampler"].rsplit(":", 1)[1]),
                     "sampler_addresses": [], "num_samplers": 0,
                     "auth": {"token": TOKEN}},
    }
    path = directory / "splitrl.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, addresses


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
               XLA_FLAGS="--xla_force_host_platform_device_count=1",
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    env.pop("SPLITRL_AUTH_TOKEN", None)
    return env


def start_services(directory: Path, model_dir: Path,
                   timeout_s: float = 300.0) -> dict[str, ServiceProcess]:
    """Start reward, sampler and trainer; return once each answers its health check."""
    config, addresses = write_config(directory, model_dir)
    running: dict[str, ServiceProcess] = {}
    for name in SERVICES:
        log_path = directory / f"{name}.log"
        log_file = open(log_path, "w")
        proc = subprocess.Popen([sys.executable, "-m", "splitrl", name, "--config", str(config)],
                                cwd=REPO, env=_env(), stdout=log_file,
                                stderr=subprocess.STDOUT)
        running[name] = ServiceProcess(name, addresses[name], proc, log_path, log_file)
    auth = AuthConfig(token=TOKEN)
    deadline = time.monotonic() + timeout_s
    try:
        for service in running.values():
            while not check_health(service.address, timeout_s=1.0, auth=auth):
                if service.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{service.name} did not become healthy:\n"
                                       f"{service.tail()}")
                time.sleep(0.2)
    except BaseException:
        for service in running.values():
            service.stop(5)
        raise
    return running
