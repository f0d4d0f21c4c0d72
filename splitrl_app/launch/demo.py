"""``splitrl demo`` (``make demo``, ``make demo-tools``): the built-in tiny runs."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from splitrl.config import Config
from splitrl_app.launch.up import main

DEMO_CONFIG = "demo.yaml"


def demo_config_path() -> Path:
    return Path(str(resources.files("splitrl") / "configs" / DEMO_CONFIG))


def demo(cfg: Config) -> int:
    """``make demo``: the built-in tiny arithmetic run (``make demo-tools``: the tool task); the
    model is created on first use, with the character vocabulary of the run's task."""
    model = Path(cfg.model.path)
    if not (model / "config.json").exists():
        from splitrl.init_model import CHAR_VOCABULARIES, init_model

        task = cfg.trainer.data.task
        print(f"creating the tiny model at {model}", flush=True)
        init_model(model, family="qwen2", preset="tiny",
                   vocab=task if task in CHAR_VOCABULARIES else "arithmetic",
                   seed=cfg.trainer.seed)
    return main(cfg)
