"""`GenerationEngine`: continuous-batching generation on the sampler's mesh.

    engine = GenerationEngine(config, graphdef, mesh=mesh, max_batch_size=64,
                              max_sequence_length=512, eos_token_ids=[2], pad_token_id=0,
                              weights=store.snapshot)        # () -> (version, state)
    request = engine.submit(prompts, SamplingOptions(temperature=1.0, top_k=50), n=8)
    for group in request.groups():                            # as each prompt's n finish
        group.index, group.sequences[j].token_ids, .logprobs, .finish_reason, .weight_versions
    out = engine.generate(state, prompts, options, n=8)       # blocking, on given weights

One thread owns the device work of a batch (`scheduler.Scheduler`): requests from every
caller (all Rollout and Generate calls) share a batch of up to ``max_batch_size`` decode rows
whose KV cache (`kv_cache.SlotCache`; on TPU a page pool, `paged_cache.PagedCache`) never
exceeds ``kv_cache_bytes`` (or ``kv_pages`` pages). Between decode
segments of ``segment_steps`` steps, finished rows are retired and their slots refilled from
waiting prompts (``batching="continuous"``; ``"static"`` drains the batch first, for
comparison). A prompt's n completions share its prefill; the prompts admitted at a boundary
are prefilled in chunks of at most ``prefill_chunk_tokens`` packed tokens, each written into
the cache before the next, so prefill's memory is bounded whatever the batch. Requests that do
not fit wait in a queue.

With ``concurrent_batches`` > 1 the engine runs that many such batches, each with its own
thread and KV cache (of ``kv_cache_bytes`` each), on the same weights and compiled programs.
Requests share the first batch not held by an exclusive request (one batch decodes them
fastest); an exclusive request takes the first idle batch, so the reproducible requests of a
step decode at the same time instead of one after the other. On XLA:CPU a program runs on
its caller's thread, so two batches use two cores (bench/README.md, "A synchronous step");
a batch's tokens do not depend on which batch it is.

Reproducibility: sample j of a prompt draws from keys of (the prompt's seed, j, the weight
version it was admitted under) (see `sampling`), so a seed reproduces its samples whatever else
is in the batch, up to last-bit differences of batch-shape-dependent matmuls. ``exclusive``
requests (RolloutRequest.reproducible) are admitted into an empty batch and run alone, so their
tokens and logprobs are bitwise a function of the request and the weights (scheduler docs).

Logprobs are `log_softmax(logits / temperature)` at the sampled token, before top-k/top-p
truncation (see `sampling`). A prompt's seed is ``seeds[i]`` when given, else
`sampling.prompt_seed(options.seed, i)`.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from sampler_service import metrics
from sampler_service._programs import ServedWeights
from sampler_service.kv_cache import SlotCache, layout_for
from sampler_service.paged_cache import PagedCache, PagedLayout, page_bytes, pages_for
from sampler_service.requests import (
    EngineClosed,
    GeneratedSequence,
    GenerationRequest,
    PinnedWeights,
)
from sampler_service.sampling import SamplingOptions, prompt_seed
from sampler_service.scheduler import Scheduler
from splitrl.config import Config
from splitrl.mesh import param_shardings
from splitrl.models import TransformerConfig, hf_from_state, state_from_hf

log = logging.getLogger(__name__)

__all__ = ["GenerationEngine", "engine_from_config", "serving_dtype"]

_COUNTERS = ("requests", "sequences", "prefills", "prefill_chunks", "prefill_tokens",
             "prefill_padded_tokens",
             "tokens_generated", "segments", "decode_steps", "row_steps", "live_row_steps",
             "cache_resizes", "weight_swaps_in_flight", "generate_tokens")


def concurrent_batches_for(configured: int | None, mesh: Mesh) -> int:
    """``sampler.concurrent_batches`` (``configured``) on ``mesh``; when unset, 2 on CPU
    devices with two cores or more (XLA:CPU runs a program on its caller's thread: a second
    batch is a second core at work), 1 on accelerators, which run one program at a time and
    where a second KV cache costs device memory."""
    if configured is not None:
        return configured
    cpu = all(d.platform == "cpu" for d in mesh.devices.flat)
    return 2 if cpu and (os.cpu_count() or 1) >= 2 else 1


class GenerationEngine:
    """Generates completions for token-id prompts with a `splitrl.models.CausalLM` graphdef."""

    def __init__(self, model_config: TransformerConfig, graphdef, *, mesh: Mesh,
                 max_batch_size: int, max_sequence_length: int,
                 eos_token_ids: Sequence[int] = (), pad_token_id: int | None = 0,
                 kv_cache_bytes: int = 0, batching: str = "continuous",
                 segment_steps: int = 16, prefill_chunk_tokens: int = 8192,
                 update_in_flight: bool = False,
                 weights: Callable[[], tuple[int, nnx.State]] | None = None,
                 dtype=jnp.float32, concurrent_batches: int = 1,
                 decode_attention: str = "auto", kv_page_size: int = 64, kv_pages: int = 0,
                 kv_pages_per_sequence: int | None = None):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size: expected >= 1, got {max_batch_size}")
        if max_sequence_length < 2:
            raise ValueError(f"max_sequence_length: expected >= 2, got {max_sequence_length}")
        if batching not in ("continuous", "static"):
            raise ValueError(f"batching: expected 'continuous' or 'static', got {batching!r}")
        if segment_steps < 1:
            raise ValueError(f"segment_steps: expected >= 1, got {segment_steps}")
        if prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens: expected >= 1, got {prefill_chunk_tokens}")
        if concurrent_batches < 1:
            raise ValueError(f"concurrent_batches: expected >= 1, got {concurrent_batches}")
        self.config = model_config
        self.graphdef = graphdef
        self.mesh = mesh
        self.max_sequence_length = int(max_sequence_length)
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.pad_token_id = 0 if pad_token_id is None else int(pad_token_id)
        self.batching = batching
        # the cache's layout: the paged one (Pallas kernel) on TPU unless told otherwise
        layout = layout_for(mesh, decode_attention, kv_page_size, model_config.head_dim)
        self.caches: list[SlotCache | PagedCache]
        if isinstance(layout, PagedLayout):
            self.caches = [self._page_pool(model_config, dtype, layout, max_batch_size,
                                           kv_cache_bytes, kv_pages, kv_pages_per_sequence)
                           for _ in range(concurrent_batches)]
        else:
            self.caches = [self._slot_cache(model_config, dtype, layout, max_batch_size,
                                            kv_cache_bytes) for _ in range(concurrent_batches)]
        self.cache = self.caches[0]
        self.max_batch_size = self.cache.guaranteed_rows()
        self._lock = threading.Lock()
        self._stats: dict = dict.fromkeys(_COUNTERS, 0)
        self._stats.update(generate_seconds=0.0, prefill_seconds=0.0, decode_seconds=0.0,
                           last_batch_occupancy=0.0,
                           last_tokens_per_second=0.0, peak_active_sequences=0,
                           peak_queued_sequences=0)
        served = ServedWeights(graphdef, layout.layers_apart)  # one per state, for all batches
        self.schedulers = [Scheduler(
            served=served, cache=cache, vocab_size=model_config.vocab_size,
            eos_token_ids=self.eos_token_ids, pad_token_id=self.pad_token_id,
            segment_steps=int(segment_steps), prefill_chunk_tokens=int(prefill_chunk_tokens),
            static=batching == "static",
            update_in_flight=bool(update_in_flight), weight_source=weights,
            stats=self._stats, stats_lock=self._lock) for cache in self.caches]
        self.scheduler = self.schedulers[0]
        self._ids = itertools.count()
        self._submit_lock = threading.Lock()  # a request's batch is chosen and joined at once
        self._wakes = [threading.Condition(s.queue_lock) for s in self.schedulers]
        self._threads: list[threading.Thread | None] = [None] * concurrent_batches
        self._closed = False

    def _slot_cache(self, config, dtype, layout, rows: int, kv_cache_bytes: int) -> SlotCache:
        """One batch's slot cache under ``kv_cache_bytes`` (0: what ``rows`` sequences of
        max_sequence_length need, resizes included)."""
        probe = SlotCache(config, dtype, self.mesh, budget_bytes=0, max_rows=rows,
                          max_width=self.max_sequence_length, layout=layout)
        full = probe.shape_bytes(probe.bound_for(rows, self.max_sequence_length))
        budget = int(kv_cache_bytes) or full + full // probe.num_arrays
        cache = SlotCache(config, dtype, self.mesh, budget_bytes=budget, max_rows=rows,
                          max_width=self.max_sequence_length, layout=layout)
        if cache.guaranteed_rows() < 1:
            need = probe.bound_for(1, self.max_sequence_length).width * probe.bytes_per_token
            raise ValueError(
                f"kv_cache_bytes {budget} holds no sequence of max_sequence_length "
                f"{self.max_sequence_length} (one needs {need + need // probe.num_arrays} "
                f"bytes: {probe.bytes_per_token} per token, plus the one array held twice while "
                "the cache is resized: its keys or its values, on CPU one layer's)")
        return cache

    def _page_pool(self, config, dtype, layout, rows: int, kv_cache_bytes: int, pages: int,
                   pages_per_sequence: int | None) -> PagedCache:
        """One batch's page pool: ``pages`` pages, else as many as ``kv_cache_bytes`` holds
        (the scratch page included), else enough for ``rows`` sequences of
        max_sequence_length; ``pages_per_sequence`` (None: what max_sequence_length needs)
        bounds a row's pages."""
        longest = pages_for(self.max_sequence_length, layout.page_size)
        per_sequence = longest if pages_per_sequence is None else int(pages_per_sequence)
        one_page = page_bytes(config, dtype, layout.page_size)
        if pages and kv_cache_bytes:
            raise ValueError("kv_pages and kv_cache_bytes both size the page pool: set one")
        pages = int(pages) or (int(kv_cache_bytes) // one_page - 1 if kv_cache_bytes
                               else rows * longest)
        if pages < longest:
            raise ValueError(
                f"the KV page pool's {max(pages, 0)} pages of {layout.page_size} tokens "
                f"({'kv_pages' if not kv_cache_bytes else f'kv_cache_bytes {kv_cache_bytes}'})"
                f" hold no sequence of max_sequence_length {self.max_sequence_length}: one "
                f"needs {longest} pages of {one_page} bytes, plus one scratch page")
        return PagedCache(config, dtype, self.mesh, layout=layout, pages=pages,
                          pages_per_sequence=per_sequence, max_rows=rows,
                          max_width=self.max_sequence_length)

    @property
    def kv_cache_budget_bytes(self) -> int:
        """What the KV caches of all batches may hold together."""
        return sum(cache.budget_bytes for cache in self.caches)

    def _gauges(self) -> dict[str, int]:
        """Sequences waiting and decoding, and KV cache bytes allocated, over all batches:
        what `stats` reports and `_publish` exports."""
        return {"queued_sequences": sum(s.waiting_sequences() for s in self.schedulers),
                "active_sequences": sum(s.active_sequences() for s in self.schedulers),
                "kv_cache_bytes": sum(cache.allocated_bytes for cache in self.caches),
                "kv_pages_in_use": sum(cache.pages_in_use for cache in self.caches)}

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

    def serve_ahead(self) -> threading.Thread | None:
        """Make the newest weights' served form (`ServedWeights`: on CPU every layer's views
        of the stacked weights, and the programs looked up) now, on a thread of its own,
        instead of when the next batch starts. A push's transport calls this once it has
        answered the trainer: the work then overlaps the trainer's way to its next request
        rather than sitting between that request's arrival and its first prefill, where both
        of a synchronous step's requests waited for it (bench/README.md, "The view build off
        the step's path"). A batch that starts meanwhile waits for it under the entry's lock,
        as the second batch of a version always did. Returns the thread making it (None
        without a weight source: an engine of pinned weights only)."""
        source = self.scheduler.weight_source
        if source is None:
            return None

        def build() -> None:
            try:
                self.scheduler.served.get(source()[1])
            except Exception as e:  # the next batch makes it again, and fails as it would have
                log.warning("the pushed weights could not be prepared for serving ahead of "
                            "the next batch", extra={"error": repr(e)})

        thread = threading.Thread(target=build, name="serve-ahead", daemon=True)
        thread.start()
        return thread

    # ------------------------------------------------------------------ requests

    def submit(self, prompts: Sequence[Sequence[int]], options: SamplingOptions, n: int = 1, *,
               seeds: Sequence[int] | None = None, exclusive: bool = False,
               weights: PinnedWeights | None = None, sink=None) -> GenerationRequest:
        """Queue n completions for each prompt; returns at once (see `GenerationRequest`).

        ``weights``: generate with these (else the newest of the engine's weight source);
        ``exclusive``: run alone in the batch, bitwise reproducible (module docstring);
        ``sink``: where finished groups go instead of the request's own queue.
        Raises ValueError for a request this engine can never serve.
        """
        request = self.new_request(prompts, options, n, seeds=seeds, exclusive=exclusive,
                                   weights=weights, sink=sink)
        with self._submit_lock:
            batch = self._batch_for(request)
            with self._wakes[batch]:
                if self._closed:
                    raise EngineClosed("the engine is closed")
                self.schedulers[batch].queue.append(request)
                if self._threads[batch] is None:
                    thread = self._threads[batch] = threading.Thread(
                        target=self._run, args=(batch,), name=f"engine-{batch}", daemon=True)
                    thread.start()
                self._wakes[batch].notify()
        self._publish()
        return request

    def _batch_for(self, request: GenerationRequest) -> int:
        """The batch a request joins: an exclusive one the first idle batch, any other the
        first batch no exclusive request holds (so they batch together); else the batch with
        the fewest sequences queued or decoding."""
        schedulers = self.schedulers
        if len(schedulers) == 1:
            return 0
        for i, scheduler in enumerate(schedulers):
            if scheduler.idle if request.exclusive else not scheduler.holds_exclusive():
                return i
        loads = [s.waiting_sequences() + s.active_sequences() for s in schedulers]
        return loads.index(min(loads))

    def new_request(self, prompts: Sequence[Sequence[int]], options: SamplingOptions,
                    n: int = 1, *, seeds: Sequence[int] | None = None, exclusive: bool = False,
                    weights: PinnedWeights | None = None, sink=None) -> GenerationRequest:
        """A validated request, not queued: `submit` queues it for the engine's thread; a
        caller stepping `scheduler` itself appends it to ``scheduler.queue``."""
        if not isinstance(options, SamplingOptions):
            raise TypeError(f"options: expected SamplingOptions, got {type(options).__name__}")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"n: expected an integer >= 1, got {n!r}")
        if n > self.max_batch_size:
            raise ValueError(f"n: {n} completions of one prompt are decoded together, but at "
                             f"most {self.max_batch_size} rows fit this engine (max_batch_size "
                             "and kv_cache_bytes)")
        if weights is None and self.scheduler.weight_source is None:
            raise ValueError("this engine has no weight source: pass the weights to use")
        arrays = self._check_prompts(prompts, options.max_new_tokens)
        if seeds is None:
            seeds = [prompt_seed(options.seed, i) for i in range(len(arrays))]
        elif len(seeds) != len(arrays):
            raise ValueError(f"seeds: expected one per prompt ({len(arrays)}), got {len(seeds)}")
        with self._lock:
            self._stats["requests"] += 1
            self._stats["sequences"] += len(arrays) * n
        return GenerationRequest(next(self._ids), arrays, seeds, options, n,
                                 exclusive=exclusive, pinned=weights, sink=sink)

    def generate(self, state: nnx.State, prompts: Sequence[Sequence[int]],
                 options: SamplingOptions, n: int = 1, *, seeds: Sequence[int] | None = None,
                 version: int = 0, exclusive: bool = False) -> list[list[GeneratedSequence]]:
        """n completions for each prompt, ``result[prompt][sample]``, generated with ``state``
        (weight ``version``, part of every row's key); blocks until done."""
        start = time.perf_counter()
        request = self.submit(prompts, options, n, seeds=seeds, exclusive=exclusive,
                              weights=PinnedWeights(int(version), state))
        try:
            result = request.result()
        finally:
            request.cancel()
        seconds = time.perf_counter() - start
        tokens = sum(len(s.token_ids) for row in result for s in row)
        with self._lock:
            self._stats["generate_seconds"] += seconds
            self._stats["generate_tokens"] += tokens
        return result

    def close(self) -> None:
        """Stop the engine threads; requests not finished fail with `EngineClosed`."""
        with self._submit_lock:
            for wake in self._wakes:  # under each batch's lock: its thread cannot miss it
                with wake:
                    self._closed = True
                    wake.notify()
        for thread in self._threads:
            if thread is not None:
                thread.join(timeout=60)

    # ------------------------------------------------------------------ the engine threads

    def _run(self, batch: int) -> None:
        scheduler, wake = self.schedulers[batch], self._wakes[batch]
        while True:
            with wake:
                while not self._closed and not scheduler.rows and not scheduler.queue:
                    wake.wait()
                if self._closed:
                    break
            try:
                scheduler.step()
            except Exception as e:  # a program failed: fail what was in the batch, go on
                log.exception("generation step failed")
                if not scheduler.fail_all(e):  # nothing was running: admitting the head failed
                    with scheduler.queue_lock:
                        head = scheduler.queue.popleft() if scheduler.queue else None
                    if head is not None:
                        head.fail(e)
            self._publish()
        error = EngineClosed("the engine was closed before the request finished")
        scheduler.fail_all(error)
        with scheduler.queue_lock:
            pending, scheduler.queue = list(scheduler.queue), type(scheduler.queue)()
        for request in pending:
            request.fail(error)

    def _publish(self) -> None:
        gauges = self._gauges()
        waiting = gauges["queued_sequences"]
        with self._lock:
            self._stats["peak_queued_sequences"] = max(self._stats["peak_queued_sequences"],
                                                       waiting)
        metrics.QUEUED_SEQUENCES.set(waiting)
        metrics.ACTIVE_SEQUENCES.set(gauges["active_sequences"])
        metrics.KV_CACHE_BYTES.set(gauges["kv_cache_bytes"])
        metrics.KV_PAGES_IN_USE.set(gauges["kv_pages_in_use"])
        metrics.BATCH_OCCUPANCY.set(self._stats["last_batch_occupancy"])
        metrics.TOKENS_PER_SECOND.set(self._stats["last_tokens_per_second"])

    # ------------------------------------------------------------------ accounting

    @property
    def stats(self) -> dict:
        """Counters: requests, sequences, prefills (prompts prefilled), prefill_chunks (prefill
        programs run: chunks of at most prefill_chunk_tokens), prefill_tokens,
        prefill_padded_tokens, tokens_generated, segments, decode_steps, row_steps (decode
        rows computed), live_row_steps (of which drew a token), cache_resizes,
        weight_swaps_in_flight, generate_seconds and generate_tokens (of `generate` calls),
        prefill_seconds and decode_seconds (wall time in prefill + first tokens, in decode
        segments);
        gauges: batch_occupancy (live / computed rows, whole life), last_batch_occupancy and
        last_tokens_per_second (last segment), queued_sequences, active_sequences,
        peak_active_sequences, peak_queued_sequences, kv_cache_bytes (allocated now),
        kv_pages_in_use (of the page pools: held by sequences in flight),
        kv_cache_peak_bytes,
        kv_cache_budget_bytes, compiled_programs."""
        with self._lock:
            st = {k: v for k, v in self._stats.items() if not k.startswith("_")}
            st["compiled_programs"] = len(self._stats.get("_programs", ()))
        st["batch_occupancy"] = (st["live_row_steps"] / st["row_steps"]
                                 if st["row_steps"] else 0.0)
        st.update(self._gauges())
        st["kv_cache_peak_bytes"] = sum(cache.peak_bytes for cache in self.caches)
        st["kv_cache_budget_bytes"] = self.kv_cache_budget_bytes
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


def serving_dtype(config: Config) -> jnp.dtype:
    """The dtype a sampler serves in: ``sampler.dtype``, else ``model.dtype``."""
    return jnp.dtype(config.sampler.dtype or config.model.dtype)


def engine_from_config(config: Config, model_config: TransformerConfig, graphdef, mesh: Mesh, *,
                       eos_token_ids: Sequence[int], pad_token_id: int | None,
                       weights: Callable[[], tuple[int, nnx.State]] | None = None,
                       max_batch_size: int | None = None,
                       kv_cache_bytes: int | None = None,
                       kv_pages: int | None = None) -> GenerationEngine:
    """The engine as ``sampler.*`` configures it: the one a sampler serves with
    (`sampler_service.server.serve`) and the one `splitrl plan` compiles, built in one place so
    that the plan measures the programs the sampler runs. ``max_batch_size``,
    ``kv_cache_bytes`` and ``kv_pages`` replace the configured ones (the planner's searched
    sizes)."""
    sampler = config.sampler
    return GenerationEngine(
        model_config, graphdef, mesh=mesh,
        max_batch_size=sampler.max_batch_size if max_batch_size is None else max_batch_size,
        max_sequence_length=sampler.max_sequence_length,
        eos_token_ids=eos_token_ids, pad_token_id=pad_token_id,
        kv_cache_bytes=sampler.kv_cache_bytes if kv_cache_bytes is None else kv_cache_bytes,
        batching=sampler.batching, segment_steps=sampler.segment_steps,
        prefill_chunk_tokens=sampler.prefill_chunk_tokens,
        decode_attention=sampler.decode_attention, kv_page_size=sampler.kv_page_size,
        kv_pages=sampler.kv_pages if kv_pages is None else kv_pages,
        kv_pages_per_sequence=sampler.kv_pages_per_sequence,
        update_in_flight=sampler.update_in_flight, weights=weights,
        dtype=serving_dtype(config),
        concurrent_batches=concurrent_batches_for(sampler.concurrent_batches, mesh))
