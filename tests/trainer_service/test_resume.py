"""Explicit resume: the checkpoint's config against the new one, on what a resume keeps."""

import pytest

from splitrl.config import load_config, to_dict
from trainer_service.resume import ResumeRefused, check_resume, config_differences


def _meta(*overrides):
    return {"step": 50, "config": to_dict(load_config(None, list(overrides)))}


def test_what_a_resume_keeps_must_match_and_the_rest_may_change():
    saved = _meta()["config"]
    same = load_config(None, ["trainer.steps=500", "services.num_samplers=4",
                              "trainer.checkpoint.every=5", "trainer.report_to=[tensorboard]",
                              "trainer.mesh.axes={fsdp: 2}"])
    assert config_differences(saved, same) == []
    changed = load_config(None, ["algorithm.loss=gspo", "trainer.optimizer.lr=0.002",
                                 "trainer.data.task=gsm8k"])
    assert config_differences(saved, changed) == [
        ("algorithm.loss", "grpo", "gspo"),
        ("trainer.data.task", "arithmetic", "gsm8k"),
        ("trainer.optimizer.lr", 0.001, 0.002),
    ]


def test_a_changed_config_is_refused_naming_the_keys_unless_forced():
    with pytest.raises(ResumeRefused) as refused:
        check_resume(load_config(None, ["algorithm.loss=gspo", "reward.functions=[{name: x}]"]),
                     _meta(), "runs/x")
    message = str(refused.value)
    assert message.startswith("runs/x holds a checkpoint at step 50 of a run with a different "
                              "config:\n")
    assert "  algorithm.loss: 'grpo' -> 'gspo'\n" in message
    assert "  reward.functions: [{'name': 'math_accuracy'" in message
    assert "--resume force (trainer.resume=force)" in message
    check_resume(load_config(None, ["trainer.steps=7"]), _meta(), "runs/x")


def test_a_forced_resume_lists_what_changed_on_the_console(caplog):
    check_resume(load_config(None, ["algorithm.loss=gspo", "trainer.optimizer.lr=0.002",
                                    "trainer.resume=force"]), _meta(), "runs/x")
    [record] = caplog.records
    assert record.getMessage() == (
        "resuming runs/x from step 50 with a different config (trainer.resume=force): "
        "algorithm.loss: 'grpo' -> 'gspo'; trainer.optimizer.lr: 0.001 -> 0.002")
    assert record.console is True  # splitrl up shows the trainer's console lines


def test_a_config_saved_before_a_key_existed_reads_it_as_its_default():
    saved = _meta()["config"]
    del saved["algorithm"]["recipe"]
    del saved["trainer"]["report_to"]
    assert config_differences(saved, load_config(None)) == []
    assert [d[0] for d in config_differences(saved, load_config(
        None, ["algorithm.recipe=gspo"]))] == ["algorithm.aggregation", "algorithm.eps_high",
                                                "algorithm.eps_low", "algorithm.loss",
                                                "algorithm.recipe"]
