"""deploy/smoke_check.py, the checks `deploy/smoke.sh` runs on what a compose run left behind:
it must pass a clean run and catch missing or repeated steps, short batches, idle samplers, a
missing resume, an unfinished run or missing accuracy (lost or twice-trained prompts: `splitrl
audit`, test_audit.py). The records here are shaped like the trainer's (``trained_prompts.jsonl``,
``summary.json``, JSON log lines); that they are the trainer's is checked on a real run's files
(tests/e2e/test_everyday.py)."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
from deploy_helpers import DEPLOY

spec = importlib.util.spec_from_file_location("smoke_check", DEPLOY / "smoke_check.py")
smoke_check = importlib.util.module_from_spec(spec)
sys.modules["smoke_check"] = smoke_check
spec.loader.exec_module(smoke_check)

PER_STEP = 4


def run_records(steps: int, samplers=("10.0.0.2:50300", "10.0.0.3:50300")) -> list[dict]:
    out = []
    for step in range(1, steps + 1):
        first = (step - 1) * PER_STEP
        uids = [f"arith-{i % 7}+1#{i}" for i in range(first, first + PER_STEP)]
        out.append({"step": step, "uids": uids, "versions": [step - 1] * PER_STEP,
                    "samplers": [samplers[i % len(samplers)] for i in range(PER_STEP)],
                    "trainer_version": step - 1})
    return out


def test_a_clean_run_passes_and_counts_work_per_sampler():
    audit = smoke_check.audit_trained(run_records(5), 5, PER_STEP)
    assert audit.problems == [] and audit.uids == 20
    assert audit.per_sampler == {"10.0.0.2:50300": 10, "10.0.0.3:50300": 10}


def test_missing_or_repeated_steps_and_short_batches_are_reported():
    records = run_records(5)
    repeated = records[:3] + [dict(records[2])] + records[4:]  # step 4 missing, step 3 twice
    problems = smoke_check.audit_trained(repeated, 5, PER_STEP).problems
    assert any("missing [4]" in p and "repeated [3]" in p for p in problems)
    short = run_records(5)
    short[0]["uids"] = short[0]["uids"][:3]
    short[0]["samplers"] = short[0]["samplers"][:3]
    assert any("3 prompts, expected 4" in p
               for p in smoke_check.audit_trained(short, 5, PER_STEP).problems)


def _log(*records: dict, text: str = "") -> str:
    lines = ["[transformers] PyTorch was not found."]
    lines += [json.dumps({"level": "info", **r}) for r in records]
    return "\n".join(lines) + "\n" + text


def test_resume_pairs_a_stop_with_the_next_start():
    log = _log({"msg": "step", "step": 19},
               {"msg": "stopped; resume continues from this step", "step": 20},
               {"msg": "resumed from checkpoint", "step": 20, "requeued": 16})
    assert smoke_check.resumes(log) == [(20, 20)]
    crashed = _log({"msg": "resumed from checkpoint", "step": 15})  # no stop logged
    assert smoke_check.resumes(crashed) == [(-1, 15)]


def test_accuracy_is_read_from_the_summary_fields():
    summary = {"eval_before/accuracy": 0.04, "eval_before/step": 0.0,
               "eval_after/accuracy": 0.88, "state": "done", "step": 5.0}
    assert smoke_check.accuracy(summary) == (0.04, 0.88, 0)
    resumed = {**summary, "eval_before/accuracy": 0.5, "eval_before/step": 20.0}
    assert smoke_check.accuracy(resumed) == (0.5, 0.88, 20)
    assert smoke_check.accuracy({"state": "done", "step": 5.0}) is None


def test_a_restarted_counter_is_summed_over_its_processes():
    assert smoke_check.restarted_total([0, 2, 5, 0, 1, 3]) == 8
    assert smoke_check.restarted_total([]) == 0


DONE = {"state": "done", "step": 5.0, "total_steps": 5.0, "eval_before/step": 0.0}


@pytest.fixture
def run_files(tmp_path):
    def write(records, log_text, samplers_tsv, summary):
        trained = tmp_path / "trained_prompts.jsonl"
        trained.write_text("".join(json.dumps(r) + "\n" for r in records))
        log = tmp_path / "trainer.log"
        log.write_text(log_text)
        tsv = tmp_path / "samplers.tsv"
        tsv.write_text(samplers_tsv)
        summary_file = tmp_path / "summary.json"
        summary_file.write_text(json.dumps(summary))
        return ["--trained", str(trained), "--log", str(log), "--samplers", str(tsv),
                "--summary", str(summary_file), "--steps", "5", "--prompts-per-step",
                str(PER_STEP)]

    return write


def _accuracy(before, after):
    return {**DONE, "eval_before/accuracy": before, "eval_after/accuracy": after}


def test_the_command_fails_when_an_expected_sampler_got_no_work(run_files, capsys):
    tsv = "/p-sampler-1\t10.0.0.2\n/p-sampler-2\t10.0.0.3\n/p-sampler-3\t10.0.0.4\n"
    args = run_files(run_records(5), _log(), tsv, _accuracy(0.0, 0.5))
    assert smoke_check.main([*args, "--expect-samplers", "3"]) == 1
    out = capsys.readouterr().out
    assert "samplers that got no work: ['p-sampler-3']" in out
    assert "p-sampler-1" in out and "10.0.0.2:50300" in out


def test_the_command_passes_a_clean_resumed_run_and_checks_accuracy(run_files, capsys):
    log = _log({"msg": "stopped; resume continues from this step", "step": 3},
               {"msg": "resumed from checkpoint", "step": 3})
    args = run_files(run_records(5), log, "/p-sampler-1\t10.0.0.2\n/p-sampler-2\t10.0.0.3\n",
                     {**_accuracy(0.1, 0.6), "eval_before/step": 3.0})
    assert smoke_check.main([*args, "--expect-samplers", "2", "--expect-resume",
                             "--expect-accuracy"]) == 0
    out = capsys.readouterr().out
    assert "greedy accuracy: 0.100 (measured at step 3) -> 0.600" in out
    assert "all checks passed" in out
    worse = run_files(run_records(5), _log(), "", _accuracy(0.5, 0.5))
    assert smoke_check.main([*worse, "--expect-accuracy"]) == 1
    no_resume = run_files(run_records(5), _log(), "", _accuracy(0.1, 0.5))
    assert smoke_check.main([*no_resume, "--expect-resume"]) == 1


def test_a_run_that_did_not_finish_or_did_not_evaluate_fails(run_files, capsys):
    stopped = run_files(run_records(5), _log(), "", {**_accuracy(0.1, 0.5), "state": "stopped"})
    assert smoke_check.main(stopped) == 1
    assert "state 'stopped' at step 5.0, expected 'done' at step 5" in capsys.readouterr().out
    unevaluated = run_files(run_records(5), _log(), "", DONE)
    assert smoke_check.main(unevaluated) == 1
    assert "no eval_before/accuracy and eval_after/accuracy" in capsys.readouterr().out
