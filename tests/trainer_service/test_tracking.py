"""Trackers: TensorBoard event files read back with tensorboard's own reader, a wandb offline run
read back with wandb's own (``wandb leet inspect``), and a clear error for a missing extra or
wandb credentials that are not there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from splitrl.config import load_config
from trainer_service.orchestration.rollouts import Completion, RolloutGroup, WorkItem
from trainer_service.tracking import (
    TrackerMissing,
    Trackers,
    WandbTracker,
    missing_trackers,
    wandb_credentials_problem,
)

RECORDS = [
    {"step": 0, "version": 0, "eval_before/accuracy": 0.25},
    {"step": 1, "version": 1, "loss": 0.5, "reward/mean": 0.25, "reward/exact/mean": 0.25},
    {"step": 2, "version": 2, "loss": 0.25, "reward/mean": 0.75, "reward/exact/mean": 0.75},
]


def _groups() -> list[RolloutGroup]:
    groups = []
    for i, (prompt, answer, text) in enumerate([("1+2=", "3", "3"), ("4+4=", "8", "7|x")]):
        row = {"prompt_id": f"p{i}", "prompt": prompt, "messages": None, "reference": answer}
        score = float(text == answer)
        completion = Completion(token_ids=[5], logprobs=[-0.1], reward=score,
                                rewards={"exact": score}, finish_reason="stop", text=text)
        groups.append(RolloutGroup(item=WorkItem(uid=f"p{i}#{i}", row=row), prompt_token_ids=[1],
                                   completions=[completion], weight_version=1, sampler_id="s"))
    return groups


def _track(run_dir: Path, tracker: str) -> None:
    cfg = load_config(None, [f"trainer.report_to=[{tracker}]", "trainer.completions_every=2",
                             "run_name=tracked", "reward.functions=[{name: exact}]"])
    trackers = Trackers.from_config(cfg, run_dir, accuracy_fn="exact")
    for record in RECORDS:  # as the run does: a step's completions, then its metrics
        if record["step"] > 0 and trackers.completions_due(record["step"]):
            trackers.completions(record["step"], _groups())
        trackers.log(record)
    trackers.close()


def test_tensorboard_event_files_hold_the_scalars_config_and_completions(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    _track(tmp_path, "tensorboard")
    reader = EventAccumulator(str(tmp_path / "tensorboard"),
                              size_guidance={"scalars": 0, "tensors": 0})
    reader.Reload()
    assert [(e.step, e.value) for e in reader.Scalars("reward/exact/mean")] == [(1, 0.25),
                                                                              (2, 0.75)]
    assert [e.step for e in reader.Scalars("eval_before/accuracy")] == [0]
    assert "step" not in reader.Tags()["scalars"]
    table = reader.Tensors("completions/text_summary")
    assert [e.step for e in table] == [2]
    text = tensor_util.make_ndarray(table[0].tensor_proto).item().decode()
    lines = text.splitlines()
    assert lines[0] == "| step | prompt | completion | reference | reward | reward/exact |"
    assert lines[2] == "| 2 | 1+2= | 3 | 3 | 1.0 | 1.0 |"
    assert lines[3] == "| 2 | 4+4= | 7\\|x | 8 | 0.0 | 0.0 |"  # a | in the text is escaped
    config = tensor_util.make_ndarray(reader.Tensors("config/text_summary")[0].tensor_proto)
    assert "run_name: tracked" in config.item().decode()


def test_wandb_offline_run_is_read_by_wandbs_own_reader(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    _track(tmp_path, "wandb")
    [log_file] = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    wandb_cli = Path(sys.executable).with_name("wandb")
    inspect = subprocess.run([str(wandb_cli), "leet", "inspect", "--json", str(log_file)],
                             capture_output=True, text=True, timeout=120,
                             env={**os.environ, "WANDB_MODE": "offline"})
    assert inspect.returncode == 0, inspect.stderr
    records = [json.loads(line) for line in inspect.stdout.splitlines() if line.startswith("{")]
    run = next(r["run"] for r in records if r["type"] == "run")
    assert run["display_name"] == "tracked"
    assert run["config"]["update"]["trainer"]["completions_every"] == 2
    steps = {r["history"]["item"]["_step"]: r["history"]["item"] for r in records
             if r["type"] == "history"}
    assert sorted(steps) == [0, 1, 2]
    assert steps[0]["eval_before/accuracy"] == 0.25
    assert steps[1]["reward/exact/mean"] == 0.25
    assert steps[2]["loss"] == 0.25
    assert steps[2]["completions._type"] == "table-file" and steps[2]["completions.nrows"] == 2
    data = json.loads((log_file.parent / "files" / steps[2]["completions.path"]).read_text())
    assert data["columns"][:3] == ["step", "prompt", "completion"]
    assert data["data"][1][1:3] == ["4+4=", "7|x"]


def test_the_completions_table_shows_prompts_as_the_model_saw_them(tmp_path):
    """A chat prompt is its token ids decoded (the chat template's rendering), not the JSON
    of its messages."""
    from splitrl.tokenizer import encode_prompt, load_tokenizer, train_bpe_tokenizer

    tokenizer = load_tokenizer(train_bpe_tokenizer(["What is 1+2? user assistant"] * 4,
                                                   tmp_path / "tok", vocab_size=300))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2="}]
    [group, plain] = _groups()
    group.item.row = {**group.item.row, "prompt": None, "messages": messages}
    group.prompt_token_ids = encode_prompt(tokenizer, messages=messages)

    class Recorder:
        def table(self, step, columns, rows):
            self.rows = rows

    recorder = Recorder()
    Trackers([recorder]).completions(
        2, [group, plain], decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
    assert recorder.rows[0][1] == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
                                   "1+2=<|im_end|>\n<|im_start|>assistant\n")
    Trackers([recorder]).completions(2, [group])  # no tokenizer at hand: readable messages
    assert recorder.rows[0][1] == "system: Be brief.\nuser: 1+2="


def test_a_configured_tracker_that_is_not_installed_names_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    problem = missing_trackers(["tensorboard", "wandb"])
    assert problem == ("trainer.report_to includes 'wandb' but wandb is not installed: pip "
                       "install 'splitrl[wandb]' (or remove 'wandb' from trainer.report_to)")
    assert missing_trackers(["tensorboard"]) is None


def test_wandb_without_a_key_and_not_offline_is_named_with_the_ways_out(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no ~/.config/wandb/settings
    problem = wandb_credentials_problem({})
    assert "wandb has no API key for api.wandb.ai" in problem
    assert "`wandb login`" in problem and "WANDB_MODE=offline" in problem
    for env in ({"WANDB_MODE": "offline"}, {"WANDB_MODE": "disabled"},
                {"WANDB_DISABLED": "true"}, {"WANDB_API_KEY": "k" * 40}):
        assert wandb_credentials_problem(env) is None, env
    # What `wandb login` writes: a netrc entry for the server's host.
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password k\n")
    assert wandb_credentials_problem({}) is None
    other = wandb_credentials_problem({"WANDB_BASE_URL": "https://wandb.example.com"})
    assert "no API key for wandb.example.com" in other
    # `mode = offline` in wandb's global settings file counts like WANDB_MODE.
    settings = tmp_path / "wandb-config" / "settings"
    settings.parent.mkdir()
    settings.write_text("[default]\nmode = offline\n")
    assert wandb_credentials_problem({"WANDB_CONFIG_DIR": str(settings.parent),
                                      "NETRC": str(tmp_path / "none")}) is None
    assert wandb_credentials_problem({"NETRC": str(tmp_path / "none")}) is not None


def test_the_trainer_refuses_wandb_without_credentials_before_logging_anything(
        tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DISABLED", "NETRC", "WANDB_CONFIG_DIR"):
        monkeypatch.delenv(name, raising=False)
    assert "WANDB_MODE=offline" in missing_trackers(["tensorboard", "wandb"])
    with pytest.raises(TrackerMissing, match="wandb login"):
        WandbTracker(tmp_path, {}, "no-key")
    assert not (tmp_path / "wandb").exists()
