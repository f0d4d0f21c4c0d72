"""``splitrl up``: a whole disaggregated run as local processes on 127.0.0.1.

Starts the reward service, ``services.num_samplers`` samplers and the trainer, each its own
process with its own emulated devices (``XLA_FLAGS=--xla_force_host_platform_device_count``
sized to its mesh), shows one combined progress view from the trainer's ``Status``, and stops
everything cleanly at the end or on Ctrl-C. The run directory holds the resolved config, one
log file per process, metrics, plots, checkpoints and the exported model.

Mistakes surface on the console, early: the data (paths, fields, splits, prompts too long for
the samplers), a run directory whose checkpoint belongs to another config, and trackers that are
not installed are found before any service starts; error lines of every service's log are
shown as they are written; and a service that exits leaves its last error lines on the console,
not only its exit code. What the run is doing while the bar stands still (services starting,
programs compiling, the first evaluation) is said in one line per phase.

With ``services.metrics_port`` set, each process serves Prometheus metrics on a port of its own
(they share a host here), listed in ``<run_dir>/prometheus.json`` in Prometheus' file-based
service discovery format (``file_sd_configs``).

Ctrl-C (or SIGTERM) stops the run cleanly: the trainer checkpoints the step it is at, and the
launcher says where it stopped and that the same command continues from there; exit code 0.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from importlib import resources
from pathlib import Path

from splitrl.config import Config, dump_config
from splitrl.jsonl import drop_torn_tail
from splitrl.retry import wait_until
from splitrl.serving import LAUNCHER_PID_ENV, check_health, make_channel
from splitrl.user_cache import cache_dir
from splitrl_app.oom import OomWitness
from splitrl_app.service_logs import LogFollower, error_lines
from trainer_service.orchestration.evaluation import accuracy_line

DEMO_CONFIG = "demo.yaml"


# Ports picked by `free_port`, each with the socket that holds it until `release_port`.
_HELD_PORTS: dict[int, socket.socket] = {}


def free_port() -> int:
    """A TCP port on 127.0.0.1 for a service this process starts next, held until
    :func:`release_port` (or until this process ends).

    Binding port 0 and closing the socket at once leaves the port free for anyone until the
    service binds it, seconds later after its imports: the next such pick in this process
    (measured: 12 of 20,000 batches of five picks repeated a port) or any bind to port 0 on
    the host may take it, and the service dies with "address already in use". So the socket
    stays bound, and the kernel gives its port to no other bind or outgoing connection. With
    SO_REUSEADDR set on it after the exclusive bind, the service's own socket (gRPC and the
    metrics server set SO_REUSEADDR too) binds and listens beside it; connections only ever
    reach the listening one, and a service restarted on its port binds the same way."""
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", 0))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    except OSError:
        sock.close()
        raise
    port = sock.getsockname()[1]
    _HELD_PORTS[port] = sock
    return port


def release_port(port: int) -> None:
    """Stop holding a port :func:`free_port` gave (its service has stopped)."""
    sock = _HELD_PORTS.pop(port, None)
    if sock is not None:
        sock.close()


# Less free space than this where the logs are: a process that failed there may not have been
# able to log why, so its exit report says the disk is full.
FULL_DISK_BYTES = 64 * 1024


class Launcher:
    def __init__(self, cfg: Config, python: str = sys.executable):
        self.cfg = cfg
        self.python = python
        self.run_dir = Path(cfg.trainer.run_dir)
        self.log_dir = self.run_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.config_path = self.run_dir / "launch.yaml"
        pin_tokenizer_class(cfg)
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
        env.setdefault("JAX_COMPILATION_CACHE_DIR", str(cache_dir() / "xla"))
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
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
        SIGKILL, whether the OOM killer did it (`splitrl_app.oom`) and, if so, the
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
        self.start("reward", "reward", [])
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

    def start_trainer(self):
        """Start (or, after it died, restart) the trainer, pointed at the launched samplers."""
        addresses = "[" + ",".join(self.sampler_addresses) + "]"
        return self.start(
            "trainer",
            "trainer",
            [f"services.sampler_addresses={addresses}"],
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

    def watch(self) -> int:
        """Combined progress until the trainer exits; returns its exit code."""
        from tqdm import tqdm

        trainer = self.procs["trainer"]
        bar = tqdm(total=self.cfg.trainer.steps, desc="splitrl", unit="step",
                   dynamic_ncols=True, file=sys.stdout)
        follower = LogFollower({n: self.log_dir / f"{n}.log" for n in self.procs},
                               self.log_starts)
        reported: set[str] = set()
        phases = PhaseReporter(bar.write)
        plots_loader = None

        def show_errors() -> None:
            for line in follower.new_errors():
                bar.write(line, file=sys.stderr)
            for name, proc in self.procs.items():
                if name != "trainer" and name not in reported and proc.poll() is not None:
                    reported.add(name)
                    bar.write(self.exit_report(name), file=sys.stderr)

        try:
            while trainer.poll() is None:
                self.check_interrupted()
                show_errors()
                try:
                    status = self.status()
                except Exception:
                    time.sleep(1.0)
                    continue
                metrics = status.last_metrics
                phases.observe(status.state, status.step)
                if status.state == "training" and plots_loader is None:
                    plots_loader = _load_plotting_in_background()
                bar.n = status.step
                bar.set_postfix(
                    state=status.state,
                    v=status.weight_version,
                    reward=f"{metrics.get('reward/mean', 0.0):.2f}",
                    acc=f"{metrics.get('accuracy/mean', 0.0):.2f}",
                    samplers=sampler_count(status),
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


# What the prompt length check printed, per data, tokenizer and limits (:func:`check_data`).
_LENGTH_CHECKS = "prompt-length-checks.json"


def check_data(cfg: Config) -> str | None:
    """The run's data as the trainer will load it (paths, fields, splits, prompt lengths),
    before any service starts: None if it loads, else why not. Prints what the prompt length
    check dropped or truncated.

    The lengths need the tokenizer, and importing transformers to load it was most of a
    launch's time before any service started (bench/README.md). A check that passed is
    remembered in the user cache under :func:`_length_check_key` (the rows, the tokenizer's
    files, the limits): a launch on the same data and tokenizer prints what that one printed
    and loads no tokenizer. The trainer checks the lengths itself either way."""
    import logging

    from splitrl.tokenizer import load_tokenizer
    from splitrl.user_cache import read_json, update_json
    from trainer_service.orchestration.data import PromptStream

    quiet = logging.getLogger("trainer_service.orchestration.prompt_length")
    level, quiet.level = quiet.level, logging.ERROR  # the summary below says it once
    try:
        tokenizer = pin_tokenizer_class(cfg)  # loads one only when the class is not known
        key = _length_check_key(cfg, PromptStream.from_config(cfg.trainer.data))
        lines = read_json(_LENGTH_CHECKS).get(key) if key is not None else None
        if not isinstance(lines, list):
            tokenizer = tokenizer or load_tokenizer(cfg.model.path, cfg.model.tokenizer_class)
            stream = PromptStream.for_run(cfg, tokenizer=tokenizer)
            lines = [_too_long_line(report) for report in stream.length_reports.values()
                     if report.too_long]
            if key is not None:
                update_json(_LENGTH_CHECKS, key, lines)
    except (ValueError, OSError) as e:
        return str(e)
    finally:
        quiet.setLevel(level)
    for line in lines:
        print(line, flush=True)
    return None


def _too_long_line(report) -> str:
    ids = ", ".join(pid for pid, _ in report.too_long[:5])
    more = ", ..." if len(report.too_long) > 5 else ""
    return f"data: {report.summary()} (data.long_prompt_policy={report.policy}): {ids}{more}"


def _length_check_key(cfg: Config, stream) -> str | None:
    """Names what the prompt length check's outcome depends on: the tokenizer (its files and
    the transformers version, :func:`splitrl.tokenizer.tokenizer_fingerprint`), the class
    loading it, the code that renders and counts prompts (another SplitRL may render them
    otherwise), the data settings and token limit, and every row of ``stream`` (loaded without
    a tokenizer). None for a model on a hub (nothing to fingerprint without fetching)."""
    import hashlib

    import splitrl.tokenizer
    from splitrl.config import to_dict
    from trainer_service.orchestration import data, prompt_length

    tokenizer = splitrl.tokenizer.tokenizer_fingerprint(cfg.model.path)
    if tokenizer is None:
        return None
    digest = hashlib.sha256(tokenizer.encode())
    for module in (splitrl.tokenizer, data, prompt_length):
        digest.update(Path(module.__file__).read_bytes())
    for part in (to_dict(cfg.trainer.data), cfg.prompt_token_limit(), cfg.model.tokenizer_class,
                 list(stream.rows), list(stream.eval_split_rows)):
        digest.update(json.dumps(part, sort_keys=True, default=str).encode() + b"\0")
    return digest.hexdigest()


def pin_tokenizer_class(cfg: Config):
    """Sets ``model.tokenizer_class`` (when the config leaves it null) to the class
    AutoTokenizer chooses for the model, so every service this launcher starts loads that
    class directly: the same tokenizer, without the torch import that AutoTokenizer's class
    resolution costs each process (``splitrl.tokenizer.load_tokenizer``). Resolved once, here,
    and remembered for these tokenizer files (``splitrl.tokenizer.remembered_tokenizer_class``),
    so the next launch does not import torch either. Left null for a model directory without
    a tokenizer or a tokenizer class from the checkpoint's own code; the services then decide
    as before. Returns the tokenizer when resolving loaded it, else None."""
    from splitrl.tokenizer import (
        exported_class_name,
        has_tokenizer,
        load_tokenizer,
        remember_tokenizer_class,
        remembered_tokenizer_class,
    )

    path = cfg.model.path
    if cfg.model.tokenizer_class is not None:
        return None
    if Path(path).is_dir() and not has_tokenizer(path):
        return None
    cfg.model.tokenizer_class = remembered_tokenizer_class(path)
    if cfg.model.tokenizer_class is not None:
        return None
    try:
        tokenizer = load_tokenizer(path)
    except (ValueError, OSError):
        return None  # the services report it, each in its own terms
    cfg.model.tokenizer_class = exported_class_name(tokenizer)
    if cfg.model.tokenizer_class is not None:
        remember_tokenizer_class(path, cfg.model.tokenizer_class)
    return tokenizer


def sampler_count(status) -> str:
    """The bar's ``samplers=R/N``: R samplers ready (holding the current weights, taking
    work) of the N the trainer knows (docs/runs.md), both from the trainer's own pool."""
    return f"{sum(s.healthy for s in status.samplers)}/{len(status.samplers)}"


def say(message: str) -> None:
    print(message, flush=True)


class PhaseReporter:
    """One console line when the trainer enters a phase, so a bar at 0 is never silent."""

    def __init__(self, write):
        self.write = write
        self.state: str | None = None
        self.trained = False
        self.start_step: int | None = None

    def observe(self, state: str, step: int) -> None:
        if self.start_step is None:  # the trainer's first status: the step it resumed at (or
            self.start_step = step  # 0), before a step that may end between two polls
        if state == self.state:
            return
        self.state = state
        if state == "starting":
            self.write("trainer: loading the model, restoring a checkpoint if there is one, "
                       "waiting for the samplers")
        elif state == "evaluating":
            self.write(f"trainer: greedy evaluation at step {step}" + (
                "" if self.trained else " (the samplers compile their programs on first use)"))
        elif state == "training" and not self.trained:
            self.trained = True
            self.write(f"trainer: training from step {self.start_step} (the first step compiles "
                       "the train program)")


def preflight(cfg: Config, memory_bytes: int | None = None) -> str | None:
    """What stops the run before any service starts: a model path with no model, unusable
    data, a run directory whose checkpoint belongs to another config, a tracker that cannot
    be used, a launch that cannot fit in memory (:func:`check_memory`, against
    ``memory_bytes``; default the host's)."""
    from splitrl.model_path import model_problem
    from trainer_service.resume import resume_problem
    from trainer_service.tracking import missing_trackers

    problem = model_problem(cfg.model.path)
    if problem is not None:
        return f"the model cannot be used: {problem}"
    problem = check_data(cfg)
    if problem is not None:
        return f"the data cannot be used: {problem}"
    problem = resume_problem(cfg)
    if problem is not None:
        return f"will not resume: {problem}"
    return missing_trackers(cfg.trainer.report_to) or check_memory(cfg, memory_bytes)


def check_memory(cfg: Config, memory_bytes: int | None = None) -> str | None:
    """The launch's processes, estimated (`splitrl_app.planning.estimate`: arithmetic on the
    model's config.json, no compile) against the host's memory, since every service of a local
    launch runs on this host's CPU: None when it fits; when it does not and
    ``trainer.micro_batch_size`` is unset, the largest micro-batch that fits is set in ``cfg``
    (and said); else why not, with the numbers and the setting to change. Services on an
    accelerator (``JAX_PLATFORMS`` other than cpu) or a model on a hub (no config.json here)
    are not estimated: ``splitrl plan`` compiles for them."""
    from splitrl_app.planning.estimate import ModelShape, host_memory_bytes, plan_launch

    if os.environ.get("JAX_PLATFORMS", "cpu") != "cpu":
        return None
    model = ModelShape.from_model_dir(cfg.model.path)
    if model is None:
        return None
    devices = {"trainer": cfg.trainer.mesh.devices_needed(),
               "sampler": cfg.sampler.mesh.devices_needed()}
    memory = host_memory_bytes() if memory_bytes is None else memory_bytes
    plan = plan_launch(cfg, model, devices, memory, _eval_prompts(cfg))
    configured, fitting = plan.configured, plan.fitting
    if configured.fits:
        return None
    if fitting is not None and cfg.trainer.micro_batch_size is None:
        cfg.trainer.micro_batch_size = fitting.micro_batch
        say(f"memory: trainer.micro_batch_size={fitting.micro_batch} chosen: the whole batch "
            f"at once ({configured.micro_batch} rows) would need {configured.describe()}; in "
            f"micro-batches of {fitting.micro_batch} rows the launch needs about "
            f"{fitting.total / 2**30:.2f} GiB (set trainer.micro_batch_size to choose)")
        return None
    if fitting is not None:
        return (f"out of memory: this launch would need {configured.describe()}. Set "
                f"trainer.micro_batch_size={fitting.micro_batch} (about "
                f"{fitting.total / 2**30:.2f} GiB) or smaller")
    return (f"out of memory: this launch would need {configured.describe()}, and does not fit "
            f"at the smallest micro-batch either. Use less memory with a smaller "
            f"sampler.max_batch_size or a sampler.kv_cache_bytes budget, fewer "
            f"services.num_samplers, a shorter sampler.max_sequence_length or "
            f"model.dtype=bfloat16")


def _eval_prompts(cfg: Config) -> int:
    """The prompts one evaluation sends at once (0 without evaluations): a sampler may get
    all of them, up to its batch."""
    t = cfg.trainer
    if t.data.eval_split is None or not (t.eval_before or t.eval_after or t.eval_every):
        return 0
    from trainer_service.orchestration.data import PromptStream

    try:
        return len(PromptStream.from_config(t.data).eval_rows())
    except (ValueError, OSError):  # check_data said it loads; the trainer reports otherwise
        return 0


def continue_command(launcher: Launcher) -> str:
    """The command that continues this run: the one that started it, when it was splitrl's."""
    if Path(sys.argv[0]).name in ("splitrl", "__main__.py"):
        return shlex.join(["splitrl", *sys.argv[1:]])
    return f"splitrl up --config {launcher.config_path}"


def main(cfg: Config) -> int:
    problem = preflight(cfg)
    if problem is not None:
        print(f"splitrl up: {problem}", file=sys.stderr, flush=True)
        return 2
    launcher = Launcher(cfg)
    code, interrupted, start_failed = 1, False, False
    say(f"run directory: {launcher.run_dir}")

    def interrupt(signum, _frame):
        launcher.interrupted.set()  # seen at the next wait even if the exception is lost
        raise KeyboardInterrupt

    # Installed for SIGINT too: a process started with SIGINT ignored (a background job of a
    # non-interactive shell, a nohup'd script, some CI runners) keeps it ignored in Python, and
    # Ctrl-C / `kill -INT` would never stop the run.
    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    plots = None
    try:
        launcher.up()
        say("reward functions: " + "; ".join(launcher.reward_functions()))
        code = launcher.watch()
        launcher.signal_stop()
        if launcher.attempt_summary().get("state") in ("done", "stopped"):
            plots = _plot_in_background(launcher.run_dir)  # while the services shut down
    except KeyboardInterrupt:
        interrupted = True
        say("\ninterrupted: stopping the run (the trainer checkpoints the step it is at)")
    except (RuntimeError, TimeoutError) as e:  # a service did not start
        start_failed = True  # the trainer, started beside it, is stopped: nothing to report
        print(f"splitrl up: {e}", file=sys.stderr, flush=True)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        launcher.stop()
    trainer = launcher.procs.get("trainer")
    if interrupted:  # a clean stop is a success; a trainer that failed while stopping is not
        code = 0 if trainer is None or trainer.returncode == -signal.SIGTERM else (
            trainer.returncode)  # -SIGTERM: stopped while starting, before it had a handler
    summary = {} if start_failed else launcher.attempt_summary()
    line = accuracy_line(summary)
    if line:
        say(line)
    if summary.get("state") == "stopped" or (interrupted and code == 0):
        step = int(summary.get("step", 0))
        where = (f"stopped at step {step} of {int(summary.get('total_steps', cfg.trainer.steps))}"
                 f"; checkpoint in {launcher.run_dir}" if step else
                 "stopped before the first step")
        say(f"{where}. To continue from there: {continue_command(launcher)}")
    if plots is not None:  # started when the trainer finished, while the services stopped
        plots.join()
    elif summary.get("state") in ("done", "stopped"):
        _plot(launcher.run_dir)
    if code != 0 and trainer is not None and not start_failed:
        print(launcher.exit_report("trainer"), file=sys.stderr)
    if code != 0:
        print(f"the run failed (exit code {code}); logs: {launcher.log_dir}", file=sys.stderr)
    return code


def _plot(run_dir: Path) -> None:
    """`splitrl plot` of the run: a convenience that never fails the run."""
    try:
        from splitrl_app.plots import main as plot

        plot(str(run_dir))
    except Exception as e:  # plots are a convenience; never fail the run on them
        say(f"(plots skipped: {e})")


def _load_plotting_in_background() -> threading.Thread:
    """Import matplotlib in a thread while the run trains (a synchronous run keeps about one
    core busy, the sampler or the trainer), so plotting at the end only draws."""

    def load():
        try:
            from splitrl_app.plots import load_matplotlib

            load_matplotlib()
        except Exception:  # _plot reports it at the end, if plotting fails
            pass

    thread = threading.Thread(target=load, name="plots-import", daemon=True)
    thread.start()
    return thread


def _plot_in_background(run_dir: Path) -> threading.Thread:
    """`_plot` of a finished run in a thread, so the plots render while the services shut
    down."""
    thread = threading.Thread(target=_plot, args=(run_dir,), name="plots", daemon=True)
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
