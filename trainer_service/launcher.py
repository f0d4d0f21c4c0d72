"""``splitrl up``: a whole disaggregated run as local processes on 127.0.0.1.

Starts the reward service, ``services.num_samplers`` samplers and the trainer, each its own
process with its own emulated devices (``XLA_FLAGS=--xla_force_host_platform_device_count``
sized to its mesh), shows one combined progress view from the trainer's ``Status``, and stops
everything cleanly at the end or on Ctrl-C. The run directory holds the resolved config, one
log file per process, metrics, plots, checkpoints and the exported model.

Mistakes surface on the console, early: the data (paths, fields, splits, prompts too long for
the samplers) is checked before any service starts; error lines of every service's log are
shown as they are written; and a service that exits leaves its last error lines on the console,
not only its exit code.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from importlib import resources
from pathlib import Path

from splitrl.config import Config, MeshConfig, dump_config
from splitrl.serving import check_health, make_channel
from trainer_service.service_logs import LogFollower, error_lines

DEMO_CONFIG = "demo.yaml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def devices_for(mesh: MeshConfig) -> int:
    """Emulated devices a process needs for ``mesh`` (a -1 axis gets one device)."""
    fixed = math.prod(v for v in mesh.axes.values() if v > 0)
    return max(1, int(math.ceil(fixed / mesh.device_fraction)) + mesh.device_offset)


class Launcher:
    def __init__(self, cfg: Config, python: str = sys.executable):
        self.cfg = cfg
        self.python = python
        self.run_dir = Path(cfg.trainer.run_dir)
        self.log_dir = self.run_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.config_path = self.run_dir / "launch.yaml"
        dump_config(cfg, self.config_path)
        self.procs: dict[str, subprocess.Popen] = {}
        self.reward_address = f"127.0.0.1:{free_port()}"
        self.trainer_address = f"127.0.0.1:{free_port()}"
        self.sampler_addresses = [
            f"127.0.0.1:{free_port()}" for _ in range(cfg.services.num_samplers)
        ]

    def _env(self, devices: int) -> dict[str, str]:
        env = dict(os.environ)
        flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
        env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
        env.setdefault("JAX_PLATFORMS", "cpu")
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("HF_DATASETS_OFFLINE", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        # Every service compiles the same programs run after run: keep them on disk.
        env.setdefault("JAX_COMPILATION_CACHE_DIR",
                       str(Path.home() / ".cache" / "splitrl" / "xla"))
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def start(self, name: str, command: str, overrides: list[str], devices: int = 1):
        args = [self.python, "-m", "splitrl", command, "--config", str(self.config_path)]
        args += [
            f"services.reward_address={self.reward_address}",
            f"services.trainer_address={self.trainer_address}",
            *overrides,
        ]
        log = (self.log_dir / f"{name}.log").open("ab")
        self.procs[name] = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env=self._env(devices),
            start_new_session=True,
        )
        return self.procs[name]

    def wait_healthy(self, name: str, address: str, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            proc = self.procs[name]
            if proc.poll() is not None:
                raise RuntimeError(self.exit_report(name))
            if check_health(address, timeout_s=1.0, auth=self.cfg.services.auth):
                return
            time.sleep(0.3)
        raise TimeoutError(f"{name} at {address} not healthy after {timeout_s:.0f}s")

    def exit_report(self, name: str) -> str:
        """``name`` exited: its exit code and the last error lines of its log."""
        log = self.log_dir / f"{name}.log"
        lines = "\n".join(f"  {line}" for line in error_lines(log))
        return (f"{name} exited with code {self.procs[name].returncode}; last errors in "
                f"{log}:\n{lines}")

    def start_sampler(self, index: int, address: str | None = None) -> str:
        address = address or f"127.0.0.1:{free_port()}"
        port = address.rsplit(":", 1)[1]
        self.start(
            f"sampler-{index}",
            "sampler",
            [f"services.sampler_port={port}", f"run_name={self.cfg.run_name}-sampler-{index}"],
            devices_for(self.cfg.sampler.mesh),
        )
        return address

    def up(self) -> None:
        """Start every service. The trainer starts as soon as the reward service answers (a
        broken reward function stops the launch before any trainer exists), not after the
        samplers: its start-up (imports, model, optimizer state, compiling its train step)
        then overlaps theirs, and it finds the samplers when they are up (it probes them;
        they register with it)."""
        self.start("reward", "reward", [])
        for i, address in enumerate(self.sampler_addresses):
            self.start_sampler(i, address)
        self.wait_healthy("reward", self.reward_address)
        self.start_trainer()
        for i, address in enumerate(self.sampler_addresses):
            self.wait_healthy(f"sampler-{i}", address)

    def start_trainer(self):
        """Start (or, after it died, restart) the trainer, pointed at the launched samplers."""
        addresses = "[" + ",".join(self.sampler_addresses) + "]"
        return self.start(
            "trainer",
            "trainer",
            [f"services.sampler_addresses={addresses}"],
            devices_for(self.cfg.trainer.mesh),
        )

    def stop(self, grace_s: float = 15.0) -> None:
        order = ["trainer"] + [n for n in self.procs if n.startswith("sampler")] + ["reward"]
        for name in order:
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for name in order:
            proc = self.procs.get(name)
            if proc is None:
                continue
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

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

    def watch(self) -> int:
        """Combined progress until the trainer exits; returns its exit code."""
        from tqdm import tqdm

        trainer = self.procs["trainer"]
        bar = tqdm(total=self.cfg.trainer.steps, desc="splitrl", unit="step",
                   dynamic_ncols=True, file=sys.stdout)
        follower = LogFollower({n: self.log_dir / f"{n}.log" for n in self.procs})
        reported: set[str] = set()

        def show_errors() -> None:
            for line in follower.new_errors():
                bar.write(line, file=sys.stderr)
            for name, proc in self.procs.items():
                if name != "trainer" and name not in reported and proc.poll() is not None:
                    reported.add(name)
                    bar.write(self.exit_report(name), file=sys.stderr)

        try:
            while trainer.poll() is None:
                show_errors()
                alive = sum(
                    1 for n, p in self.procs.items() if n.startswith("sampler") and
                    p.poll() is None
                )
                try:
                    status = self.status()
                except Exception:
                    time.sleep(1.0)
                    continue
                metrics = status.last_metrics
                bar.n = status.step
                bar.set_postfix(
                    state=status.state,
                    v=status.weight_version,
                    reward=f"{metrics.get('reward/mean', 0.0):.2f}",
                    acc=f"{metrics.get('accuracy/mean', 0.0):.2f}",
                    samplers=f"{sum(s.healthy for s in status.samplers)}/{alive}",
                    refresh=True,
                )
                try:  # a second between refreshes, but the trainer's exit is seen at once
                    trainer.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    pass
            show_errors()
        finally:
            bar.close()
        return trainer.returncode


def check_data(cfg: Config) -> str | None:
    """The run's data as the trainer will load it (paths, fields, splits, prompt lengths),
    before any service starts: None if it loads, else why not. Prints what the prompt length
    check dropped or truncated."""
    import logging

    from splitrl.tokenizer import load_tokenizer
    from trainer_service.orchestration.data import PromptStream

    quiet = logging.getLogger("trainer_service.orchestration.prompt_length")
    level, quiet.level = quiet.level, logging.ERROR  # the summary below says it once
    try:
        stream = PromptStream.for_run(cfg, tokenizer=load_tokenizer(cfg.model.path))
    except (ValueError, OSError) as e:
        return str(e)
    finally:
        quiet.setLevel(level)
    for report in stream.length_reports.values():
        if report.too_long:
            ids = ", ".join(pid for pid, _ in report.too_long[:5])
            more = ", ..." if len(report.too_long) > 5 else ""
            print(f"data: {report.summary()} (data.long_prompt_policy="
                  f"{report.policy}): {ids}{more}", flush=True)
    return None


def main(cfg: Config) -> int:
    problem = check_data(cfg)
    if problem is not None:
        print(f"splitrl up: the data cannot be used: {problem}", file=sys.stderr, flush=True)
        return 2
    launcher = Launcher(cfg)
    code = 1
    print(f"run directory: {launcher.run_dir}", flush=True)

    def interrupt(signum, _frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    plots = None
    try:
        launcher.up()
        print("reward functions: " + "; ".join(launcher.reward_functions()), flush=True)
        code = launcher.watch()
        plots = _plot_in_background(launcher.run_dir)  # while the services shut down
    except KeyboardInterrupt:
        print("\ninterrupted: stopping the run (the trainer checkpoints what it has)", flush=True)
    except (RuntimeError, TimeoutError) as e:  # a service did not start
        print(f"splitrl up: {e}", file=sys.stderr, flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
        launcher.stop()
    summary_path = launcher.run_dir / "summary.json"
    if summary_path.exists():
        summary = json.loads(summary_path.read_text())
        before = summary.get("eval_before/accuracy")
        after = summary.get("eval_after/accuracy")
        if before is not None and after is not None:
            print(f"greedy accuracy on the evaluation prompts: {before:.3f} -> {after:.3f}")
    if plots is not None:
        plots.join()
    if code != 0 and "trainer" in launcher.procs:
        print(launcher.exit_report("trainer"), file=sys.stderr)
    if code != 0:
        print(f"the run failed (exit code {code}); logs: {launcher.log_dir}", file=sys.stderr)
    return code


def _plot_in_background(run_dir: Path) -> threading.Thread | None:
    """`splitrl plot` of a finished run (summary.json written), in a thread: a convenience
    that never fails the run."""
    if not (run_dir / "summary.json").exists():
        return None

    def plot():
        try:
            from trainer_service.plots import main as plot_run

            plot_run(str(run_dir))
        except Exception as e:
            print(f"(plots skipped: {e})")

    thread = threading.Thread(target=plot, name="plots", daemon=True)
    thread.start()
    return thread


def demo_config_path() -> Path:
    return Path(str(resources.files("splitrl") / "configs" / DEMO_CONFIG))


def demo(cfg: Config) -> int:
    """``make demo``: the built-in tiny arithmetic run; the model is created on first use."""
    model = Path(cfg.model.path)
    if not (model / "config.json").exists():
        from splitrl.init_model import init_model

        print(f"creating the tiny model at {model}", flush=True)
        init_model(model, family="qwen2", preset="tiny", vocab="arithmetic",
                   seed=cfg.trainer.seed)
    return main(cfg)
