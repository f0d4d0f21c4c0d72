"""The three real services, each in its own process on 127.0.0.1, for the security tests.

Started by the local launcher (``splitrl_app.launch.supervisor.Launcher``) from one config, as in a
deployment: a tiny model, one reward function, a sampler that does not join the trainer (so
the trainer stays idle, waiting for samplers, while serving its API), and the shared auth
token. Each process logs JSON lines to its own file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from splitrl.config import AuthConfig, load_config
from splitrl_app.launch.supervisor import Launcher

TOKEN = "fuzz-and-auth-token"
AUTH = AuthConfig(token=TOKEN)


@dataclass
class ServiceProcess:
    name: str
    address: str
    launcher: Launcher

    @property
    def proc(self):
        return self.launcher.procs[self.name]

    @property
    def log_path(self) -> Path:
        return self.launcher.log_dir / f"{self.name}.log"

    def log_lines(self, start: int = 0) -> list[dict]:
        """The log from byte ``start`` on: JSON records; other lines as {"raw": line}."""
        with open(self.log_path, "rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
        out = []
        for line in text.splitlines():
            try:
                out.append(json.loads(line) if line.startswith("{") else {"raw": line})
            except json.JSONDecodeError:
                out.append({"raw": line})
        return [r for r in out if r.get("raw", "x").strip()]

    def log_size(self) -> int:
        return self.log_path.stat().st_size

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


def start_services(directory: Path, model_dir: Path) -> tuple[Launcher, dict[str, ServiceProcess]]:
    """Start reward, sampler and trainer; return once each answers its health check."""
    cfg = load_config(None, [
        "run_name=security", f"model.path={model_dir}", "sampling.max_new_tokens=2",
        "reward.functions=[{name: exact_answer}]", "reward.workers=1", "algorithm.group_size=2",
        f"trainer.run_dir={directory / 'run'}", "trainer.steps=2", "trainer.prompts_per_step=2",
        "trainer.eval_before=false", "trainer.eval_after=false", "trainer.mesh.axes={fsdp: 1}",
        "sampler.max_batch_size=4", "sampler.max_sequence_length=16",
        "sampler.register_with_trainer=false", "sampler.mesh.axes={tensor: 1}",
        "services.num_samplers=1", f"services.auth.token={TOKEN}",
        # The trainer idles, waiting for samplers, for as long as the tests take (a loaded
        # machine made them outlast the default 600 s, and the trainer exited 1).
        "services.sampler_wait_s=86400"])
    launcher = Launcher(cfg)
    try:
        launcher.start("reward", "reward", [])
        sampler = launcher.start_sampler(0, launcher.sampler_addresses[0])
        launcher.start("trainer", "trainer", ["services.sampler_addresses=[]"],
                       cfg.trainer.mesh.devices_needed())
        running = {"reward": launcher.reward_address, "sampler": sampler,
                   "trainer": launcher.trainer_address}
        names = {"reward": "reward", "sampler": "sampler-0", "trainer": "trainer"}
        for service, address in running.items():
            launcher.wait_healthy(names[service], address)
    except BaseException:
        launcher.stop()
        raise
    return launcher, {service: ServiceProcess(names[service], address, launcher)
                      for service, address in running.items()}

