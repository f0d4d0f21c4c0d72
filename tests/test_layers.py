"""The layers hold (DESIGN.md principle 11): the core ``splitrl`` imports no service and not
the application; ``sampler_service``, ``reward_service`` and ``trainer_service`` never import
each other; the application ``splitrl_app`` may import everything. The contract is
``[tool.importlinter]`` in pyproject.toml, checked by import-linter's ``lint-imports`` over every
import statement, those inside functions included."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fresh_python import python_prints

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("splitrl", "sampler_service", "reward_service", "trainer_service", "splitrl_app")


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` with pyproject.toml's contracts, the packages imported from ``root``."""
    tool = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if tool is None:
        pytest.skip("import-linter is not installed (it is in the test extra)")
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([tool, "--config", str(root / "pyproject.toml"), "--no-cache"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=120)


def test_the_layers_hold():
    proc = _lint_imports(REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 kept, 0 broken" in proc.stdout, proc.stdout


# One import across the layers each, all in one copy of the tree (one lint run).
CROSSINGS = {
    "splitrl/config.py": "import trainer_service.run",  # the core imports a service
    "splitrl/tokenizer.py": "from splitrl_app import cli",  # the core imports the application
    "sampler_service/rollout.py": "from reward_service import scoring",  # service to service
    "trainer_service/resume.py": "from splitrl_app.planning import estimate",  # up a layer
}


def test_an_import_across_the_layers_breaks_the_contract(tmp_path):
    for package in PACKAGES:
        shutil.copytree(REPO / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    for module, statement in CROSSINGS.items():
        path = tmp_path / module
        # Inside a function, as the lazy imports of the code base are: they count the same.
        path.write_text(path.read_text() + f"\n\ndef _layer_probe():\n    {statement}\n")
    proc = _lint_imports(tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "0 kept, 1 broken" in proc.stdout, proc.stdout
    for module in CROSSINGS:
        assert module.removesuffix(".py").replace("/", ".") in proc.stdout, proc.stdout


def test_a_sampler_started_by_the_splitrl_command_loads_no_other_service():
    # The command's module imports its commands lazily: a sampler image runs `splitrl sampler`
    # without the trainer's or the reward service's code.
    code = ("import sys\n"
            "def loaded():\n"
            "    return sorted({m.split('.')[0] for m in sys.modules} & {"
            "'sampler_service', 'reward_service', 'trainer_service'})\n"
            "import splitrl_app.cli\n"
            "print(loaded())\n"
            "import sampler_service.server\n"
            "print(loaded())\n")
    assert python_prints(code) == ["[]", "['sampler_service']"]
