"""Greedy pass@1 on an evaluation split, through the samplers and the reward service.

Evaluation uses the same path as training (``Rollout`` with one greedy completion per prompt,
scored by the reward service), so what is measured is what the samplers serve.
"""

from __future__ import annotations

import logging
import math
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np

from splitrl.config import SamplingConfig
from splitrl.v1 import sampler_pb2
from trainer_service.orchestration.dispatcher import prompt_message, sampling_params
from trainer_service.orchestration.membership import SamplerPool

log = logging.getLogger(__name__)


def accuracy_function(function_names: list[str]) -> str | None:
    """Which reward function measures correctness: the first accuracy-like one."""
    for name in function_names:
        if "accuracy" in name or "exact" in name:
            return name
    return function_names[0] if function_names else None


def evaluate(
    pool: SamplerPool,
    rows: list[dict],
    sampling: SamplingConfig,
    *,
    min_version: int,
    accuracy_fn: str | None,
    metadata: tuple = (),
    timeout_s: float = 600.0,
) -> dict[str, float]:
    """Greedy pass@1 over ``rows``; retries a failed shard on another sampler."""
    if not rows:
        return {}
    params = sampling_params(sampling, greedy=True)
    scores: dict[str, float] = {}
    totals: dict[str, float] = {}

    def run_shard(index: int, shard: list[dict]) -> None:
        for attempt in range(4):
            ready = [h for h in pool.ready() if h.weight_version >= min_version]
            if not ready:
                raise RuntimeError("no ready sampler to evaluate on")
            handle = ready[(index + attempt) % len(ready)]
            request = sampler_pb2.RolloutRequest(
                request_id=f"eval-{index}-{attempt}",
                prompts=[prompt_message(f"eval:{r['prompt_id']}", r) for r in shard],
                group_size=1,
                sampling=params,
                min_version=min_version,
            )
            try:
                for group in handle.stub.Rollout(request, timeout=timeout_s, metadata=metadata):
                    completion = group.completions[0]
                    totals[group.prompt_id] = completion.total_reward
                    key = accuracy_fn if accuracy_fn in completion.rewards else None
                    scores[group.prompt_id] = (
                        completion.rewards[key] if key else completion.total_reward
                    )
                return
            except grpc.RpcError as e:
                pool.report_failure(handle, f"eval: {e.code().name}: {e.details()}")
        raise RuntimeError(f"evaluation shard {index} failed on every sampler")

    n_shards = max(1, len(pool.ready()))
    size = math.ceil(len(rows) / n_shards)
    shards = [rows[i : i + size] for i in range(0, len(rows), size)]
    with ThreadPoolExecutor(max_workers=len(shards)) as executor:
        for future in [executor.submit(run_shard, i, s) for i, s in enumerate(shards)]:
            future.result()
    accuracy = float(np.mean([scores[k] >= 1.0 for k in scores])) if scores else 0.0
    return {
        "eval/accuracy": accuracy,
        "eval/reward": float(np.mean(list(totals.values()))) if totals else 0.0,
        "eval/count": float(len(scores)),
    }
