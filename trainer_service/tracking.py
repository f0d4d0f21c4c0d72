"""Experiment trackers: TensorBoard and Weights & Biases, beside ``metrics.jsonl``.

``trainer.report_to: [tensorboard, wandb]`` sends every record the run writes to
``metrics.jsonl`` (train steps, evaluations, per-reward-function ``reward/<name>/mean``) to each
tracker at its step, the resolved config once, and every ``trainer.completions_every`` steps a
table of sample completions (prompt, completion, reference, total and per-function rewards):

- ``tensorboard``: event files in ``<run_dir>/tensorboard`` written by ``tensorboardX``; the
  scalars under their metric names, the config and the tables as text (markdown) summaries.
- ``wandb``: a run named after ``run_name`` in project ``$WANDB_PROJECT`` (default
  ``splitrl``), its files in ``<run_dir>/wandb``. ``WANDB_MODE=offline`` keeps everything
  local (``wandb sync`` uploads it later); ``wandb leet inspect`` reads it.

Both are optional extras (``pip install 'splitrl[tensorboard]'`` / ``'splitrl[wandb]'``): a run
that asks for one that is not installed fails at start, naming the extra.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

log = logging.getLogger(__name__)

COMPLETION_COLUMNS = ["step", "prompt", "completion", "reference", "reward"]
MAX_TABLE_ROWS = 16  # completions per table: the first of each group, in draw order
_TEXT_LIMIT = 400  # characters of a prompt or completion shown in a table cell


class TrackerMissing(ValueError):
    """A tracker is configured but cannot be used: its library is not installed, or wandb has
    no credentials and is not offline (the trainer cannot start)."""


def _require(tracker: str):
    import importlib

    problem = missing_trackers([tracker])
    if problem is not None:
        raise TrackerMissing(problem)
    return importlib.import_module(_MODULES[tracker][0])


_MODULES = {"tensorboard": ("tensorboardX", "tensorboard"), "wandb": ("wandb", "wandb")}


def missing_trackers(report_to) -> str | None:
    """Why a configured tracker cannot be used, or None: its library is missing, or (wandb)
    it would upload but has no credentials (:func:`wandb_credentials_problem`)."""
    import importlib.util

    for name in report_to:
        module, extra = _MODULES[name]
        if importlib.util.find_spec(module) is None:
            return (f"trainer.report_to includes {name!r} but {module} is not installed: pip "
                    f"install 'splitrl[{extra}]' (or remove {name!r} from trainer.report_to)")
    if "wandb" in report_to:
        return wandb_credentials_problem(os.environ)
    return None


_WANDB_LOCAL_MODES = ("offline", "dryrun", "disabled")


def wandb_credentials_problem(env) -> str | None:
    """Why ``wandb.init`` would fail for want of an API key, or None, from the places wandb
    reads before it asks: ``WANDB_MODE`` (offline, dryrun, disabled need no key) or
    ``WANDB_DISABLED``; the key in ``WANDB_API_KEY`` or ``WANDB_IDENTITY_TOKEN_FILE``, a netrc
    entry for the server's host (``$NETRC``, else ``~/.netrc`` or ``~/_netrc``; what ``wandb
    login`` writes), or ``mode``/``api_key`` in wandb's global settings file
    (``$WANDB_CONFIG_DIR/settings``, default ``~/.config/wandb/settings``). Without any of
    them a run would start every service and fail at the trainer's first ``wandb.init``
    (in a terminal, wait at a login prompt). Whether a found key is valid is not checked
    (that needs the server)."""
    import configparser
    import netrc
    from urllib.parse import urlsplit

    settings = configparser.ConfigParser()
    config_dir = Path(env.get("WANDB_CONFIG_DIR") or Path.home() / ".config" / "wandb")
    try:
        settings.read(config_dir / "settings")
    except configparser.Error:
        pass  # wandb warns about such a file and ignores it
    saved = settings["default"] if settings.has_section("default") else {}
    mode = (env.get("WANDB_MODE") or saved.get("mode") or "").strip().lower()
    disabled = env.get("WANDB_DISABLED", "").strip().lower() in ("1", "true", "yes")
    if mode in _WANDB_LOCAL_MODES or disabled:
        return None
    if env.get("WANDB_API_KEY") or env.get("WANDB_IDENTITY_TOKEN_FILE") or saved.get("api_key"):
        return None
    base_url = env.get("WANDB_BASE_URL") or saved.get("base_url") or "https://api.wandb.ai"
    host = urlsplit(base_url).netloc
    if env.get("NETRC"):
        candidates = [Path(env["NETRC"]).expanduser()]
    else:
        candidates = [Path.home() / ".netrc", Path.home() / "_netrc"]
    for path in candidates:
        try:
            entry = netrc.netrc(path).authenticators(host)
        except (OSError, netrc.NetrcParseError):
            continue
        if entry and entry[2]:
            return None
    return (f"trainer.report_to includes 'wandb' but wandb has no API key for {host} (no "
            f"WANDB_API_KEY, no netrc entry from `wandb login`) and is not offline: run "
            f"`wandb login`, or set WANDB_API_KEY, or log locally with WANDB_MODE=offline "
            f"(`wandb sync` uploads it later), or remove 'wandb' from trainer.report_to")


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def _cell(text: str) -> str:
    text = text if len(text) <= _TEXT_LIMIT else text[:_TEXT_LIMIT] + "..."
    return text.replace("|", "\\|").replace("\n", "<br>")


class TensorBoardTracker:
    def __init__(self, run_dir: Path, config: dict[str, Any]):
        tensorboardx = _require("tensorboard")
        self.directory = run_dir / "tensorboard"
        self.writer = tensorboardx.SummaryWriter(logdir=str(self.directory))
        text = yaml.safe_dump(config, sort_keys=False)
        self.writer.add_text("config", "```yaml\n" + text + "\n```", 0)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def table(self, step: int, columns: list[str], rows: list[list]) -> None:
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(_cell(str(v)) for v in row) + " |" for row in rows]
        self.writer.add_text("completions", "\n".join(lines), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, run_dir: Path, config: dict[str, Any], run_name: str):
        self.wandb = _require("wandb")
        self.run = self.wandb.init(
            project=os.environ.get("WANDB_PROJECT", "splitrl"), name=run_name,
            dir=str(run_dir), config=config)
        self.directory = Path(self.run.dir).parent
        self._last_step = -1

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if step < self._last_step:  # wandb's steps only go forward
            return
        self._last_step = step
        self.run.log(scalars, step=step)

    def table(self, step: int, columns: list[str], rows: list[list]) -> None:
        if step < self._last_step:
            return
        self._last_step = step
        self.run.log({"completions": self.wandb.Table(columns=columns, data=rows)}, step=step)

    def close(self) -> None:
        self.run.finish()


class Trackers:
    """The configured trackers; each call goes to every one of them."""

    def __init__(self, trackers: list, completions_every: int = 0,
                 accuracy_fn: str | None = None):
        self.trackers = trackers
        self.completions_every = completions_every
        self.accuracy_fn = accuracy_fn

    @classmethod
    def from_config(cls, cfg, run_dir: str | os.PathLike,
                    accuracy_fn: str | None = None) -> Trackers:
        from splitrl.config import to_dict

        run_dir = Path(run_dir)
        config = to_dict(cfg)
        trackers: list = []
        try:
            for name in dict.fromkeys(cfg.trainer.report_to):  # each once, in the given order
                if name == "tensorboard":
                    trackers.append(TensorBoardTracker(run_dir, config))
                elif name == "wandb":
                    trackers.append(WandbTracker(run_dir, config, cfg.run_name))
        except Exception:
            for tracker in trackers:
                tracker.close()
            raise
        for tracker in trackers:
            log.info("tracking", extra={"tracker": type(tracker).__name__,
                                        "directory": str(tracker.directory)})
        return cls(trackers, cfg.trainer.completions_every, accuracy_fn)

    def log(self, record: dict[str, Any]) -> None:
        """One metrics.jsonl record (its "step" is the tracker step)."""
        if not self.trackers:
            return
        step, scalars = int(record.get("step", 0)), _scalars(record)
        for tracker in self.trackers:
            tracker.log(step, scalars)

    def completions_due(self, step: int) -> bool:
        return bool(self.trackers) and self.completions_every > 0 and (
            step % self.completions_every == 0)

    def completions(self, step: int, groups,
                    decode: Callable[[list[int]], str] | None = None) -> None:
        """A table of the first completion of each group (at most ``MAX_TABLE_ROWS``). With
        ``decode`` (token ids -> text, special tokens kept) the prompt is shown as the model
        saw it: the prompt's token ids decoded, chat template and system prompt included, and
        nothing the tokenizer dropped."""
        if not self.trackers or not groups:
            return
        functions = sorted({name for g in groups for c in g.completions for name in c.rewards})
        columns = COMPLETION_COLUMNS + [f"reward/{name}" for name in functions]
        rows = []
        for group in groups[:MAX_TABLE_ROWS]:
            row, completion = group.item.row, group.completions[0]
            prompt = (decode(list(group.prompt_token_ids))
                      if decode is not None and group.prompt_token_ids else _prompt_text(row))
            rows.append([step, prompt, completion.text,
                         str(row.get("reference", "")), round(completion.reward, 4)]
                        + [round(completion.rewards.get(name, 0.0), 4) for name in functions])
        for tracker in self.trackers:
            tracker.table(step, columns, rows)

    def close(self) -> None:
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception:  # a tracker that fails to flush must not hide the run's result
                log.exception("closing a tracker failed", extra={"tracker": type(tracker).__name__})
        self.trackers = []


def _prompt_text(row: dict[str, Any]) -> str:
    """A row's prompt when its token ids are not at hand: the text, or each message as
    ``role: content`` on its own line."""
    if row.get("prompt") is not None:
        return str(row["prompt"])
    return "\n".join(f"{m.get('role')}: {m.get('content')}" for m in row.get("messages") or [])
