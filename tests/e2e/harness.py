"""Helpers for the multi-process end-to-end tests: configs, waiting on a run, reading records."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

from splitrl.config import Config, load_config
from splitrl_app.launch.demo import demo_config_path
from splitrl_app.launch.supervisor import Launcher


def run_config(model_dir: Path, run_dir: Path, *overrides: str) -> Config:
    """The demo config pointed at a test model and run directory."""
    return load_config(
        demo_config_path(),
        [f"model.path={model_dir}", f"trainer.run_dir={run_dir}", *overrides],
    )


def gsm8k_train_lines_by(key, tokenizer, data, gsm8k: Path, scanned: int) -> dict:
    """The first ``scanned`` lines of ``gsm8k``/train.jsonl grouped by ``key(n)``, n the number
    of tokens the sampler encodes the line's prompt to (``data``'s task options and chat
    template applied): what a test picks rows of one prompt shape from, in file order."""
    from splitrl.tasks import get_task
    from splitrl.tokenizer import encode_prompt

    rows = get_task(data.task, path=gsm8k, **data.options).rows("train")
    lines = (gsm8k / "train.jsonl").read_text().splitlines()[:scanned]
    grouped: dict = {}
    for index, line in enumerate(lines):
        ids = encode_prompt(tokenizer, rows[index]["prompt"],
                            use_chat_template=data.chat_template)
        grouped.setdefault(key(len(ids)), []).append(line)
    return grouped


def wait_for(predicate, timeout_s: float, what: str, launcher: Launcher | None = None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if launcher is not None:
            trainer = launcher.procs.get("trainer")
            if trainer is not None and trainer.poll() is not None and trainer.returncode != 0:
                raise AssertionError(
                    f"trainer exited with {trainer.returncode} while waiting for {what}:\n"
                    + tail(launcher.log_dir / "trainer.log")
                )
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def kill_service(launcher: Launcher, name: str) -> None:
    """SIGKILL one of the launcher's services (e.g. ``sampler-0``) and reap it."""
    victim = launcher.procs[name]
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()


def status_step(launcher: Launcher) -> int:
    try:
        return launcher.status().step
    except Exception:
        return -1


def tail(path: Path, lines: int = 40) -> str:
    if not path.exists():
        return f"({path} does not exist)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def trained_records(run_dir: Path) -> list[dict]:
    path = run_dir / "trained_prompts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# What legitimately differs between two runs of one config: wall times, bytes pushed (one push
# per sampler), membership, and the queue's counters (counts/*: of this trainer process, so they
# start again at 0 after a restart).
VOLATILE = ("time/", "throughput/", "push/", "samplers/", "counts/")


def step_metrics(run_dir: Path) -> list[dict]:
    """The run's train-step records of ``metrics.jsonl`` without the volatile values; after a
    restart, the last record of each step (the final lineage), in step order."""
    by_step = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "groups" in record:  # a train step (evaluations have no groups)
            by_step[record["step"]] = {k: v for k, v in record.items()
                                       if not k.startswith(VOLATILE)}
    return [by_step[s] for s in sorted(by_step)]


def export_digest(run_dir: Path) -> str:
    """sha256 of the run's exported safetensors."""
    files = sorted((run_dir / "export").glob("*.safetensors"))
    assert files, f"no exported weights in {run_dir / 'export'}"
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()


def log_records(path: Path) -> list[dict]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def assert_resumed_at(launcher: Launcher, saved: int) -> None:
    """The launch's last trainer resumed from the checkpoint of step ``saved`` (its step and
    weight version) and rolled the samplers back to it: a sampler synced to that version."""
    logs = log_records(launcher.log_dir / "trainer.log")
    resumed = [r for r in logs if r.get("msg") == "resumed from checkpoint"]
    assert resumed and resumed[-1]["step"] == saved and resumed[-1]["version"] == saved
    synced = [r for r in logs if r.get("msg") == "sampler synced" and r.get("ok")]
    assert {r["version"] for r in synced} >= {saved}


def wait_exit(launcher: Launcher, name: str, timeout_s: float) -> int:
    """The exit code of the launcher's service ``name``, as soon as it exits (a blocking wait,
    not a poll: no fraction of a poll interval is lost after the exit)."""
    proc = launcher.procs[name]
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{name} still running after {timeout_s:.0f}s:\n"
                             + tail(launcher.log_dir / f"{name}.log")) from None


def adapter_logits(base_dir: Path, export: Path, tokens) -> tuple:
    """Logits of ``tokens`` [B, T] three ways, float32: PEFT loading the run's exported adapter
    (``export/adapter``) onto the transformers base, transformers loading the merged export,
    and SplitRL's forward of the base with the adapter as ``splitrl.models.peft_io`` reads it."""
    import jax.numpy as jnp
    import numpy as np
    import peft
    import torch
    import transformers

    from splitrl.models import from_pretrained
    from splitrl.models.lora import attach
    from splitrl.models.peft_io import load_adapter

    assert (export / "adapter" / "adapter_config.json").exists()
    ids = torch.tensor(np.asarray(tokens), dtype=torch.long)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(base, export / "adapter").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(export,
                                                               dtype=torch.float32).eval()
    with torch.no_grad():
        peft_logits = with_adapter(ids).logits.numpy()
        merged_logits = merged(ids).logits.numpy()
    ours = from_pretrained(base_dir)
    spec, adapters = load_adapter(export / "adapter", ours.config)
    own = np.asarray(attach(ours, spec, adapters)(jnp.asarray(ids.numpy()))[0])
    return peft_logits, merged_logits, own
