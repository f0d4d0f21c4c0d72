"""An LLM judge served by a second SplitRL sampler deployment scores a real run, and an outage
of that judge mid-run is survived with nothing lost.

The judge is the tiny arithmetic model in its own sampler process, reached over the
OpenAI-compatible HTTP API with its own bearer token (docs/rewards.md): it continues
"<prompt><completion>" and its first digit is the verdict. The run's reward service asks it for
every completion; the test kills the judge after a few steps, sees the trainer pause dispatching
(the reward-outage policy, no sampler blamed), starts the judge again on the same port, and the
run finishes with every prompt trained exactly once (`splitrl audit`).
"""

from __future__ import annotations

import json
from collections import Counter

import openai
import pytest
import yaml

from splitrl_app.launch.ports import free_port
from splitrl_app.launch.supervisor import Launcher
from tests.e2e.harness import (
    log_records,
    run_config,
    status_step,
    tail,
    trained_records,
    wait_exit,
    wait_for,
)
from tests.sampler_service.sampler_helpers import SamplerProcess
from trainer_service.orchestration.audit import audit_run

pytestmark = pytest.mark.slow

JUDGE_TOKEN = "judge-s3cret"


def start_judge(model, config_path, http_port: int) -> SamplerProcess:
    config_path.write_text(yaml.safe_dump({
        "run_name": "judge", "model": {"path": str(model)},
        "sampler": {"max_batch_size": 32, "max_sequence_length": 48, "http_port": http_port,
                    "served_model_name": "judge", "register_with_trainer": False,
                    "data_port": None},
        "services": {"host": "127.0.0.1", "sampler_port": 0, "metrics_port": 0,
                     "reward_address": "", "trainer_address": "",
                     "auth": {"token": JUDGE_TOKEN}}}))
    judge = SamplerProcess(config_path, devices=1)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key=JUDGE_TOKEN,
                           max_retries=0, timeout=600)
    client.completions.create(model="judge", prompt="1+2=3", max_tokens=2, temperature=0)
    return judge  # warm: its first request compiled the sampler's programs


def test_a_judge_on_a_second_sampler_scores_a_run_and_its_outage_loses_nothing(
        arith_model, tmp_path, monkeypatch):
    monkeypatch.setenv("JUDGE_TOKEN", JUDGE_TOKEN)  # the reward service reads the key from it
    http_port = free_port()
    judge = start_judge(arith_model, tmp_path / "judge.yaml", http_port)
    # 4 prompts x 8 completions a step: the batch shapes of test_storage's and
    # test_rewards_and_data's runs, whose sampler and train-step programs are then in the
    # suite's compilation cache (4 x 4 compiled three programs of its own).
    run_dir, steps, per_step = tmp_path / "run", 10, 4
    judges = json.dumps([{
        "name": "judge", "base_url": f"http://127.0.0.1:{http_port}/v1", "model": "judge",
        "api": "completions", "prompt_template": "{prompt}{completion}",
        "verdict_pattern": r"(\d)", "verdict_scores": {}, "max_tokens": 2,
        "max_retries": 1, "retry_backoff_s": 0.2, "request_timeout_s": 300,
        "api_key_env": "JUDGE_TOKEN"}])
    cfg = run_config(arith_model, run_dir, f"trainer.steps={steps}",
                     f"trainer.prompts_per_step={per_step}", "algorithm.group_size=8",
                     "trainer.eval_before=false", "trainer.eval_after=false",
                     "reward.workers=1", "services.num_samplers=1",
                     "reward.functions=[{name: exact_answer}, {name: judge, weight: 0.1}]",
                     "reward.accuracy_function=exact_answer", f"reward.judges={judges}")
    launcher = Launcher(cfg)
    try:
        launcher.up()
        wait_for(lambda: status_step(launcher) >= 3, 600, "step 3", launcher)
        judge.proc.kill()  # the judge's deployment goes down mid-run
        judge.stop()
        trainer_log = launcher.log_dir / "trainer.log"
        wait_for(lambda: "reward service unavailable; dispatch paused" in trainer_log.read_text(),
                 300, "the trainer to pause for the reward outage", launcher)
        paused_at = status_step(launcher)
        judge = start_judge(arith_model, tmp_path / "judge-again.yaml", http_port)
        code = wait_exit(launcher, "trainer", 900)
        assert code == 0, tail(trainer_log)
    finally:
        launcher.stop()
        judge.stop()

    assert paused_at < steps  # the outage happened while there was work left
    records = trained_records(run_dir)
    uids = [u for r in records for u in r["uids"]]
    assert not [u for u, n in Counter(uids).items() if n > 1], "a prompt was trained twice"
    assert len(uids) == steps * per_step
    report = audit_run(run_dir)  # what `splitrl audit` prints, from the run directory alone
    assert report.ok and report.trained == steps * per_step, report
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    steps_seen = [m for m in metrics if "reward/judge/mean" in m]
    assert len(steps_seen) >= steps
    assert all(m["reward/judge/errors"] == 0 for m in steps_seen)  # an outage is not an error
    assert any(m["reward/judge/mean"] > 0 for m in steps_seen)  # the judge gave verdicts
    assert all(0 <= m["reward/judge/mean"] <= 9 for m in steps_seen)
    # The outage was the reward service's, not the sampler's: no sampler was dropped.
    assert not [r for r in log_records(launcher.log_dir / "trainer.log")
                if r.get("msg") == "sampler dropped"]
