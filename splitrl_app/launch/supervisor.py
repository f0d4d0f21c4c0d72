"""The processes of a local run (``splitrl up``): start, health, exit reports, stop.

Each service is its own process with its own emulated devices
(``XLA_FLAGS=--xla_force_host_platform_device_count`` sized to its mesh), started with the
launch config (``<run_dir>/launch.yaml``) and its addresses as overrides, logging to
``<run_dir>/logs/<name>.log``. With ``services.metrics_port`` set, each process serves
Prometheus metrics on a port of its own (they share a host here), listed in
``<run_dir>/prometheus.json`` in Prometheus' file-based service discovery format
(``file_sd_configs``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from splitrl.config import Config, dump_config
from splitrl.jsonl import drop_torn_tail
from splitrl.retry import wait_until
from splitrl.serving import LAUNCHER_PID_ENV, check_health, make_channel
from splitrl.user_cache import xla_cache_env
from splitrl_app.launch.console import say
from splitrl_app.launch.oom import OomWitness
from splitrl_app.launch.ports import free_port, release_port
from splitrl_app.launch.service_logs import error_lines

# Less free space than this where the logs are: a process that failed there may not have been
# able to log why, so its exit report says the disk is full.
FULL_DISK_BYTES = 64 * 1024


class Launcher:
    """The local processes of one run: each service started with its own emulated devices, its
    log, its ports and its Prometheus port; waited healthy, reported when one exits (its last
    error lines, an OOM kill and the setting that uses less memory), stopped in order."""

    def __init__(self, cfg: Config, python: str = sys.executable):
        self.cfg = cfg
        self.python = python
        self.run_dir = Path(cfg.trainer.run_dir)
        self.log_dir = self.run_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.config_path = self.run_dir / "launch.yaml"
        dump_config(cfg, self.config_path)
        self.procs: dict[str, subprocess.Popen] = {}
        # Where each process began writing its log (logs append across attempts): what the
        # console reports of a process is read from there on, never an earlier attempt's.
        self.log_starts: dict[str, int] = {}
        self.started_at = time.time()  # a summary.json older than this is an earlier attempt's
        self.ports: list[int] = []  # every port this launcher holds (free_port), for stop()
        self.reward_address = f"127.0.0.1:{self._port()}"
        self.trainer_address = f"127.0.0.1:{self._port()}"
        self.sampler_addresses = [
            f"127.0.0.1:{self._port()}" for _ in range(cfg.services.num_samplers)
        ]
        self.metrics_ports: dict[str, int] = {}  # process name -> its Prometheus port
        self.oom = OomWitness()  # the kernel's OOM kills, counted from here on
        self._signalled: set[int] = set()  # pids sent SIGTERM by signal_stop
        # Set by Ctrl-C / SIGTERM (see `main`) and checked at every wait, so a KeyboardInterrupt
        # raised where Python ignores exceptions (a `__del__`) still stops the run.
        self.interrupted = threading.Event()

    def _port(self) -> int:
        port = free_port()
        self.ports.append(port)
        return port

    def check_interrupted(self) -> None:
        """KeyboardInterrupt once Ctrl-C or SIGTERM asked the run to stop."""
        if self.interrupted.is_set():
            raise KeyboardInterrupt

    def _env(self, devices: int) -> dict[str, str]:
        env = dict(os.environ)
        flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
        env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
        env.setdefault("JAX_PLATFORMS", "cpu")
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("HF_DATASETS_OFFLINE", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        # Every service compiles the same programs run after run: keep them on disk.
        for name, value in xla_cache_env().items():
            env.setdefault(name, value)
        env["PYTHONUNBUFFERED"] = "1"
        env[LAUNCHER_PID_ENV] = str(os.getpid())  # services stop when this process is gone
        return env

    def start(self, name: str, command: str, overrides: list[str], devices: int = 1):
        args = [self.python, "-m", "splitrl_app", command, "--config", str(self.config_path)]
        args += [
            f"services.reward_address={self.reward_address}",
            f"services.trainer_address={self.trainer_address}",
            *self._metrics_override(name),
            *overrides,
        ]
        path = self.log_dir / f"{name}.log"
        drop_torn_tail(path)  # a killed process's half line: the next one starts a new line
        log = path.open("ab")
        self.log_starts[name] = log.tell()
        self.procs[name] = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env=self._env(devices),
            start_new_session=True,
        )
        return self.procs[name]

    def _metrics_override(self, name: str) -> list[str]:
        """Each process its own Prometheus port (one host: one shared port would collide),
        written to ``prometheus.json`` for Prometheus' file-based discovery."""
        if self.cfg.services.metrics_port is None:
            return []
        if name not in self.metrics_ports:
            self.metrics_ports[name] = self._port()
        port = self.metrics_ports[name]
        targets = [{"targets": [f"127.0.0.1:{p}"],
                    "labels": {"job": "splitrl", "service": n.split("-")[0], "instance_name": n,
                               "run": self.cfg.run_name}}
                   for n, p in self.metrics_ports.items()]
        (self.run_dir / "prometheus.json").write_text(json.dumps(targets, indent=2))
        return [f"services.metrics_port={port}"]

    def wait_healthy(self, name: str, address: str, timeout_s: float = 300.0) -> None:
        def exited() -> None:
            self.check_interrupted()
            if self.procs[name].poll() is not None:
                raise RuntimeError(self.exit_report(name))

        wait_until(lambda: check_health(address, timeout_s=1.0, auth=self.cfg.services.auth),
                   timeout_s=timeout_s, interval_s=0.1, check=exited,
                   what=f"{name} at {address} healthy")

    def exit_report(self, name: str) -> str:
        """``name`` exited: its exit code and the last error lines of its log; killed by
        SIGKILL, whether the OOM killer did it (`splitrl_app.launch.oom`) and, if so, the
        setting that uses less memory."""
        proc = self.procs[name]
        log = self.log_dir / f"{name}.log"
        lines = "\n".join(f"  {line}" for line in error_lines(log,
                                                                 start=self.log_starts[name]))
        how = f"exited with code {proc.returncode}"
        if proc.returncode == -signal.SIGKILL:
            verdict = self.oom.verdict(proc.pid)
            how += f", {verdict.text}"
            if verdict.oom is not False:
                how += f". {self.memory_advice(name)}"
        report = f"{name} {how}; last errors in {log}:\n{lines}"
        free = shutil.disk_usage(self.log_dir).free
        if free < FULL_DISK_BYTES:  # a service on a full disk cannot log why it failed
            report += (f"\n  the run directory's filesystem is full ({free} bytes free in "
                       f"{self.run_dir}): the logs may end before the cause. Free space and "
                       "run the same command: it resumes from the last checkpoint")
        return report

    def memory_advice(self, name: str) -> str:
        """The settings that make process ``name`` use less memory."""
        if name == "trainer":
            now = self.cfg.trainer.micro_batch_size
            return ("To use less memory: a smaller trainer.micro_batch_size (now "
                    f"{now if now is not None else 'unset: the whole batch at once'})")
        if name.startswith("sampler"):
            return ("To use less memory: a smaller sampler.max_batch_size or a "
                    "sampler.kv_cache_bytes budget, fewer services.num_samplers, or a shorter "
                    "sampler.max_sequence_length")
        return "To use less memory: fewer reward.workers"

    def start_sampler(self, index: int, address: str | None = None) -> str:
        address = address or f"127.0.0.1:{self._port()}"
        port = address.rsplit(":", 1)[1]
        self.start(
            f"sampler-{index}",
            "sampler",
            [f"services.sampler_port={port}", f"run_name={self.cfg.run_name}-sampler-{index}"],
            self.cfg.sampler.mesh.devices_needed(),
        )
        return address

    def up(self) -> None:
        """Start every service at once. The trainer's start-up (imports, model, optimizer
        state, compiling its train step) is the longest of them and comes first on the way to
        the first step, so it does not wait for the others: it finds the samplers when they
        are up (it probes them; they register with it). A reward service or sampler that
        fails to start stops the launch before any step: the launcher then stops the trainer
        too (:meth:`stop`) and says which service failed and why."""
        started = time.monotonic()
        say(f"starting the reward service, {len(self.sampler_addresses)} sampler(s) and the "
            "trainer (each loads the model; the samplers compile their programs, the trainer "
            f"its train step; logs in {self.log_dir})")
        # Devices for the reward models' mesh (none are used without reward models).
        reward = self.cfg.reward
        self.start("reward", "reward", [], reward.mesh.devices_needed() if reward.models else 1)
        for i, address in enumerate(self.sampler_addresses):
            self.start_sampler(i, address)
        self.start_trainer()
        self.wait_healthy("reward", self.reward_address)
        for i, address in enumerate(self.sampler_addresses):
            self.wait_healthy(f"sampler-{i}", address)
        say(f"services up after {time.monotonic() - started:.0f}s")
        if self.metrics_ports:
            ports = ", ".join(f"{n} {p}" for n, p in self.metrics_ports.items())
            say(f"Prometheus metrics: {ports} (targets: {self.run_dir / 'prometheus.json'})")

    def start_trainer(self, overrides: tuple[str, ...] = ()):
        """Start (or, after it died, restart) the trainer, pointed at the launched samplers;
        ``overrides`` change its config from the launch's (a restart may ask for more or fewer
        ``trainer.steps``, as ``splitrl up`` with another step count resumes a run)."""
        addresses = "[" + ",".join(self.sampler_addresses) + "]"
        return self.start(
            "trainer",
            "trainer",
            [f"services.sampler_addresses={addresses}", *overrides],
            self.cfg.trainer.mesh.devices_needed(),
        )

    def signal_stop(self) -> None:
        """SIGTERM to every service still running, trainer first, once per process (a second
        SIGTERM would cut a service's graceful stop short); :meth:`stop` waits for them."""
        for name in self._stop_order():
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None and proc.pid not in self._signalled:
                proc.send_signal(signal.SIGTERM)
                self._signalled.add(proc.pid)

    def _stop_order(self) -> list[str]:
        return ["trainer"] + [n for n in self.procs if n.startswith("sampler")] + ["reward"]

    def stop(self, grace_s: float = 60.0) -> None:
        self.signal_stop()
        deadline = time.monotonic() + grace_s
        for name in self._stop_order():
            proc = self.procs.get(name)
            if proc is None:
                continue
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for port in self.ports:
            release_port(port)
        self.ports.clear()

    def attempt_summary(self) -> dict:
        """This attempt's ``summary.json`` ({} when its trainer wrote none: an earlier
        attempt's file is not this one's success)."""
        path = self.run_dir / "summary.json"
        try:
            if path.stat().st_mtime < self.started_at:
                return {}
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return {}

    def reward_functions(self) -> list[str]:
        """The reward service's functions as "name (style style)": what it loaded, and how it
        will call each one."""
        from splitrl.v1 import reward_pb2, reward_pb2_grpc

        with make_channel(self.reward_address, auth=self.cfg.services.auth) as channel:
            reply = reward_pb2_grpc.RewardStub(channel).ListRewardFunctions(
                reward_pb2.ListRewardFunctionsRequest(), timeout=5.0)
        return [f"{f.name} ({f.style} style, weight {f.weight:g})" for f in reply.functions]

    def status(self):
        from splitrl.v1 import trainer_pb2, trainer_pb2_grpc

        with make_channel(self.trainer_address, auth=self.cfg.services.auth) as channel:
            stub = trainer_pb2_grpc.TrainerStub(channel)
            return stub.Status(trainer_pb2.StatusRequest(), timeout=2.0)
