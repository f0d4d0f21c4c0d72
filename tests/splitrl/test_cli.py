"""The `splitrl` command parses what compose and Kubernetes pass it and reports errors."""

from __future__ import annotations

import subprocess
import sys

from splitrl.cli import build_parser, main


def test_service_commands_take_config_and_overrides():
    args = build_parser().parse_args(["sampler", "--config", "c.yaml", "trainer.steps=2"])
    assert args.command == "sampler" and args.config == "c.yaml"
    assert args.overrides == ["trainer.steps=2"]


def test_config_command_prints_the_resolved_config(capsys):
    assert main(["config", "trainer.steps=3", "algorithm.loss=gspo"]) == 0
    out = capsys.readouterr().out
    assert "steps: 3" in out and "loss: gspo" in out


def test_config_errors_exit_2_with_the_key(capsys):
    assert main(["config", "trainer.stpes=3"]) == 2
    assert "unknown key 'trainer.stpes'" in capsys.readouterr().err


def test_health_of_nothing_is_not_serving():
    proc = subprocess.run(
        [sys.executable, "-m", "splitrl", "health", "127.0.0.1:1", "--timeout", "0.5"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "NOT_SERVING" in proc.stdout
