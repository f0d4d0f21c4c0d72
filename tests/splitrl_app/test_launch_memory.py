"""`splitrl up` and memory: before any service starts, the launch's estimate against the host's
memory picks a micro-batch that fits (and says so) or stops with the numbers and the setting
to change; a service killed by SIGKILL is reported as the OOM killer's work when the kernel's
records say so, with the same advice.

The host's memory is given to `preflight` / `check_memory` (this machine's RAM cannot be made
smaller); the OOM killer's records are files in the kernel's formats, since no test here can
make the kernel kill a process for memory without a cgroup of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from splitrl.config import load_config
from splitrl_app.launch import demo, preflight, supervisor
from splitrl_app.launch.oom import OomWitness
from splitrl_app.launch.up import main as launch
from splitrl_app.planning import estimate
from tests.fresh_python import python_prints

SMOL = {  # SmolLM2-135M's config.json sizes (the model the out-of-memory report was about)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
    "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
    "tie_word_embeddings": True}
# What the report ran: 4 prompts x 4 completions, 128 new tokens, 512-token sequences.
REPORTED = ["trainer.prompts_per_step=4", "algorithm.group_size=4",
            "sampling.max_new_tokens=128", "sampler.max_sequence_length=512"]
GIB = 2**30


def config(arith_model, tmp_path, *overrides):
    return load_config(demo.demo_config_path(), [
        f"model.path={arith_model}", f"trainer.run_dir={tmp_path / 'run'}", *overrides])


@pytest.fixture
def smol(tmp_path):
    import json

    (tmp_path / "smol").mkdir()
    (tmp_path / "smol" / "config.json").write_text(json.dumps(SMOL))
    return tmp_path / "smol"


def test_the_reported_run_gets_a_micro_batch_that_fits_and_says_so(smol, tmp_path, capsys):
    cfg = config(smol, tmp_path, *REPORTED)
    assert preflight.check_memory(cfg, memory_bytes=int(23.5 * GIB)) is None
    said = capsys.readouterr().out
    # The whole batch (16 rows of 512 tokens) needs about 30 GiB in the trainer alone (the
    # plan's compile said 29.64 GiB); micro-batches of 4 rows fit beside two samplers.
    assert cfg.trainer.micro_batch_size == 4
    assert said.startswith("memory: trainer.micro_batch_size=4 chosen: the whole batch at "
                           "once (16 rows) would need about ")
    assert "the trainer 29." in said and "of 23.50 GiB (85% usable)" in said
    assert "set trainer.micro_batch_size to choose" in said


def test_a_configured_micro_batch_that_does_not_fit_stops_naming_one_that_does(smol, tmp_path,
                                                                              capsys):
    cfg = config(smol, tmp_path, *REPORTED, "trainer.micro_batch_size=16")
    problem = preflight.check_memory(cfg, memory_bytes=int(23.5 * GIB))
    assert problem.startswith("out of memory: this launch would need about ")
    assert "Set trainer.micro_batch_size=4 (about " in problem
    assert cfg.trainer.micro_batch_size == 16  # what the user set is never changed
    # Nothing fits: the samplers alone are too big for the memory.
    problem = preflight.check_memory(cfg, memory_bytes=4 * GIB)
    assert "does not fit at the smallest micro-batch either" in problem
    assert "sampler.max_batch_size" in problem and "services.num_samplers" in problem
    assert capsys.readouterr().out == ""


def test_the_demo_fits_silently_and_the_estimate_imports_no_jax(arith_model, tmp_path, capsys):
    cfg = config(arith_model, tmp_path)
    assert preflight.check_memory(cfg) is None
    assert cfg.trainer.micro_batch_size is None and capsys.readouterr().out == ""
    # What the launcher imports for the estimate costs no jax import (a launch's start-up).
    code = ("import sys\n"
            "from splitrl_app.planning.estimate import plan_launch, host_memory_bytes\n"
            "from splitrl_app.launch.oom import OomWitness\n"
            "print('jax' in sys.modules)\n")
    assert python_prints(code) == ["False"]


def test_a_launch_over_the_memory_stops_before_any_service_starts(arith_model, tmp_path,
                                                                   capsys, monkeypatch):
    # A host with less memory than the demo's processes need (this one cannot be shrunk).
    monkeypatch.setattr(estimate, "host_memory_bytes", lambda: GIB)
    assert launch(config(arith_model, tmp_path)) == 2
    err = capsys.readouterr().err
    assert "splitrl up: out of memory: this launch would need about " in err
    assert not (tmp_path / "run" / "logs").exists()


def _killed_child(up: supervisor.Launcher, name: str) -> subprocess.Popen:
    """A process of the launch (a child that would run for minutes), killed with SIGKILL."""
    (up.log_dir / f"{name}.log").write_text('{"level": "info", "msg": "step"}\n')
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    up.procs[name], up.log_starts[name] = proc, 0
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return proc


@pytest.fixture
def up(arith_model, tmp_path):
    up = supervisor.Launcher(config(arith_model, tmp_path))
    yield up
    up.stop()


def test_a_sigkill_the_kernel_log_names_is_reported_as_the_oom_killer(up, tmp_path):
    kmsg = tmp_path / "kmsg"
    up.oom = OomWitness(kernel_log=kmsg, counters=[])
    proc = _killed_child(up, "trainer")
    kmsg.write_text(f"6,1,2,-;Out of memory: Killed process {proc.pid} (python) total-vm:1kB\n")
    report = up.exit_report("trainer")
    assert report.startswith(f"trainer exited with code -9, killed by the OOM killer (out of "
                             f"memory): the kernel log says so for pid {proc.pid}. To use less "
                             f"memory: a smaller trainer.micro_batch_size (now unset")


def test_a_sigkill_while_the_cgroup_counted_an_oom_kill_is_reported_as_the_oom_killer(
        up, tmp_path):
    counter = tmp_path / "memory.events"
    counter.write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")  # cgroup v2's format
    up.oom = OomWitness(kernel_log=tmp_path / "unreadable", counters=[counter])
    _killed_child(up, "sampler-0")
    counter.write_text("low 0\nhigh 0\nmax 9\noom 2\noom_kill 2\n")  # the kernel counts a kill
    report = up.exit_report("sampler-0")
    assert ("sampler-0 exited with code -9, killed by the OOM killer (out of memory): its "
            "memory cgroup counted 1 OOM kill(s) while the launch ran. To use less memory: a "
            "smaller sampler.max_batch_size") in report


def test_a_sigkill_the_records_do_not_show_is_not_called_out_of_memory(up, tmp_path):
    counter = tmp_path / "memory.oom_control"
    counter.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 0\n")  # cgroup v1's format
    up.oom = OomWitness(kernel_log=tmp_path / "kmsg-empty", counters=[counter])
    (tmp_path / "kmsg-empty").write_text("6,1,2,-;Out of memory: Killed process 1 (init)\n")
    _killed_child(up, "trainer")
    report = up.exit_report("trainer")
    assert "killed by SIGKILL, not by the OOM killer" in report and "To use less" not in report
    # Nothing readable: the likely cause and how to check, with the advice.
    up.oom = OomWitness(kernel_log=tmp_path / "none", counters=[tmp_path / "none"])
    report = up.exit_report("trainer")
    assert "most often the kernel's OOM killer" in report and "dmesg" in report
    assert "trainer.micro_batch_size" in report
