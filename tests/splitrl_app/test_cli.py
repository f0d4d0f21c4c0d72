"""The `splitrl` command parses what compose and Kubernetes pass it and reports errors."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from splitrl_app.cli import build_parser, main


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


def test_health_of_a_closed_port_says_unreachable_and_exits_3():
    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.run(
        [sys.executable, "-m", "splitrl", "health", f"127.0.0.1:{port}", "--timeout", "0.5"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 3
    assert proc.stdout.startswith(f"UNREACHABLE: nothing accepts connections at 127.0.0.1:{port}")
    assert "NOT_SERVING" not in proc.stdout


def test_list_rewards_shows_built_ins_with_options_and_the_configured_styles(capsys, tmp_path,
                                                                              monkeypatch):
    module = tmp_path / "my_rewards.py"
    module.write_text("def think_format(completions, **kwargs):\n"
                      "    return [1.0 if '<think>' in c else 0.0 for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["list", "rewards", "reward.functions=[{name: exact_answer}, "
                 "{name: 'my_rewards:think_format', weight: 0.5}]"]) == 0
    out = capsys.readouterr().out
    assert "math_accuracy" in out and "options: max_chars=20000" in out
    assert "length" in out and "options: max_tokens, buffer=0" in out
    assert "exact_answer  weight 1, timeout 5 s, splitrl style" in out
    assert "my_rewards:think_format  weight 0.5, timeout 5 s, trl style (completions, **kwargs)" \
        in out


def test_list_rewards_with_a_typo_in_a_module_exits_2_with_the_import_error(capsys):
    assert main(["list", "rewards", "reward.functions=[{name: 'my_rewardz:f'}]"]) == 2
    err = capsys.readouterr().err
    assert "cannot import module 'my_rewardz': ModuleNotFoundError" in err


def test_list_tasks_shows_options_splits_and_columns(capsys):
    assert main(["list", "tasks"]) == 0
    out = capsys.readouterr().out
    for fragment in ("arithmetic: Single-digit addition", "options: max_operand=4",
                     "splits: train, test", "gsm8k: GSM8K", "files: Any dataset",
                     "prompt_field='question'", "math500", "docs/data.md"):
        assert fragment in out, fragment


def test_overrides_may_follow_options_and_strays_are_still_refused():
    from splitrl_app.cli import _parse, build_parser

    parser = build_parser()
    args = _parse(parser, ["eval", "runs/x/export", "--k", "1,4", "trainer.data.eval_size=10",
                           "--config", "run.yaml", "sampling.temperature=0.7"])
    assert (args.target, args.k, args.config) == ("runs/x/export", "1,4", "run.yaml")
    assert args.overrides == ["trainer.data.eval_size=10", "sampling.temperature=0.7"]
    args = _parse(parser, ["up", "--resume", "force", "trainer.steps=3"])
    assert (args.resume, args.overrides) == ("force", ["trainer.steps=3"])
    with pytest.raises(SystemExit):
        _parse(parser, ["eval", "m", "--bogus"])
    with pytest.raises(SystemExit):
        _parse(parser, ["plot", "runs/x", "a=b"])  # plot takes no overrides


def test_list_rewards_keeps_every_name_apart_from_its_description(capsys):
    from reward_service.registry import builtin_names

    assert main(["list", "rewards"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for name in builtin_names():  # the longest one ran into its description
        assert any(line.startswith(f"  {name}  ") for line in lines), name
    assert all(len(line) <= 100 for line in lines if "pattern=" not in line)
