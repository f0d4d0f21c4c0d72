"""Tool use, end to end: separate reward, sampler and trainer processes on 127.0.0.1 run
multi-turn episodes of the `lookup` task (splitrl/configs/demo-tools.yaml, what `make
demo-tools` runs), with the tools in isolated worker processes of each sampler.

- A random tiny model learns to call the tool from scratch: the answer is a digit only the tool
  reveals, so greedy accuracy can rise from ~0 only through tool calls (slow); `splitrl eval`
  of its export reproduces the run's final evaluation, episodes and all.
- A sampler killed mid-episode loses nothing (slow). That short synchronous run, two samplers
  with one killed, is bitwise equal to the same config and seed run with one sampler, tool
  calls and all: which sampler answers, and a request re-sent whole after a death, change
  nothing (slow: the fast suite's variant is the episode and environment tests,
  tests/sampler_service/test_episodes.py and tests/splitrl/test_environments.py, with real
  tool workers). Single-turn runs are checked the same way, across a killed trainer, by
  tests/e2e/test_faults.py."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from splitrl.config import load_config
from splitrl.init_model import init_model
from splitrl_app.launch.supervisor import Launcher
from splitrl_app.launch.up import main as launch
from tests.e2e.harness import (
    export_digest,
    kill_service,
    status_step,
    step_metrics,
    tail,
    trained_records,
    wait_exit,
    wait_for,
)
from trainer_service.orchestration.audit import audit_run

DEMO_TOOLS = Path(__file__).resolve().parents[2] / "splitrl" / "configs" / "demo-tools.yaml"


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory):
    """The demo-tools model: a random 2-layer Qwen2 with the lookup task's vocabulary and
    tiny chat template."""
    return init_model(tmp_path_factory.mktemp("models") / "tiny-tools", vocab="lookup", seed=0)


def tools_config(model: Path, run_dir: Path, *overrides: str):
    return load_config(DEMO_TOOLS, [f"model.path={model}", f"trainer.run_dir={run_dir}",
                                    *overrides])


# The learning run: the first LEARN_STEPS of `make demo-tools`'s 150 (its learning rate is
# constant after the warm-up, so a shorter run is the first steps of the longer one). Evaluated
# every 10 steps (bench/README.md, "The tool-learning config"), the test's model (seed 0) is at
# 0.92 from step 80 and 1.0 from step 100; each of seeds 0-3 is at 0.89 or more at step 120.
LEARN_STEPS = 120


@pytest.fixture(scope="module")
def learned(tools_model, tmp_path_factory) -> Path:
    """The run directory of `make demo-tools`'s config run from the random model, for its
    first LEARN_STEPS steps."""
    run_dir = tmp_path_factory.mktemp("learn") / "run"
    cfg = tools_config(tools_model, run_dir, f"trainer.steps={LEARN_STEPS}")
    assert launch(cfg) == 0
    return run_dir


@pytest.mark.slow
def test_a_tiny_model_learns_to_call_the_tool(learned):
    run_dir = learned
    summary = json.loads((run_dir / "summary.json").read_text())
    curve = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    calls = [round(r.get("episodes/tool_calls", 0.0), 2) for r in curve if "groups" in r]
    print(f"accuracy {summary['eval_before/accuracy']:.3f} -> "
          f"{summary['eval_after/accuracy']:.3f}; tool calls per trajectory "
          f"{summary['eval_before/tool_calls']:.2f} -> {summary['eval_after/tool_calls']:.2f}; "
          f"per 10 steps: {calls[::10]}")
    # Before: no tool calls, and at most a lucky guess (a digit in ten).
    assert summary["eval_before/accuracy"] <= 0.15
    assert summary["eval_before/tool_calls"] <= 0.1
    # After: it calls the tool about once per episode and reads the answer off it.
    assert summary["eval_after/accuracy"] >= 0.8
    assert 0.8 <= summary["eval_after/tool_calls"] <= 1.2
    assert summary["eval_after/tool_status/ok"] == 1.0
    records = trained_records(run_dir)
    assert all(v == r["trainer_version"] for r in records for v in r["versions"])


@pytest.mark.slow
def test_eval_of_the_tool_task_reproduces_the_runs_after_evaluation(learned, tmp_path):
    """`splitrl eval` of the run's export runs the episodes the way the run's own final
    evaluation did (the run's config: its environment, its evaluation split): the same greedy
    accuracy and tool calls per trajectory."""
    out = subprocess.run([sys.executable, "-m", "splitrl_app", "eval", str(learned / "export"),
                          "--k", "", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads((learned / "summary.json").read_text())
    result = json.loads((tmp_path / "eval.json").read_text())
    for key in ("accuracy", "count", "tool_calls", "turns", "tool_status/ok"):
        assert result[f"eval/{key}"] == summary[f"eval_after/{key}"], key
    assert f"greedy accuracy: {summary['eval_after/accuracy']:.3f} on 100 prompts" in out.stdout


# The short synchronous run both checks below read: the first 6 steps of the demo's config (16
# prompts a step: 1536 episodes, of which the random model turns a few into tool calls), no
# evaluation. Its requests have the learning run's shapes, so its services compile nothing the
# learning run did not (the compilation cache has them).
SHORT_STEPS = 6
SHORT_RUN = (f"trainer.steps={SHORT_STEPS}", "trainer.eval_before=false",
             "trainer.eval_after=false", "trainer.checkpoint.every=1000")


@pytest.fixture(scope="module")
def killed_sampler_run(tools_model, tmp_path_factory) -> tuple[Path, str, Path]:
    """The short run with two samplers, sampler-0 SIGKILLed at step 3 while its episodes are in
    flight (turns queued, tools running). The trainer is paused around the kill, so the kill
    lands with half the run still to come, however fast the steps go. Then the same config
    with one sampler: a second trainer, in a run directory of its own, against the launch's
    reward service and the surviving sampler (which the first trainer left at its last
    version: the new trainer syncs it back to the model's weights when it joins)."""
    run_dir = tmp_path_factory.mktemp("kill") / "run"
    one_sampler = run_dir.parent / "one-sampler"
    launcher = Launcher(tools_config(tools_model, run_dir, *SHORT_RUN, "services.num_samplers=2"))
    try:
        launcher.up()
        wait_for(lambda: status_step(launcher) >= 3, 600, "step 3", launcher)
        trainer = launcher.procs["trainer"]
        trainer.send_signal(signal.SIGSTOP)
        try:
            kill_service(launcher, "sampler-0")
        finally:
            trainer.send_signal(signal.SIGCONT)
        assert wait_exit(launcher, "trainer", 900) == 0, tail(launcher.log_dir / "trainer.log")
        killed, survivor = launcher.sampler_addresses
        launcher.start_trainer((f"trainer.run_dir={one_sampler}", "services.num_samplers=1",
                                f"services.sampler_addresses=[{survivor}]"))
        assert wait_exit(launcher, "trainer", 900) == 0, tail(launcher.log_dir / "trainer.log")
    finally:
        launcher.stop()
    return run_dir, killed, one_sampler


@pytest.mark.slow
def test_a_sampler_killed_mid_episode_loses_nothing(killed_sampler_run):
    """Its requests go to the other sampler, and `splitrl audit` accounts for every prompt
    once."""
    run_dir, killed, _ = killed_sampler_run
    report = audit_run(run_dir)
    assert report.ok, report.lines()
    records = trained_records(run_dir)
    uids = [u for r in records for u in r["uids"]]
    prompts = SHORT_STEPS * load_config(run_dir / "config.yaml").trainer.prompts_per_step
    assert sorted(int(u.rsplit("#", 1)[1]) for u in uids) == list(range(prompts))
    # The kill came before the run's end: its last steps trained on the survivor alone.
    assert killed not in records[-1]["samplers"]


@pytest.mark.slow
def test_the_killed_sampler_run_and_a_one_sampler_run_are_bitwise_identical(killed_sampler_run):
    """A synchronous run is a function of its config and seed, tool calls and all: the run
    with two samplers, one of them killed mid-episode, equals the same config run with a single
    sampler, step for step and in its final weights."""
    killed_run, _, one_sampler = killed_sampler_run
    first, second = step_metrics(killed_run), step_metrics(one_sampler)
    assert len(first) == len(second) == SHORT_STEPS
    for a, b in zip(first, second, strict=True):
        assert a == b, f"step {a['step']} differs"
    assert {"reward/mean", "loss", "grad_norm", "episodes/tool_calls"} <= set(first[0])
    # The random model called the tool now and then (1 in ~150 episodes): those episodes had
    # turns after an observation, and replayed bit for bit too.
    assert sum(r["episodes/tool_calls"] for r in first) > 0
    assert export_digest(killed_run) == export_digest(one_sampler)
    # The one-sampler run was served by the survivor alone.
    assert {s for r in trained_records(one_sampler) for s in r["samplers"]} == {
        s for r in trained_records(killed_run)[-1:] for s in r["samplers"]}
