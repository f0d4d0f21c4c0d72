"""Host-side inputs of the engine's programs: packed prompts and per-row sampling arrays."""

from __future__ import annotations

import numpy as np

from sampler_service import _programs
from sampler_service.sampling import SamplePlan, seed_words

_STOP_SLOTS = 8  # stop-id columns per row: multiples of this (fewer programs)
_MIN_PROMPT_WIDTH = 16
_MAX_PACKED_WIDTH = 512  # wider rows would pay W^2 attention for little less padding


def pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def pack_prompts(prompts: list[np.ndarray], max_width: int, pad: int):
    """Packs prompts into rows of W tokens, first fit by decreasing length (ties: in order).

    W is the longest prompt's power of two (>= 16, <= max_width) or twice or four times that,
    whichever needs the fewest padded tokens once the row count is bucketed (`rows_bucket`).
    Returns (tokens, positions, segments [B, W] int32 (segment i = prompt i, -1 = padding),
    starts [P]: the flat position of each prompt's first token).
    """
    narrowest = min(max(pow2(max(p.size for p in prompts)), _MIN_PROMPT_WIDTH), max_width)
    options = [_first_fit(prompts, w) for w in (narrowest, 2 * narrowest, 4 * narrowest)
               if w <= max(narrowest, min(max_width, _MAX_PACKED_WIDTH))]
    width, place, rows = min(options, key=lambda o: rows_bucket(o[2]) * o[0])
    b = rows_bucket(rows)
    tokens = np.full((b, width), pad, np.int32)
    positions = np.zeros((b, width), np.int32)
    segments = np.full((b, width), -1, np.int32)
    starts = np.zeros(len(prompts), np.int32)
    for i, (row, offset) in enumerate(place):
        size = prompts[i].size
        tokens[row, offset:offset + size] = prompts[i]
        positions[row, offset:offset + size] = np.arange(size)
        segments[row, offset:offset + size] = i
        starts[i] = row * width + offset
    return tokens, positions, segments, starts


def _first_fit(prompts, width: int):
    """(width, [(row, offset)] per prompt, rows used): first fit by decreasing length."""
    order = sorted(range(len(prompts)), key=lambda i: -prompts[i].size)
    fill: list[int] = []  # tokens used per row
    place = [(0, 0)] * len(prompts)
    for i in order:
        size = prompts[i].size
        row = next((r for r, used in enumerate(fill) if used + size <= width), None)
        if row is None:
            row = len(fill)
            fill.append(0)
        place[i] = (row, fill[row])
        fill[row] += size
    return width, place, len(fill)


def rows_bucket(n: int) -> int:
    """Packed prefill rows for n: the smallest of 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48...
    (a power of two or three quarters of one) >= n. Two buckets an octave: a prefill pads at
    most a third of its rows, and a sampler whose admissions vary (rollouts of any size,
    trajectories returning from their tools one by one) meets few prefill shapes, each
    compiled once."""
    p = pow2(n)
    return 3 * p // 4 if p >= 4 and 3 * p // 4 >= n else p


def row_params(rows, size: int, vocab_size: int) -> tuple[_programs.RowParams, SamplePlan]:
    """Per-row sampling arrays of the engine's rows (`scheduler._Row`) padded to ``size``,
    and the batch's `SamplePlan`. A row listed more than once (padding entries repeat one)
    is read once and its entries copied: an admission of a few rows into a large cache pads
    admit's entries to the cache's rows."""
    stop_width = _STOP_SLOTS * max(1, -(-max(len(r.stop_ids) for r in rows) // _STOP_SLOTS))
    seeds = np.zeros((size, 2), np.uint32)
    samples = np.zeros(size, np.int32)
    versions = np.zeros((size, 2), np.uint32)
    temperature = np.ones(size, np.float32)
    top_k = np.zeros(size, np.int32)
    top_p = np.ones(size, np.float32)
    greedy = np.ones(size, bool)
    max_new = np.ones(size, np.int32)
    stop_ids = np.full((size, stop_width), -1, np.int32)
    first: dict[int, int] = {}  # each row's first entry
    source = np.array([first.setdefault(id(row), i) for i, row in enumerate(rows)], np.intp)
    for i in first.values():
        row = rows[i]
        request = row.group.request
        opts = request.options
        seeds[i] = seed_words([request.seeds[row.group.index]])[0]
        samples[i] = row.sample
        versions[i] = seed_words([row.version])[0]
        greedy[i] = opts.is_greedy
        temperature[i] = opts.logprob_temperature  # = the sampling temperature when sampled
        if not opts.is_greedy:
            top_k[i] = opts.top_k if 0 < opts.top_k < vocab_size else 0
            top_p[i] = opts.top_p
        max_new[i] = row.max_new
        stop_ids[i, :len(row.stop_ids)] = row.stop_ids
    if len(first) < len(rows):
        for array in (seeds, samples, versions, temperature, top_k, top_p, greedy, max_new,
                      stop_ids):
            array[:len(rows)] = array[source]
    sampled = ~greedy[:len(rows)]
    ks = top_k[:len(rows)][sampled]
    plan = SamplePlan(k_cap=min(max(pow2(int(ks.max())), 8), vocab_size)
                      if ks.size and ks.max() > 0 else 0,
                      full=bool(ks.size and (ks == 0).any()),
                      top_p=bool((top_p[:len(rows)][sampled] < 1.0).any()),
                      sampled=bool(sampled.any()), greedy=bool(greedy[:len(rows)].any()))
    params = _programs.RowParams(seeds, samples, versions, temperature, top_k, top_p, greedy,
                                 max_new, stop_ids)
    return params, plan

