"""Compile time against depth: the train step and the decode program at 2 and at 32 layers.

    JAX_PLATFORMS=cpu python bench/compile_depth.py [--model path/to/config.json] [KEY=VALUE ...]

One model config (``--model``: a HF config.json; default: the ``tiny`` preset of
`splitrl.init_model`, hidden 64) is compiled on this host's CPU at ``--shallow`` (2) and
``--deep`` (32) layers, nothing else changed. The programs are the ones a run compiles, built
the way `splitrl plan` builds them (`splitrl_app.planning.services`): the trainer's "grad_step"
(forward, backward, accumulation) plus "apply_update" (the optax update), and the sampler's
"decode" segment (also "prefill" and "admit", printed beside it). The train step is compiled
twice: with its layers scanned (``model.layer_loop=scan``), as TPU and GPU plans compile it
(the ratio line's "train"), and unrolled, as a CPU trainer runs it ("auto" on CPU, printed
beside it). The sampler's programs are compiled twice: with the slot cache, whose programs
run its layers apart (unrolled, over weights and a cache held per layer) on CPU, and with the
paged cache (``sampler.decode_attention=paged``), whose programs scan the layers on every
platform as a TPU or GPU plan compiles them: the ratio line's "decode" is that scanned one,
the CPU's unrolled decode is printed beside it. Batch shapes come from the run config
(built-in defaults, a one-device mesh per service, and the small overrides below; pass
``KEY=VALUE`` to change them).

Seconds are lowering (tracing, the depth-dependent part of building the program) plus XLA
compilation, with the persistent compilation cache off, each depth in its own fresh process
so neither warms the other. Prints the same ratio of process CPU seconds (steadier on a loaded
machine), then, last line, of wall seconds:

    compile seconds 32 layers / 2 layers: train X, decode Y

A forward whose layers are unrolled grows its programs with depth; a scanned one compiles one
layer body whatever the depth, so both ratios stay near 1. Wall-clock figures on a shared
machine depend on the other processes: process CPU seconds and the load average are printed
too.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SMALL_RUN = [
    "trainer.prompts_per_step=4", "algorithm.group_size=4", "sampler.max_batch_size=16",
    "sampler.max_sequence_length=64", "sampling.max_new_tokens=16",
]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a HF config.json (default: the tiny preset)")
    ap.add_argument("--shallow", type=int, default=2)
    ap.add_argument("--deep", type=int, default=32)
    ap.add_argument("--depth", type=int, help=argparse.SUPPRESS)  # one measurement (child)
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                    help="run config overrides on top of the small defaults")
    return ap.parse_args()


def model_config(path: str | None):
    from splitrl.init_model import PRESETS
    from splitrl.models import TransformerConfig

    if path:
        return TransformerConfig.from_hf_dict(json.loads(Path(path).read_text()))
    p = PRESETS["tiny"]
    return TransformerConfig(
        family="qwen2", vocab_size=512, hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size, num_layers=p.num_layers, num_heads=p.num_heads,
        num_kv_heads=p.num_kv_heads, head_dim=p.hidden_size // p.num_heads,
        tie_word_embeddings=p.tie_word_embeddings, attention_bias=True,
        max_position_embeddings=p.max_position_embeddings, eos_token_id=1, pad_token_id=0)


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def measure(args) -> dict:
    """Lower + compile every program at ``args.depth`` layers; {program: (wall, cpu)}."""
    import jax

    from splitrl.config import load_config
    from splitrl_app.planning.services import SamplerPlanner, TrainerPlanner
    from splitrl_app.planning.targets import cpu_target

    jax.config.update("jax_enable_compilation_cache", False)
    config = dataclasses.replace(model_config(args.model), num_layers=args.depth)
    target = cpu_target()
    out = {}

    # The train step with its layers scanned, as TPU and GPU plans compile it ("train"), then
    # unrolled, as this CPU runs it (`model.layer_loop` "auto" on CPU).
    for name, loop in (("train", "scan"), ("train unrolled", "unrolled")):
        trainer = TrainerPlanner(load_config(None, SMALL_RUN + list(args.overrides) + [
            f"model.layer_loop={loop}"]), config, target)
        lowered, wall, cpu = timed(lambda t=trainer: t.learner.lower_train_step(t.rows,
                                                                                 t.length))
        train_wall, train_cpu = wall, cpu  # one trace builds every program of the step
        for low in lowered.values():
            _, wall, cpu = timed(low.compile)
            train_wall, train_cpu = train_wall + wall, train_cpu + cpu
        out[name] = (train_wall, train_cpu)

    from sampler_service.requests import PinnedWeights

    # The slot cache's programs as this CPU runs them (the layers apart, unrolled:
    # `kv_cache.CacheLayout.layers_apart`), then the paged cache's, which scan the layers on
    # every platform, as TPU and GPU plans compile them ("decode scanned").
    for suffix, attention in (("", "auto"), (" scanned", "paged")):
        sampler = SamplerPlanner(load_config(None, SMALL_RUN + list(args.overrides) + [
            f"sampler.decode_attention={attention}"]), config, target)
        engine = sampler.engine
        prompts = [[0] * sampler.prompt_length] * max(1, sampler.rows // sampler.group)
        request = engine.new_request(prompts, sampler.options, sampler.group,
                                     weights=PinnedWeights(0, sampler.state))
        (lowered, _), wall, cpu = timed(functools.partial(engine.scheduler.lower, request))
        share = (wall / len(lowered), cpu / len(lowered))  # lowering, split evenly
        for name, low in lowered.items():
            _, w, c = timed(low.compile)
            out[name + suffix] = (w + share[0], c + share[1])
    return out


def main() -> int:
    args = parse_args()
    if args.depth is not None:
        print(json.dumps(measure(args)))
        return 0
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # one CPU device: both services' meshes are that device
    results = {}
    for depth in (args.shallow, args.deep):
        cmd = [sys.executable, __file__, "--depth", str(depth), *args.overrides]
        if args.model:
            cmd[2:2] = ["--model", args.model]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if proc.returncode:
            sys.stderr.write(proc.stderr)
            return proc.returncode
        results[depth] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores (wall seconds are "
          "noisy when other processes share them)")
    print(f"{'program':<10} " + "  ".join(f"{d:>3} layers wall/cpu s" for d in results))
    for name in results[args.shallow]:
        cells = "  ".join(f"{results[d][name][0]:>9.2f} /{results[d][name][1]:>6.2f}"
                          for d in results)
        print(f"{name:<10} {cells}")
    for what, i in (("CPU seconds", 1), ("seconds", 0)):  # the required line last
        ratio = {n: results[args.deep][n][i] / results[args.shallow][n][i]
                 for n in ("train", "decode scanned", "train unrolled", "decode")}
        print(f"compile {what} {args.deep} layers / {args.shallow} layers: "
              f"train {ratio['train']:.2f}, decode {ratio['decode scanned']:.2f} "
              f"(this CPU's, layers unrolled: train {ratio['train unrolled']:.2f}, "
              f"decode {ratio['decode']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
