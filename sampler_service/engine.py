"""`GenerationEngine`: batched, bucketed generation on the sampler's mesh.

    engine = GenerationEngine(config, graphdef, mesh=mesh, max_batch_size=64,
                              max_sequence_length=512, eos_token_ids=[2], pad_token_id=0)
    state = engine.place_state(state)          # once per weight version (the server does this)
    out = engine.generate(state, prompts, SamplingOptions(temperature=1.0, top_k=50), n=8)
    out[i][j].token_ids, out[i][j].logprobs, out[i][j].finish_reason   # "stop" | "length"

How a call runs:
- The n completions of a prompt form a *group*; groups are sorted by prompt length and packed
  into batches of at most `max_batch_size` rows (n <= max_batch_size keeps a prompt's n rows in
  one batch, so its prompt is prefilled exactly once).
- Each batch is one compiled program (`_gen_program.generate_program`): prefill of its distinct
  prompts, then the KV-cache decode loop inside `lax.while_loop`, sampling on device. Shapes are
  bucketed (prompt length and generation length to powers of two >= 16, prompts per batch to
  powers of two) so a run compiles a handful of programs; jit caches them.
- Weights are the `state` argument of every call: a call finishes on the state it was given
  while the server may already hand a newer state to the next call.

Logprobs are `log_softmax(logits / temperature)` at the sampled token, before top-k/top-p
truncation (see `sampling`). Sample j of prompt i is drawn from keys derived from (the prompt's
seed, j, the weight version), so it does not depend on which batch or row it was computed in;
a prompt's seed is `seeds[i]` when given, else `sampling.prompt_seed(options.seed, i)`.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sampler_service._gen_program import Plan, generate_program
from sampler_service.sampling import SamplingOptions, prompt_seed, seed_words
from splitrl.mesh import TENSOR_AXIS, param_shardings
from splitrl.models import TransformerConfig, hf_from_state, state_from_hf

_MIN_BUCKET = 16
_STOP_SLOTS = 8  # stop-id array sizes are multiples of this (fewer recompiles)


@dataclasses.dataclass(frozen=True)
class GeneratedSequence:
    """One completion: token ids (stop token included), their logprobs, why it ended."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (EOS or a stop token) or "length" (max_new_tokens)


def bucket(size: int, minimum: int = _MIN_BUCKET, cap: int | None = None) -> int:
    """Smallest power of two >= size (and >= minimum), limited to cap (if cap >= size)."""
    b = max(minimum, 1 << max(size - 1, 0).bit_length())
    if cap is not None and size <= cap < b:
        b = cap
    return b


@functools.partial(jax.jit, static_argnames=("graphdef", "plan"))
def _run(graphdef, state, *args, plan):
    return generate_program(graphdef, state, *args, plan=plan)


class GenerationEngine:
    """Generates completions for token-id prompts with a `splitrl.models.CausalLM` graphdef."""

    def __init__(self, model_config: TransformerConfig, graphdef, *, mesh: Mesh,
                 max_batch_size: int, max_sequence_length: int,
                 eos_token_ids: Sequence[int] = (), pad_token_id: int | None = 0):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size: expected >= 1, got {max_batch_size}")
        if max_sequence_length < 2:
            raise ValueError(f"max_sequence_length: expected >= 2, got {max_sequence_length}")
        self.config = model_config
        self.graphdef = graphdef
        self.mesh = mesh
        self.max_batch_size = int(max_batch_size)
        self.max_sequence_length = int(max_sequence_length)
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.pad_token_id = 0 if pad_token_id is None else int(pad_token_id)
        self._replicated = NamedSharding(mesh, PartitionSpec())
        self._lock = threading.Lock()
        self._programs: set[tuple] = set()
        self._stats = dict(requests=0, batches=0, prefills=0, sequences=0, tokens_generated=0,
                           generate_seconds=0.0, row_slots=0, last_batch_occupancy=0.0,
                           last_tokens_per_second=0.0)

    # ------------------------------------------------------------------ weights

    def state_shardings(self, strategy: str | None = "tp") -> dict[str, NamedSharding]:
        """{hf_name: NamedSharding} of the parameters on this engine's mesh."""
        from splitrl.models import param_shapes

        shapes = {k: v.shape for k, v in param_shapes(self.config).items()}
        return param_shardings(self.mesh, shapes, strategy)

    def place_state(self, state: nnx.State, strategy: str | None = "tp") -> nnx.State:
        """The state with every parameter placed on the mesh (no copy where already there)."""
        flat = hf_from_state(state)
        shardings = self.state_shardings(strategy)
        placed = {k: jax.device_put(v, shardings[k]) for k, v in flat.items()}
        return state_from_hf(self.config, placed)

    # ------------------------------------------------------------------ generation

    def generate(self, state: nnx.State, prompts: Sequence[Sequence[int]],
                 options: SamplingOptions, n: int = 1, *, seeds: Sequence[int] | None = None,
                 version: int = 0) -> list[list[GeneratedSequence]]:
        """n completions for each prompt (token ids), as `result[prompt][sample]`.

        `seeds`: one 64-bit seed per prompt (default: derived from `options.seed` and the
        prompt's index); `version`: the weight version of `state`, part of every row's key.
        """
        if not isinstance(options, SamplingOptions):
            raise TypeError(f"options: expected SamplingOptions, got {type(options).__name__}")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"n: expected an integer >= 1, got {n!r}")
        prompts = self._check_prompts(prompts, options.max_new_tokens)
        if seeds is None:
            seeds = [prompt_seed(options.seed, i) for i in range(len(prompts))]
        elif len(seeds) != len(prompts):
            raise ValueError(f"seeds: expected one per prompt ({len(prompts)}), got {len(seeds)}")
        words = seed_words(seeds)
        version_words = seed_words([version])[0]
        start = time.perf_counter()
        group = min(n, self.max_batch_size)
        groups = [(i, list(range(j, min(j + group, n))))
                  for i in range(len(prompts)) for j in range(0, n, group)]
        groups.sort(key=lambda g: len(prompts[g[0]]))
        per_batch = self.max_batch_size // group
        results: list[list[GeneratedSequence | None]] = [[None] * n for _ in prompts]
        # Every batch of a call has the same number of prompt slots (fewer programs).
        p = bucket(min(len(groups), per_batch), minimum=1, cap=per_batch)
        slots = 0
        for b in range(0, len(groups), per_batch):
            slots += self._generate_batch(state, prompts, groups[b:b + per_batch], p, group,
                                          options, words, version_words, results)
        seconds = time.perf_counter() - start
        tokens = sum(len(s.token_ids) for row in results for s in row)
        with self._lock:
            st = self._stats
            st["requests"] += 1
            st["sequences"] += len(prompts) * n
            st["tokens_generated"] += tokens
            st["generate_seconds"] += seconds
            st["row_slots"] += slots
            st["last_batch_occupancy"] = len(prompts) * n / slots
            st["last_tokens_per_second"] = tokens / seconds if seconds > 0 else 0.0
        return results  # type: ignore[return-value]

    @property
    def stats(self) -> dict:
        """Cumulative counters for metrics: requests, batches, prefills (prompt prefills run),
        sequences, tokens_generated, generate_seconds, tokens_per_second, batch_occupancy
        (real rows / padded rows), last_batch_occupancy, last_tokens_per_second and
        compiled_programs (distinct bucket shapes seen)."""
        with self._lock:
            st = dict(self._stats)
            st["compiled_programs"] = len(self._programs)
        st["tokens_per_second"] = (st["tokens_generated"] / st["generate_seconds"]
                                   if st["generate_seconds"] > 0 else 0.0)
        st["batch_occupancy"] = st["sequences"] / st["row_slots"] if st["row_slots"] else 0.0
        return st

    def _check_prompts(self, prompts, max_new_tokens: int) -> list[np.ndarray]:
        if isinstance(prompts, str | bytes) or not isinstance(prompts, Sequence) or not prompts:
            raise ValueError("prompts: expected a non-empty list of token-id lists")
        out = []
        vocab = self.config.vocab_size
        for i, prompt in enumerate(prompts):
            arr = np.asarray(prompt)
            if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
                raise ValueError(f"prompts[{i}]: expected a non-empty list of token ids")
            if arr.min() < 0 or arr.max() >= vocab:
                raise ValueError(f"prompts[{i}]: token ids must be in [0, {vocab}), got "
                                 f"min {int(arr.min())} max {int(arr.max())}")
            if arr.size + max_new_tokens > self.max_sequence_length:
                raise ValueError(
                    f"prompts[{i}]: prompt length {arr.size} + max_new_tokens {max_new_tokens} "
                    f"= {arr.size + max_new_tokens} exceeds max_sequence_length "
                    f"{self.max_sequence_length}")
            out.append(arr.astype(np.int32))
        return out

    def _cache_shardings(self, p: int, n: int) -> tuple[NamedSharding, NamedSharding]:
        """Prompt cache [P,K,T,D] and generation cache [P*n,K,S,D] shardings.

        KV heads go on the "tensor" axis when they divide by it, else the prompt batch does;
        any other mesh axis (data, fsdp) splits the prompt batch when it divides.
        """
        sizes = dict(zip(self.mesh.axis_names, self.mesh.devices.shape, strict=True))
        head_axes, batch_axes = [], []
        for name, size in sizes.items():
            if size == 1:
                continue
            if name == TENSOR_AXIS and self.config.num_kv_heads % size == 0:
                head_axes.append(name)
            else:
                batch_axes.append(name)
        batch = [a for a in batch_axes if p % sizes[a] == 0]
        if batch and p % int(np.prod([sizes[a] for a in batch])) != 0:
            batch = batch[:1]
        b = tuple(batch) if batch else None
        h = tuple(head_axes) if head_axes else None
        return (NamedSharding(self.mesh, PartitionSpec(b, h, None, None)),
                NamedSharding(self.mesh, PartitionSpec(b, h, None, None)))

    def _program_inputs(self, tokens, mask, valid, prompt_seeds, sample_ids, version_words,
                        options: SamplingOptions) -> tuple[Plan, list[np.ndarray]]:
        """The static `Plan` and the host arguments of one batch's generation program."""
        p, group = valid.shape
        nb = bucket(options.max_new_tokens, cap=self.max_sequence_length)
        stops = sorted(set(self.eos_token_ids) | set(options.stop_token_ids))
        stop_ids = np.full(bucket(len(stops), minimum=_STOP_SLOTS), -1, np.int32)
        stop_ids[:len(stops)] = stops
        greedy = options.is_greedy
        prompt_sh, gen_sh = self._cache_shardings(p, group)
        plan = Plan(new_tokens=nb, top_k=0 if greedy else options.top_k,
                    use_top_p=not greedy and options.top_p < 1.0, greedy=greedy,
                    prompt_cache_sharding=prompt_sh, gen_cache_sharding=gen_sh)
        args = [tokens, mask, valid, prompt_seeds, sample_ids, version_words,
                np.float32(options.temperature if options.temperature > 0 else 1.0),
                np.float32(options.top_p), np.float32(options.logprob_temperature),
                np.int32(options.max_new_tokens), stop_ids]
        return plan, args

    def lower_generate(self, state: nnx.State, *, prompts: int, group: int,
                       prompt_length: int, options: SamplingOptions) -> jax.stages.Lowered:
        """The generation program of one batch (`prompts` prompt slots x `group` rows, prompts
        bucketed to `prompt_length`), lowered with this engine's mesh and cache shardings for
        ahead-of-time compilation (`splitrl plan`). `state` may be abstract (sharded
        ShapeDtypeStructs): nothing runs."""
        t = bucket(prompt_length, cap=self.max_sequence_length)
        valid = np.zeros((prompts, group), bool)
        plan, args = self._program_inputs(
            np.zeros((prompts, t), np.int32), np.zeros((prompts, t), bool), valid,
            np.zeros((prompts, 2), np.uint32), np.zeros((prompts, group), np.int32),
            seed_words([0])[0], options)
        args = [jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype, sharding=self._replicated)
                for a in args]
        return _run.lower(self.graphdef, state, *args, plan=plan)

    def _generate_batch(self, state, prompts, groups, p, group, options, words, version_words,
                        results) -> int:
        """Runs one compiled program for `groups` padded to p prompts; fills `results`;
        returns the padded row count."""
        longest = max(len(prompts[i]) for i, _ in groups)
        t = bucket(longest, cap=self.max_sequence_length)
        tokens = np.full((p, t), self.pad_token_id, np.int32)
        mask = np.zeros((p, t), bool)
        valid = np.zeros((p, group), bool)
        prompt_seeds = np.zeros((p, 2), np.uint32)
        sample_ids = np.zeros((p, group), np.int32)
        for row, (i, samples) in enumerate(groups):
            ids = prompts[i]
            tokens[row, t - ids.size:] = ids
            mask[row, t - ids.size:] = True
            valid[row, :len(samples)] = True
            prompt_seeds[row] = words[i]
            sample_ids[row, :len(samples)] = samples
        plan, args = self._program_inputs(tokens, mask, valid, prompt_seeds, sample_ids,
                                          version_words, options)
        args = [jax.device_put(a, self._replicated) for a in args]
        with self._lock:
            self._programs.add((p, group, t, plan))
            self._stats["batches"] += 1
            self._stats["prefills"] += len(groups)
        out_tok, out_lp, lengths, stopped = jax.device_get(
            _run(self.graphdef, state, *args, plan=plan))
        for row, (i, samples) in enumerate(groups):
            for col, j in enumerate(samples):
                r = row * group + col
                length = int(lengths[r])
                results[i][j] = GeneratedSequence(
                    token_ids=out_tok[r, :length].tolist(),
                    logprobs=out_lp[r, :length].tolist(),
                    finish_reason="stop" if stopped[r] else "length")
        return p * group

