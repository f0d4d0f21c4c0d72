"""Prometheus collectors of the sampler service (served by ``splitrl.metrics``).

Defined once per process at import (the default registry refuses duplicates), so several
servicers in one test process share them.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

TOKENS_GENERATED = Counter(
    "splitrl_sampler_tokens_generated_total", "Completion tokens generated.")
SEQUENCES_GENERATED = Counter(
    "splitrl_sampler_sequences_generated_total", "Completions generated.")
TOKENS_PER_SECOND = Gauge(
    "splitrl_sampler_tokens_per_second", "Completion tokens per second of the last request.")
BATCH_OCCUPANCY = Gauge(
    "splitrl_sampler_batch_occupancy",
    "Rows that drew a token / decode rows computed, last segment (1.0 = no idle slots).")
QUEUED_SEQUENCES = Gauge(
    "splitrl_sampler_queued_sequences",
    "Completions waiting for a decode slot (requests beyond the batch or KV-cache budget).")
ACTIVE_SEQUENCES = Gauge(
    "splitrl_sampler_active_sequences", "Completions in the decode batch.")
KV_CACHE_BYTES = Gauge(
    "splitrl_sampler_kv_cache_bytes", "Bytes of KV cache allocated now.")
KV_PAGES_IN_USE = Gauge(
    "splitrl_sampler_kv_pages_in_use",
    "Pages of the KV page pools held by sequences in flight (0 with the slot cache).")
KV_CACHE_BUDGET_BYTES = Gauge(
    "splitrl_sampler_kv_cache_budget_bytes", "The KV-cache budget (sampler.kv_cache_bytes).")
GENERATE_SECONDS = Histogram(
    "splitrl_sampler_generate_seconds", "Seconds from a prompt's admission to its last token.",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
QUEUE_SECONDS = Histogram(
    "splitrl_sampler_queue_seconds", "Seconds a prompt waited for decode slots.",
    buckets=(0.001, 0.01, 0.05, 0.1, 0.5, 1, 5, 30))
SCORE_SECONDS = Histogram(
    "splitrl_sampler_score_seconds", "Seconds per reward-service Score call.",
    buckets=(0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120))
WEIGHT_VERSION = Gauge("splitrl_sampler_weight_version", "Weight version now serving.")
PUSH_SECONDS = Histogram(
    "splitrl_sampler_push_seconds", "Seconds from push header to swap.",
    buckets=(0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 300))
PUSH_SWAP_SECONDS = Histogram(
    "splitrl_sampler_push_swap_seconds", "Seconds the swap held the weights lock.",
    buckets=(1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1))
PUSH_BYTES = Counter("splitrl_sampler_push_bytes_total", "Weight bytes received in applied pushes.")
PUSHES = Counter("splitrl_sampler_pushes_total", "Weight pushes by outcome.", ["code"])
REQUESTS = Counter("splitrl_sampler_requests_total", "RPCs by method and status.",
                   ["method", "code"])
PUSH_RELAYED_BYTES = Counter(
    "splitrl_sampler_push_relayed_bytes_total",
    "Weight push bytes forwarded to the next sampler of a relay chain.")
TOOL_CALLS = Counter(
    "splitrl_sampler_tool_calls_total",
    "Environment tool calls by tool and status (ok, malformed, unknown, error, timeout).",
    ["tool", "status"])
TOOL_SECONDS = Histogram(
    "splitrl_sampler_tool_seconds", "Seconds one environment tool call took.",
    buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
OBSERVATION_TOKENS = Counter(
    "splitrl_sampler_observation_tokens_total",
    "Observation tokens (rendered tool results) appended to trajectories.")
EPISODE_TURNS = Histogram(
    "splitrl_sampler_episode_turns", "Model turns per finished episode.",
    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32))
