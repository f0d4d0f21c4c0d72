"""What each start-up measure `splitrl up` keeps buys, in CPU seconds of fresh processes.

Each case runs as its own Python process (as a service or the launcher does), alternated with
its reference, ``--repeat`` times; the median CPU seconds (user + system, the process and its
children) are printed beside the reference and their difference:

- tokenizer: loading the tiny model's tokenizer with the transformers class AutoTokenizer
  chooses for it, by name (what every service paid when the launcher pinned that class),
  against reading its tokenizer.json with `tokenizers` (``splitrl.fast_tokenizer``, what every
  service does now); and with AutoTokenizer itself (whose class resolution imports torch when
  torch is installed) against the same reference;
- teardown: a process holding what a service holds (jax, flax, orbax, gRPC, a compiled
  program), leaving through the interpreter's teardown (``sys.exit``) against without
  it (``os._exit``, what ``splitrl trainer/sampler/up/demo`` do once everything is closed);
- data check: ``splitrl up``'s prompt length check of the demo data (its tokenizer loaded,
  every prompt rendered and counted) against the same launcher code loading the data
  without a tokenizer (what a launch paid when a passed check was remembered); what each launch
  pays now that its outcome is no longer cached;
- resume check: ``splitrl up``'s check that a run directory may be resumed with this config,
  for a new run directory (no checkpoint there: nothing imported beyond the config) against
  opening its checkpoint directory anyway (orbax and jax imported, the directory read), what
  the check would cost without looking for the directory first.

    .venv/bin/python bench/startup_tricks.py [--repeat 3] [--cases tokenizer teardown data resume]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

TOKENIZER_AUTO = """
from transformers import AutoTokenizer
AutoTokenizer.from_pretrained({model!r}, local_files_only=True)
"""
TOKENIZER_NAMED = """
from splitrl.tokenizer import load_tokenizer
load_tokenizer({model!r}, {name!r})
"""
TOKENIZER_JSON = """
import sys
from splitrl.tokenizer import load_tokenizer
load_tokenizer({model!r})
assert "transformers" not in sys.modules
"""
SERVICE_THEN_EXIT = """
import os, sys
import jax, jax.numpy as jnp
import sampler_service.server, trainer_service.run  # jax, flax, orbax, grpc
from splitrl.models import from_pretrained
from splitrl.tokenizer import load_tokenizer
model = from_pretrained({model!r})
load_tokenizer({model!r})
jax.jit(lambda x: jnp.tanh(x) @ x.T)(jnp.ones((64, 64))).block_until_ready()
sys.stdout.flush()
if {fast!r}:
    os._exit(0)
sys.exit(0)
"""
DATA_CHECK = """
from splitrl.config import load_config
from splitrl_app.launch import demo, preflight
cfg = load_config(demo.demo_config_path(), ["model.path={model}"])
assert preflight.check_data(cfg) is None
"""
DATA_WITHOUT_TOKENIZER = """
import sys
from splitrl.config import load_config
from splitrl_app.launch import demo, preflight
from trainer_service.orchestration.data import PromptStream
cfg = load_config(demo.demo_config_path(), ["model.path={model}"])
PromptStream.from_config(cfg.trainer.data).eval_rows()
assert "transformers" not in sys.modules
"""
RESUME_NEW_DIR = """
import sys
from splitrl.config import load_config
from splitrl_app.launch import demo
from trainer_service.resume import resume_problem
cfg = load_config(demo.demo_config_path(), ["model.path={model}", "trainer.run_dir={run_dir}"])
assert resume_problem(cfg) is None
assert "jax" not in sys.modules and "orbax" not in sys.modules
"""
RESUME_OPENING_CHECKPOINTS = """
from splitrl.config import load_config
from splitrl_app.launch import demo
from trainer_service.learning.checkpoints import Checkpointer
cfg = load_config(demo.demo_config_path(), ["model.path={model}", "trainer.run_dir={run_dir}"])
with Checkpointer.from_config(cfg.trainer.checkpoint, cfg.trainer.run_dir) as checkpointer:
    assert checkpointer.newest_readable_meta() is None
"""


def cpu_seconds(code: str, env: dict[str, str]) -> float:
    """CPU seconds (user + system) of a fresh ``python -c code``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=REPO,
                   stdout=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def compare(label: str, case: str, reference: str, env: dict[str, str], repeat: int) -> None:
    cases, references = [], []
    for _ in range(repeat):  # alternated: a busier moment slows both sides
        cases.append(cpu_seconds(case, env))
        references.append(cpu_seconds(reference, env))
    c, r = statistics.median(cases), statistics.median(references)
    print(f"{label:<34} {c:6.2f} s CPU  reference {r:6.2f} s  difference {c - r:+6.2f} s  "
          f"ratio {c / r:5.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    cases = ["tokenizer", "teardown", "data", "resume"]
    parser.add_argument("--cases", nargs="+", default=cases, choices=cases)
    args = parser.parse_args()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "JAX_PLATFORMS": "cpu",
           "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        from transformers import AutoTokenizer

        from splitrl.init_model import init_model

        model = str(init_model(Path(tmp) / "tiny", family="qwen2", preset="tiny",
                               vocab="arithmetic", seed=0))
        name = type(AutoTokenizer.from_pretrained(model)).__name__
        try:
            import torch  # noqa: F401

            torch_note = "torch installed"
        except ImportError:
            torch_note = "torch not installed: AutoTokenizer imports no torch"
        print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; tokenizer class "
              f"{name}; {torch_note}; median of {args.repeat}")
        fill = {"model": model, "name": name, "run_dir": str(Path(tmp) / "new-run")}
        if "tokenizer" in args.cases:
            compare(f"tokenizer: transformers' {name}", TOKENIZER_NAMED.format(**fill),
                    TOKENIZER_JSON.format(**fill), env, args.repeat)
            compare("tokenizer: AutoTokenizer", TOKENIZER_AUTO.format(**fill),
                    TOKENIZER_JSON.format(**fill), env, args.repeat)
        if "teardown" in args.cases:
            compare("service exit: with teardown", SERVICE_THEN_EXIT.format(**fill, fast=False),
                    SERVICE_THEN_EXIT.format(**fill, fast=True), env, args.repeat)
        if "data" in args.cases:
            compare("launch: prompt length check", DATA_CHECK.format(**fill),
                    DATA_WITHOUT_TOKENIZER.format(**fill), env, args.repeat)
        if "resume" in args.cases:
            opened = {**fill, "run_dir": str(Path(tmp) / "opened-run")}  # orbax makes its dir
            compare("launch: resume check, new run dir",
                    RESUME_OPENING_CHECKPOINTS.format(**opened), RESUME_NEW_DIR.format(**fill),
                    env, args.repeat)


if __name__ == "__main__":
    main()
