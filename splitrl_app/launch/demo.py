"""``splitrl demo`` (``make demo``): the built-in tiny arithmetic run."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from splitrl.config import Config
from splitrl_app.launch.up import main

DEMO_CONFIG = "demo.yaml"


def demo_config_path() -> Path:
    return Path(str(resources.files("splitrl") / "configs" / DEMO_CONFIG))


def demo(cfg: Config) -> int:
    """``make demo``: the built-in tiny arithmetic run; the model is created on first use."""
    model = Path(cfg.model.path)
    if not (model / "config.json").exists():
        from splitrl.init_model import init_model

        print(f"creating the tiny model at {model}", flush=True)
        init_model(model, family="qwen2", preset="tiny", vocab="arithmetic",
                   seed=cfg.trainer.seed)
    return main(cfg)
