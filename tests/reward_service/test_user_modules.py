"""A reward module beside the config imports without PYTHONPATH, in the command that reads the
config and in the scoring workers of the reward service; a module that is nowhere is reported
with the places it was looked for."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SPLITRL = str(Path(sys.executable).parent / "splitrl")  # the console script users run

REWARDS = '''
def has_seven(completions, **kwargs):
    """1 when the completion holds a 7."""
    return [float("7" in c) for c in completions]
'''


def _project(tmp_path: Path, function: str) -> tuple[Path, Path]:
    """A config and its reward module in one directory; a different working directory."""
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    (project / "my_rewards.py").write_text(REWARDS)
    (project / "run.yaml").write_text(
        f"reward:\n  workers: 1\n  functions:\n    - name: {function}\n")
    return project / "run.yaml", elsewhere


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SPLITRL_CODE_DIRS")}
    return dict(env, HF_HUB_OFFLINE="1")


def test_the_module_beside_the_config_loads_from_another_directory(tmp_path):
    config, elsewhere = _project(tmp_path, "my_rewards:has_seven")
    out = subprocess.run([SPLITRL, "list", "rewards", "--config", str(config)], cwd=elsewhere,
                         capture_output=True, text=True, env=_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    assert "my_rewards:has_seven  weight 1" in out.stdout and "trl" in out.stdout


def test_a_missing_module_says_where_it_was_looked_for(tmp_path):
    config, elsewhere = _project(tmp_path, "not_there:score")
    out = subprocess.run([SPLITRL, "list", "rewards", "--config", str(config)], cwd=elsewhere,
                         capture_output=True, text=True, env=_env(), timeout=120)
    assert out.returncode == 2
    assert (f"no module named 'not_there' in {config.parent} (the config file's directory); "
            f"{elsewhere} (the current directory); the installed packages") in out.stderr


def test_the_scoring_workers_import_it_too(tmp_path):
    """The reward service's workers (forkserver processes) score with the module beside the
    config the service was started with."""
    config, elsewhere = _project(tmp_path, "my_rewards:has_seven")
    code = (
        "from splitrl.config import load_config\n"
        "from splitrl.user_code import add_config_dir\n"
        "from reward_service.scoring import Item, RewardScorer\n"
        f"add_config_dir({str(config)!r})\n"
        f"scorer = RewardScorer(load_config({str(config)!r}).reward)\n"
        "print([r.total for r in scorer.score([Item(completion='x7'), Item(completion='x')])])\n"
        "scorer.close()\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, capture_output=True,
                         text=True, env=_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "[1.0, 0.0]"
