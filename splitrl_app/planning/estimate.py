"""A launch's peak memory per process by arithmetic alone, before anything starts (`splitrl up`).

`splitrl plan` compiles the real programs and reads XLA's own accounting (seconds to minutes).
A launch cannot wait for that, and its services share one host: so this counts the plan's
categories (`memory.Measurement`) from the model's ``config.json`` and the run config, in
microseconds, and without importing jax:

- arrays kept between programs, as the plan counts them: parameters, optimizer state (two Adam
  moments), the gradient accumulator, a reference copy (``algorithm.beta > 0``), the sampler's
  push staging copy and KV cache (``concurrent_batches`` of them);
- the train step's temporaries from a per-token model of what the backward pass keeps, fitted
  to XLA:CPU compiles of the train step at 13 shapes (layers, width, MLP width, heads, vocabulary
  and length varied one at a time; within 15% of each). Per micro-batch row of T tokens, in
  float32 words: ``5.5 L T D + 6 L T I + 3.5 L H T^2 + 4 min(T, 256) min(V, 16384)``: per layer
  the residual stream and projections, the MLP's activations, the attention probabilities,
  and the log-prob head's logits for one chunk (``splitrl.models.logprobs``).
  tests/splitrl_app/planning/test_plan_compile.py compares it with a compile;
- the sampler's temporaries: a KV cache's worth while prompts are admitted (what the plan's
  admit program allocates) or one layer of a full batch's prefill, whichever is larger; its
  cache at the sequences a run puts in flight (`sampler_estimate`);
- a process's own runtime (Python, jax, XLA's compiled code, gRPC): :data:`RUNTIME_BYTES`.

On CPU every emulated device of a process is the host's memory, so the figures here are per
process (all of its devices), to be summed over the processes of a launch. A LoRA run's adapters
and their optimizer state are not counted (small beside the base model).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

from splitrl.config import Config
from splitrl_app.planning.memory import Measurement, format_bytes

GIB = 1024**3
# What a service process holds besides the arrays counted here: the interpreter, jax and XLA,
# compiled programs, gRPC, the tokenizer (measured on the demo's services, rounded up).
RUNTIME_BYTES = {"trainer": 640 * 2**20, "sampler": 512 * 2**20, "reward": 256 * 2**20}
# The estimate is within about 15% of XLA's accounting: a launch plans at most this share of
# the memory, so an estimate on the low side does not become an OOM kill.
HEADROOM = 0.85
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only model that its memory depends on (HF ``config.json``)."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool

    @classmethod
    def from_model_dir(cls, path: str | os.PathLike) -> ModelShape | None:
        """The shape in ``path/config.json``, or None when there is none (a hub name) or it
        lacks a size (the services then say what is wrong with it)."""
        try:
            d = json.loads((Path(path) / "config.json").read_text())
            heads = int(d["num_attention_heads"])
            return cls(vocab=int(d["vocab_size"]), hidden=int(d["hidden_size"]),
                       intermediate=int(d["intermediate_size"]),
                       layers=int(d["num_hidden_layers"]), heads=heads,
                       kv_heads=int(d.get("num_key_value_heads") or heads),
                       head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // heads),
                       tied=bool(d.get("tie_word_embeddings", False)))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    @property
    def parameters(self) -> int:
        """The weight matrices and norms (projection biases, a fraction of a percent, are
        left out)."""
        d, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        layer = d * (q + 2 * kv) + q * d + 3 * d * self.intermediate + 2 * d
        return self.vocab * d * (1 if self.tied else 2) + self.layers * layer + d

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


def train_row_bytes(model: ModelShape, tokens: int) -> int:
    """Temporaries of the train step per micro-batch row of ``tokens`` tokens (the fitted
    model in the module docstring)."""
    t, m = tokens, model
    words = (5.5 * m.layers * t * m.hidden + 6 * m.layers * t * m.intermediate
             + 3.5 * m.layers * m.heads * t * t + 4 * min(t, 256) * min(m.vocab, 16384))
    return int(4 * words)


def _copies(strategy: str, devices: int) -> int:
    """Copies of the parameters a process holds on its devices: one, spread over them (fsdp,
    tensor parallel), or one per device (replicated)."""
    return devices if strategy == "replicated" else 1


def trainer_estimate(cfg: Config, model: ModelShape, rows: int, devices: int,
                     capacity: int) -> Measurement:
    """The trainer process at micro-batches of ``rows`` rows of the longest sequence the
    samplers accept (``sampler.max_sequence_length``)."""
    size = _DTYPE_BYTES[cfg.model.dtype]
    params = model.parameters * size * _copies(cfg.trainer.mesh.strategy, devices)
    tokens = cfg.sampler.max_sequence_length
    batch = cfg.trainer.prompts_per_step * cfg.algorithm.group_size
    lora = cfg.model.lora is not None
    categories = {
        "parameters": params,
        "optimizer state": 0 if lora else 2 * params,
        "gradients": 0 if lora else params,
        # tokens, masks, sampler and pi_old logprobs of the whole step, kept between programs
        "batch": batch * tokens * 18,
        "temporaries": rows * train_row_bytes(model, tokens),
        "runtime": RUNTIME_BYTES["trainer"],
    }
    if cfg.algorithm.beta > 0 and not lora:
        categories["reference parameters"] = params
    return Measurement(rows, categories, [], capacity)


def sampler_estimate(cfg: Config, model: ModelShape, devices: int, capacity: int,
                     eval_prompts: int = 0, cpu_cores: int | None = None) -> Measurement:
    """One sampler process. Its KV cache grows with the sequences in flight (rows in powers
    of two, `sampler_service.kv_cache`) up to ``max_batch_size`` (fewer when
    ``kv_cache_bytes`` caps it), in each of ``concurrent_batches`` batches: counted at the
    most a run can send one sampler at once, a step's completions (``max_staleness + 1``
    steps' in an asynchronous run) or an evaluation's ``eval_prompts``, each row
    ``max_sequence_length`` wide. With ``decode_attention: paged`` the cache is a page pool,
    allocated whole (``kv_pages``)."""
    s = cfg.sampler
    size = _DTYPE_BYTES[s.dtype or cfg.model.dtype]
    params = model.parameters * size * _copies(s.mesh.strategy, devices)
    per_sequence = model.kv_bytes_per_token(size) * s.max_sequence_length
    cap = s.max_batch_size
    if s.kv_cache_bytes:
        cap = max(1, min(cap, s.kv_cache_bytes // per_sequence))
    step = cfg.trainer.prompts_per_step * cfg.algorithm.group_size
    in_flight = max(step * (cfg.trainer.max_staleness + 1), eval_prompts, 1)
    rows = min(cap, 1 << (in_flight - 1).bit_length())
    cores = os.cpu_count() if cpu_cores is None else cpu_cores
    # As sampler_service.engine.concurrent_batches_for decides it on CPU devices.
    batches = s.concurrent_batches or (2 if (cores or 1) >= 2 else 1)
    kv = rows * per_sequence
    if s.decode_attention == "paged":  # a page pool (sampler_service.paged_cache), whole
        page = model.kv_bytes_per_token(size) * s.kv_page_size
        longest = -(-s.max_sequence_length // s.kv_page_size)
        pages = s.kv_pages or (s.kv_cache_bytes // page - 1 if s.kv_cache_bytes
                               else s.max_batch_size * longest)
        kv = (pages + 1) * page  # its scratch page included
    prompts = max(1, rows // min(cfg.algorithm.group_size, rows))
    prompt = max(1, s.max_sequence_length - cfg.sampling.max_new_tokens)
    prefill = 4 * prompts * prompt * (3 * model.intermediate + 2 * model.heads * prompt)
    return Measurement(rows, {
        "parameters": params,
        "push staging": params,
        "kv cache": batches * kv,
        "temporaries": max(kv, prefill),
        "runtime": RUNTIME_BYTES["sampler"],
    }, [], capacity)


def host_memory_bytes() -> int:
    """The memory this launch's processes can have: the host's RAM, or less when the cgroup
    this process runs in is limited (v2 ``memory.max``, v1 ``memory.limit_in_bytes``). The
    total, not what is free at this moment, so the same config on the same machine plans the
    same way every time."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in memory_cgroup_files("memory.max", "memory.limit_in_bytes"):
        try:
            text = limit.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def memory_cgroup_files(v2_name: str, v1_name: str) -> list[Path]:
    """The file ``v2_name`` (unified hierarchy) or ``v1_name`` (v1 memory controller) of the
    memory cgroup this process is in, as ``/proc/self/cgroup`` names it (it may not exist)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            out.append(Path("/sys/fs/cgroup") / path.lstrip("/") / v2_name)
        elif "memory" in controllers.split(","):
            out.append(Path("/sys/fs/cgroup/memory") / path.lstrip("/") / v1_name)
    return out


def micro_batch_candidates(batch: int, ways: int) -> list[int]:
    """Micro-batch sizes worth trying, largest first: the divisors of the step's ``batch``
    rows that split evenly over the trainer's ``ways`` data-parallel devices (no padded rows,
    each device its share), else every divisor."""
    divisors = [r for r in range(batch, 0, -1) if batch % r == 0]
    even = [r for r in divisors if r % ways == 0]
    return even or divisors


@dataclasses.dataclass
class LaunchMemory:
    """Every process of a local launch, estimated, with the trainer at ``micro_batch`` rows."""

    capacity: int
    trainer: Measurement
    sampler: Measurement
    samplers: int

    @property
    def micro_batch(self) -> int:
        return self.trainer.rows

    @property
    def total(self) -> int:
        return (_peak(self.trainer) + self.samplers * _peak(self.sampler)
                + RUNTIME_BYTES["reward"])

    @property
    def fits(self) -> bool:
        return self.total <= HEADROOM * self.capacity

    def describe(self) -> str:
        t, s = self.trainer.categories, self.sampler.categories
        held = t["parameters"] + t["optimizer state"] + t["gradients"]
        return (f"about {_gib(self.total)}: the trainer {_gib(_peak(self.trainer))} (parameters, "
                f"optimizer state and gradients {_gib(held)}, micro-batches of "
                f"{self.micro_batch} rows {_gib(t['temporaries'])}), {self.samplers} sampler(s) "
                f"{_gib(_peak(self.sampler))} each (KV cache {_gib(s['kv cache'])}), of "
                f"{_gib(self.capacity)} ({HEADROOM:.0%} usable)")


@dataclasses.dataclass
class LaunchPlan:
    """The launch as configured, and the largest micro-batch at which it fits (None: none)."""

    configured: LaunchMemory
    fitting: LaunchMemory | None


def plan_launch(cfg: Config, model: ModelShape, devices: dict[str, int], capacity: int,
                eval_prompts: int = 0) -> LaunchPlan:
    """The launch at ``trainer.micro_batch_size`` (unset: the whole batch), and the largest
    of `micro_batch_candidates` that fits. ``devices``: the emulated devices of the
    "trainer" and of each "sampler" process; ``eval_prompts``: an evaluation's prompts."""
    sampler = sampler_estimate(cfg, model, devices["sampler"], capacity, eval_prompts)
    batch = cfg.trainer.prompts_per_step * cfg.algorithm.group_size

    def at(rows: int) -> LaunchMemory:
        trainer = trainer_estimate(cfg, model, rows, devices["trainer"], capacity)
        return LaunchMemory(capacity, trainer, sampler, cfg.services.num_samplers)

    configured = at(min(cfg.trainer.micro_batch_size or batch, batch))
    ways = math.prod(devices["trainer"] if v == -1 else v
                     for k, v in cfg.trainer.mesh.axes.items() if k in ("data", "fsdp"))
    fitting = next((launch for launch in map(at, micro_batch_candidates(batch, ways))
                    if launch.fits), None)
    return LaunchPlan(configured, fitting)


def _peak(estimate: Measurement) -> int:
    peak = estimate.peak
    assert peak is not None, "an estimate is computed, never refused by a compiler"
    return peak


def _gib(n: float) -> str:
    return format_bytes(n, width=0)
