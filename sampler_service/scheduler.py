"""Continuous batching: which sequences decode together, segment by segment.

The engine's thread calls `Scheduler.step()` in a loop. One step is one *segment boundary*:

1. **Retire** rows that finished in the last segment; a prompt's group is delivered when its
   n rows are done. Rows of cancelled requests are dropped.
2. **Weights**: with ``update_in_flight`` a newer version is swapped in now (each live row
   records it); otherwise the batch keeps its weights and stops admitting until it drains.
3. **Admit** waiting prompts, strictly first come first served, while their n rows fit the
   decode rows (``max_rows``) and the KV-cache budget (a paged cache: the pages of their
   final lengths, `PagedCache.admits`). A prompt's n rows are admitted together (one
   prefill). ``static`` batching admits only into an empty batch.
4. **Lay out** the cache for the rows and the next segment (`SlotCache.resize`; a paged
   cache gives each row the pages the segment writes, `PagedCache.grow`), prefill the
   admitted prompts in **chunks** of at most ``prefill_chunk_tokens`` packed tokens (each
   chunk's keys/values written into the cache and its rows' first tokens drawn before the next
   chunk is prefilled, so prefill's memory is bounded whatever the batch; a prompt is never
   split, so a chunk holds at least one), then run one decode **segment** of at most
   ``segment_steps`` steps, which ends early once enough rows finished to admit the next
   waiting prompt.

**Reproducible (exclusive) requests** run alone: admitted only into an empty batch, nothing
else joins until their last row finishes, and no weight update is applied meanwhile. Every
decision in such a session (row slots, cache shapes, prefill batches, segment lengths, when
its later prompts are admitted) is a function of the request, the weights and the engine's
configuration, so its tokens *and* logprobs are bitwise the same whatever else is queued or
running, and whenever it is admitted. (XLA CPU numerics depend on batch shapes, so only
deterministic admission, not batch-invariant kernels, can promise bitwise replay.)

**Noise**: row j of a prompt draws from a key of (prompt seed, j, the version it was admitted
under); draw i is `fold_in(key, i)`. With in-flight updates the key keeps its admission
version, so its samples stay a function of that key and the logits.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import threading
import time

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from sampler_service import _programs
from sampler_service._inputs import pack_prompts, row_params
from sampler_service.kv_cache import CacheShape, SlotCache, bucket_rows, bucket_width
from sampler_service.paged_cache import PagedCache
from sampler_service.requests import FinishedGroup, GeneratedSequence, GenerationRequest

_NEVER = 2**31 - 1


@dataclasses.dataclass
class _Group:
    request: GenerationRequest
    index: int
    rows: list
    admitted_at: float
    open_rows: int


@dataclasses.dataclass
class _Row:
    group: _Group
    sample: int
    slot: int
    prompt_len: int
    max_new: int
    stop_ids: tuple[int, ...]
    version: int  # admission version (part of the row's key)
    length: int = 0  # tokens whose keys/values are in the cache
    tokens: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    versions: list = dataclasses.field(default_factory=list)
    reason: str = ""  # "stop" | "length" once done
    pages: list = dataclasses.field(default_factory=list)  # a paged cache's, in token order

    @property
    def done(self) -> bool:
        return bool(self.reason)

    @property
    def final_width(self) -> int:
        return self.prompt_len + self.max_new


@dataclasses.dataclass
class _Weights:
    version: int
    state: object
    pinned: bool
    leaves: list = dataclasses.field(default_factory=list)  # `ServedWeights.get`'s
    programs: _programs.Programs | None = None


class Scheduler:
    """The batch in flight and its admission policy; see the module docstring."""

    def __init__(self, *, served: _programs.ServedWeights, cache: SlotCache | PagedCache,
                 vocab_size: int, eos_token_ids, pad_token_id: int, segment_steps: int,
                 prefill_chunk_tokens: int, static: bool, update_in_flight: bool, weight_source,
                 stats: dict, stats_lock: threading.Lock):
        self.served = served  # the weights as the programs take them, per state
        self.cache = cache
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.segment_steps = segment_steps
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.static = static
        self.update_in_flight = update_in_flight
        self.weight_source = weight_source
        self.stats = stats
        self.stats_lock = stats_lock
        self.queue: collections.deque[GenerationRequest] = collections.deque()
        self.queue_lock = threading.Lock()
        self.rows: dict[int, _Row] = {}  # slot -> row
        self.weights: _Weights | None = None
        self.session: GenerationRequest | None = None

    # ------------------------------------------------------------------ state queries

    @property
    def idle(self) -> bool:
        with self.queue_lock:
            return not self.rows and not self.queue

    def waiting_sequences(self) -> int:
        with self.queue_lock:
            return sum((len(r.prompts) - r.next_prompt) * r.n for r in self.queue)

    def active_sequences(self) -> int:
        return len(self.rows)

    def holds_exclusive(self) -> bool:
        """An exclusive request runs or waits here: nothing else may join it until it ends."""
        with self.queue_lock:
            return self.session is not None or any(r.exclusive for r in self.queue)

    def fail_all(self, error: BaseException) -> int:
        """After a failed program: fail every request with rows in the batch, reset the
        batch; returns how many requests failed."""
        failed = {row.group.request for row in self.rows.values()}
        for request in failed:
            request.fail(error)
            with self.queue_lock:
                if request in self.queue:
                    self.queue.remove(request)
        self.rows.clear()
        self.session = None
        self.weights = None
        self.cache.release()
        return len(failed)

    # ------------------------------------------------------------------ one boundary

    def step(self) -> None:
        self._retire()
        self._maybe_swap_weights()
        admitted = self._admit()
        if not self.rows:
            return
        new_rows = [row for group in admitted for row in group.rows]
        with self.stats_lock:
            peak = max(self.stats["peak_active_sequences"], len(self.rows))
            self.stats["peak_active_sequences"] = peak
        self._layout(new_rows)
        if admitted:
            start = time.perf_counter()
            self._prefill_and_admit(admitted)
            self._add_seconds("prefill_seconds", start)
        if any(not row.done for row in self.rows.values()):
            start = time.perf_counter()
            self._decode()
            self._add_seconds("decode_seconds", start)

    def _add_seconds(self, key: str, start: float) -> None:
        with self.stats_lock:
            self.stats[key] += time.perf_counter() - start

    # ------------------------------------------------------------------ 1. retire

    def _retire(self) -> None:
        now = time.perf_counter()
        for slot, row in list(self.rows.items()):
            request = row.group.request
            if request.cancelled:
                self._drop(slot)
                continue
            if not row.done:
                continue
            self._drop(slot)
            group = row.group
            group.open_rows -= 1
            if group.open_rows == 0:
                request.deliver(FinishedGroup(
                    index=group.index,
                    sequences=[GeneratedSequence(r.tokens, r.logprobs, r.reason,
                                                 tuple(r.versions)) for r in group.rows],
                    queue_s=group.admitted_at - request.submitted_at,
                    generate_s=now - group.admitted_at))
        with self.queue_lock:
            for request in [r for r in self.queue if r.cancelled]:
                self.queue.remove(request)
                request.finish()
        for request in {row.group.request for row in self.rows.values()}:
            if request.cancelled:
                request.finish()
        if self.session is not None and (self.session.finished or self.session.cancelled):
            if not any(row.group.request is self.session for row in self.rows.values()):
                self.session.finish()
                self.session = None
        if not self.rows and self.session is None:
            self.weights = None  # an exclusive request keeps its weights to its end

    def _drop(self, slot: int) -> None:
        self.cache.free(self.rows.pop(slot).pages)

    # ------------------------------------------------------------------ 2. weights

    def _latest(self) -> _Weights:
        if self.weight_source is None:
            raise RuntimeError("this engine has no weight source: pass the state to generate()")
        version, state = self.weight_source()
        return _Weights(int(version), state, pinned=False)

    def _maybe_swap_weights(self) -> None:
        if (not self.update_in_flight or self.weights is None or self.weights.pinned
                or self.session is not None or self.weight_source is None):
            return
        latest = self._latest()
        if latest.state is self.weights.state:
            return
        self._adopt(latest)
        for row in self.rows.values():
            if not row.done and row.versions[-1] != latest.version:
                row.versions.append(latest.version)
        with self.stats_lock:
            self.stats["weight_swaps_in_flight"] += 1

    def _adopt(self, weights: _Weights) -> None:
        weights.leaves, weights.programs = self.served.get(weights.state)
        self.weights = weights

    def _weights_for(self, request: GenerationRequest, batch_empty: bool) -> _Weights | None:
        """The batch's weights if ``request`` may join it now (adopting them when the batch
        is empty), else None (the batch must drain first)."""
        if self.session is request and self.weights is not None:
            return self.weights
        if batch_empty:
            pinned = request.pinned
            self._adopt(_Weights(pinned.version, pinned.state, pinned=True)
                        if pinned is not None else self._latest())
            return self.weights
        current = self.weights
        assert current is not None  # the batch has rows, so its weights
        if request.pinned is not None:
            same = current.pinned and current.state is request.pinned.state
            return current if same and current.version == request.pinned.version else None
        if current.pinned:
            return None
        latest = self._latest()
        return current if latest.state is current.state else None

    # ------------------------------------------------------------------ 3. admit

    def _fits(self, extra_rows: int, width: int) -> bool:
        """Whether ``extra_rows`` more rows (the batch holds the ones admitted so far) of final
        width ``width`` fit the rows and the cache."""
        return self.cache.admits([r.final_width for r in self.rows.values()]
                                 + [width] * extra_rows)

    def _admit(self) -> list[_Group]:
        if self.static and self.rows:
            return []
        admitted: list[_Group] = []
        with self.queue_lock:
            waiting = list(self.queue)
        for request in waiting:
            if request.cancelled:
                continue
            if self.session is not None and request is not self.session:
                break
            empty = not self.rows and not admitted
            if request.exclusive and self.session is not request:
                if not empty:
                    break
                self.session = request
            weights = self._weights_for(request, empty)
            if weights is None:
                break
            width = max(len(p) for p in request.prompts) + request.options.max_new_tokens
            while request.next_prompt < len(request.prompts):
                if not self._fits(request.n, width):
                    break
                admitted.append(self._new_group(request, weights))
                request.next_prompt += 1
            if request.next_prompt < len(request.prompts):
                break
            with self.queue_lock:
                self.queue.remove(request)
        return admitted

    def _new_group(self, request: GenerationRequest, weights: _Weights) -> _Group:
        index = request.next_prompt
        group = _Group(request, index, [], time.perf_counter(), request.n)
        opts = request.options
        stops = tuple(sorted(set(self.eos_token_ids) | set(opts.stop_token_ids)))
        for sample in range(request.n):
            slot = self._free_slot()
            row = _Row(group, sample, slot, len(request.prompts[index]), opts.max_new_tokens,
                       stops, weights.version, versions=[weights.version])
            group.rows.append(row)
            self.rows[slot] = row
        return group

    def _free_slot(self) -> int:
        slot = 0
        while slot in self.rows:
            slot += 1
        return slot

    # ------------------------------------------------------------------ 4. layout

    def _layout(self, new_rows: list[_Row]) -> None:
        """Cache shape for the rows and the next segment; compacts rows when that shrinks it.
        A paged cache gives each row the pages it fills by the segment's end instead of
        copying: a compaction or a new shape only re-indexes the page tables."""
        count = len(self.rows)
        rows_b = bucket_rows(count, self.cache.max_rows)
        needs = {slot: self._segment_need(row) for slot, row in self.rows.items()}
        shape = CacheShape(rows_b, bucket_width(max(needs.values()), self.cache.max_width))
        for slot, row in self.rows.items():
            self.cache.grow(row.pages, needs[slot])
        fresh = {id(r) for r in new_rows}
        old = sorted((row.slot, row) for row in self.rows.values() if id(row) not in fresh)
        sources = None
        if max(self.rows) >= rows_b:  # compact: old rows first (in slot order), then new ones
            ordered = [row for _, row in old] + new_rows
            sources = np.full(rows_b, -1, np.int32)
            for slot, row in enumerate(ordered):
                if id(row) not in fresh:
                    sources[slot] = row.slot
                row.slot = slot
            self.rows = {row.slot: row for row in ordered}
        if sources is None and shape == self.cache.shape:
            return
        if sources is None:
            sources = np.full(rows_b, -1, np.int32)
            for slot, _ in old:
                sources[slot] = slot
        self.cache.resize(shape, sources)
        with self.stats_lock:
            self.stats["cache_resizes"] += 1

    def _segment_need(self, row: _Row) -> int:
        """Slots a row may fill by the end of the next segment; by its end for the rows of an
        exclusive request. Those run alone, so nothing else will share the cache: laying it
        out once for the request's whole generation runs every segment on one decode program
        (a growing cache takes one per width bucket it passes: a program more to compile on a
        cold start for each, and a re-layout of the cache between the segments of every
        step). The cost, a wider attention in the first segments, is what `lower` already
        plans for."""
        if row.done:
            return max(row.length, 1)
        length = row.length or row.prompt_len
        generated = len(row.tokens) or 1
        left = row.max_new - generated
        if self.session is None:
            left = min(self.segment_steps, left)
        return length + left

    # ------------------------------------------------------------------ prefill + admit

    def _prefill_and_admit(self, admitted: list[_Group]) -> None:
        """The admitted prompts, chunk by chunk (`_chunks`): a packed prefill of the chunk,
        its keys/values written into the cache, its rows' first tokens drawn."""
        for chunk in self._chunks(admitted):
            self._prefill_chunk(chunk)

    def _chunks(self, admitted: list[_Group]) -> list[list[_Group]]:
        """``admitted`` in prefill chunks, in order: each the longest run of groups whose
        packed prompts (`pack_prompts`, padding included) take at most
        ``prefill_chunk_tokens``, and at least one group. Groups of any size share a chunk:
        a rollout's groups and trajectories returning from their tools (one row each),
        admitted at the same boundary, take one prefill and one admit, not one of each per
        size (admit's entries are rows, so the mix never sets its shape)."""
        prompts = [g.request.prompts[g.index] for g in admitted]

        def too_big(start: int, end: int) -> bool:
            packed = pack_prompts(prompts[start:end], self.cache.max_width, self.pad_token_id)
            return packed[0].size > self.prefill_chunk_tokens

        chunks, start = [], 0
        while start < len(admitted):
            end = len(admitted)
            if end - start > 1 and too_big(start, end):
                # packed size grows with the prompts: the last end that fits, one at least
                ends = range(start + 2, len(admitted) + 1)
                end = start + 1 + bisect.bisect_left(ends, True, key=lambda e: too_big(start, e))
                while end - start > 1 and too_big(start, end):  # first fit is not monotone
                    end -= 1
            chunks.append(admitted[start:end])
            start = end
        return chunks

    def _prefill_chunk(self, chunk: list[_Group]) -> None:
        prompts, rows, prefill_args, admit_args, plan = self._prefill_inputs(chunk)
        tokens = prefill_args[0]
        assert self.weights is not None and self.weights.programs is not None  # adopted
        assert self.cache.shape is not None  # laid out for the batch
        programs = self.weights.programs
        kv, hidden = programs.prefill(self.weights.leaves, *prefill_args)
        self.cache.arrays, tok, lp, stopped = programs.admit(
            self.weights.leaves, self.cache.arrays, self._page_table(), kv, hidden, *admit_args,
            plan=plan, sharding=self.cache.sharding(self.cache.shape.rows),
            layout=self.cache.layout)
        params = admit_args[-1]
        tok, lp, stopped = jax.device_get((tok, lp, stopped))
        for j, row in enumerate(rows):  # admit's entry j is rows[j]
            row.length = row.prompt_len
            row.tokens.append(int(tok[j]))
            row.logprobs.append(float(lp[j]))
            if stopped[j]:
                row.reason = "stop"
            elif row.max_new <= 1:
                row.reason = "length"
        with self.stats_lock:
            st = self.stats
            st["prefills"] += len(chunk)
            st["prefill_chunks"] += 1
            st["prefill_tokens"] += int(sum(p.size for p in prompts))
            st["prefill_padded_tokens"] += tokens.size
            st["tokens_generated"] += len(rows)
            self._programs_seen(("prefill", tokens.shape),
                                ("admit", self.cache.shape, tokens.shape, params.stop_ids.shape,
                                 plan))

    def _prefill_inputs(self, chunk: list[_Group]):
        """(prompts, rows, prefill's host arguments, admit's host arguments after the cache, kv
        and hidden states, the rows' `SamplePlan`) of one packed prefill of the groups of
        ``chunk``. Admit's entries are the chunk's rows in order, padded to the cache's rows
        (a padding entry's slot is past the cache: dropped). So admit's shape is the cache's
        and the packed prefill's, whatever mix of prompts and completions per prompt makes up
        the rows: a boundary that admits a rollout's groups and trajectories returning from
        their tools in any numbers runs one of the few programs the prefill shapes already
        make, where entries bucketed by count made a program per (packed rows, entries) pair,
        some of them met only after many minutes. A padding entry costs admit almost nothing
        (its writes and output projection run over the admitted rows only,
        `_programs.admit_sizes`): a row of the draw's top-k."""
        prompts = [g.request.prompts[g.index] for g in chunk]
        tokens, positions, segments, starts = pack_prompts(
            prompts, self.cache.max_width, self.pad_token_id)
        assert self.cache.shape is not None  # laid out for the batch
        rows = [row for group in chunk for row in group.rows]
        entries = self.cache.shape.rows
        row_start = np.zeros(entries, np.int32)
        row_length = np.ones(entries, np.int32)
        row_slot = np.full(entries, self.cache.shape.rows, np.int32)
        e = 0
        for i, group in enumerate(chunk):
            for row in group.rows:
                row_start[e], row_length[e], row_slot[e] = starts[i], prompts[i].size, row.slot
                e += 1
        placed = rows + [rows[0]] * (entries - len(rows))  # padding: any row's parameters
        params, plan = row_params(placed, entries, self.vocab_size)
        return (prompts, rows, (tokens, positions, segments),
                (row_start, row_length, row_slot, params), plan)

    # ------------------------------------------------------------------ decode

    def _refill_at(self) -> int:
        """Finished rows after which the segment should end, if a waiting prompt may join
        this batch (never, in static mode): enough for its n rows, and at least an eighth of
        the batch, so a boundary's fixed cost (host work, a small prefill) is paid for several
        rows rather than each one (an idle row costs 1/max_rows of a step, a boundary a few
        milliseconds)."""
        if self.static:
            return _NEVER
        if self.session is not None:
            nxt = self.session if self.session.next_prompt < len(self.session.prompts) else None
        else:
            with self.queue_lock:
                nxt = next((r for r in self.queue if not r.cancelled), None)
            if nxt is not None and (nxt.exclusive or self._weights_for(nxt, False) is None):
                nxt = None
        if nxt is None:
            return _NEVER
        free = max(self.cache.max_rows - len(self.rows), 0)
        return max(1, nxt.n - free, self.cache.max_rows // 8)

    def _decode(self) -> None:
        assert self.weights is not None and self.weights.programs is not None  # adopted
        shape = self.cache.shape
        assert shape is not None  # laid out for the batch
        order, args, plan = self._decode_inputs()
        live, params = args[3], args[4]
        start = time.perf_counter()
        self.cache.arrays, out_tok, out_lp, produced, stopped = self.weights.programs.decode(
            self.weights.leaves, self.cache.arrays, self._page_table(), *args, plan=plan,
            steps=self.segment_steps, sharding=self.cache.sharding(shape.rows),
            layout=self.cache.layout)
        out_tok, out_lp, produced, stopped = jax.device_get((out_tok, out_lp, produced, stopped))
        seconds = time.perf_counter() - start
        for slot, row in enumerate(order):
            if row is None or not live[slot]:
                continue
            k = int(produced[slot])
            row.tokens.extend(out_tok[slot, :k].tolist())
            row.logprobs.extend(out_lp[slot, :k].tolist())
            row.length += k
            if stopped[slot]:
                row.reason = "stop"
            elif len(row.tokens) >= row.max_new:
                row.reason = "length"
        steps = int(produced.max()) if produced.size else 0
        with self.stats_lock:
            st = self.stats
            st["segments"] += 1
            st["decode_steps"] += steps
            st["row_steps"] += steps * shape.rows
            st["live_row_steps"] += int(produced.sum())
            st["tokens_generated"] += int(produced.sum())
            st["last_batch_occupancy"] = (float(produced.sum()) / (steps * shape.rows)
                                          if steps else 0.0)
            st["last_tokens_per_second"] = float(produced.sum()) / seconds if seconds else 0.0
            self._programs_seen(("decode", shape, plan, params.stop_ids.shape))

    def _page_table(self):
        """A paged cache's page tables of the cache's rows (`PagedCache.page_table`), else
        None (`SlotCache.page_table`)."""
        return self.cache.page_table([self.rows[s].pages if s in self.rows else None
                                      for s in range(self.cache.shape.rows)])

    def _decode_inputs(self):
        """(the row in each cache slot or None, decode's host arguments after the cache, the
        rows' `SamplePlan`) of the next segment over every row of the cache."""
        shape = self.cache.shape
        order = [self.rows.get(slot) for slot in range(shape.rows)]
        present = [row for row in order if row is not None]
        params, plan = row_params([r or present[0] for r in order], shape.rows,
                                  self.vocab_size)
        last = np.zeros(shape.rows, np.int32)
        length = np.zeros(shape.rows, np.int32)
        generated = np.zeros(shape.rows, np.int32)
        live = np.zeros(shape.rows, bool)
        for slot, row in enumerate(order):
            if row is None:
                continue
            last[slot], length[slot], generated[slot] = row.tokens[-1], row.length, len(row.tokens)
            live[slot] = not row.done
        args = (last, length, generated, live, params, np.int32(self.segment_steps),
                np.int32(self._refill_at()))
        return order, args, plan

    # ------------------------------------------------------------------ ahead of time

    def lower(self, request: GenerationRequest) -> tuple[dict[str, jax.stages.Lowered], tuple]:
        """The programs this scheduler runs when ``request`` (pinned weights, which may be
        abstract: sharded ShapeDtypeStructs) is admitted whole into an empty batch: "prefill"
        of its first prefill chunk (`_chunks`; the largest when its prompts are alike, as a
        plan's are), "admit" of that chunk's rows into the cache laid out as `_layout` lays
        it for all of the request's rows, and "decode", a segment over that cache. Lowered for
        ahead-of-time compilation (`splitrl plan`), with the cache they run over (sharded
        ShapeDtypeStructs). Nothing runs, no cache is allocated, and the scheduler is left as
        it was (an empty batch)."""
        if self.rows or self.weights is not None:
            raise RuntimeError("lower() needs an idle scheduler")
        try:
            weights = self._weights_for(request, True)
            assert weights is not None and weights.programs is not None  # adopted: batch empty
            admitted = []
            while request.next_prompt < len(request.prompts):
                admitted.append(self._new_group(request, weights))
                request.next_prompt += 1
            rows = [row for group in admitted for row in group.rows]
            width = max(row.final_width for row in rows)
            shape = self.cache.bound_for(len(rows), width)
            self.cache.shape, self.cache.arrays = shape, self.cache.abstract_arrays(shape)
            sharding = self.cache.sharding(shape.rows)
            *_, prefill_args, admit_args, plan = self._prefill_inputs(self._chunks(admitted)[0])
            host = _replicated(self.cache.mesh)
            programs, leaves = weights.programs, weights.leaves
            pages = host(self._page_table())  # shaped as they run; no page is taken
            prefill = programs.prefill.lower(leaves, *host(prefill_args))
            kv, hidden = prefill.out_info
            admit = programs.admit.lower(leaves, self.cache.arrays, pages, kv, hidden,
                                         *host(admit_args), plan=plan, sharding=sharding,
                                         layout=self.cache.layout)
            for row in rows:  # as `_prefill_and_admit` leaves them: prompt in, a first token
                row.length, row.tokens = row.prompt_len, [0]
            _, decode_args, plan = self._decode_inputs()
            decode = programs.decode.lower(leaves, self.cache.arrays, pages, *host(decode_args),
                                           plan=plan, steps=self.segment_steps,
                                           sharding=sharding, layout=self.cache.layout)
            return {"prefill": prefill, "admit": admit, "decode": decode}, self.cache.arrays
        finally:
            self.rows.clear()
            self.weights = None
            self.cache.release()

    def _programs_seen(self, *keys) -> None:
        self.stats.setdefault("_programs", set()).update(keys)


def _replicated(mesh):
    """Host arguments as the programs receive them: numpy arrays, replicated over the mesh."""
    sharding = NamedSharding(mesh, PartitionSpec())
    return lambda tree: jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype, sharding=sharding), tree)
