"""Reward throughput: the isolated worker pool vs scoring serially in one process, same run.

    HF_HUB_OFFLINE=1 JAX_PLATFORMS=cpu python bench/reward_throughput.py [--config FILE]
        [--workers N] [--quick] [a.b=c ...]

Two batches of ``math_accuracy`` work built from ``../shared/data``:

- GSM8K-style: every test row's gold solution as the completion (``... #### N``, half of them
  with a wrong final number), reference ``N``;
- MATH-style: every MATH-500 row's full reference solution as the completion (the last
  ``\\boxed{}`` is the answer), reference the ``answer`` field.

Each batch is scored (1) serially in this process by calling the function one item at a time,
the reference rate, (2) by ``RewardScorer`` (``reward.workers`` processes, time limits, pipes)
as the service does, minus gRPC, one call per item, and (3) the same with the items in groups of
``GROUP`` sharing a ``group_id``, one call per group, which is how samplers send a prompt's
completions. All start with a cold reference cache. The pool is warmed up on other items first.
Prints items/s of each and the ratios to the serial rate.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GROUP = 16
DATA = (REPO / "../shared/data").resolve()


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=None, help="YAML config (reward section is used)")
    ap.add_argument("--workers", type=int, default=None, help="override reward.workers")
    ap.add_argument("--quick", action="store_true", help="200 GSM8K + 100 MATH items")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides")
    return ap.parse_args()


def load(relative: str) -> list[dict]:
    path = DATA / relative
    if not path.is_file():
        raise SystemExit(f"{path} not found: the benchmark needs ../shared/data beside the repo")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def gsm8k_batch(limit: int | None):
    from reward_service import Item

    items = []
    for i, row in enumerate(load("gsm8k/test.jsonl")[:limit]):
        body, final = row["answer"].rsplit("####", 1)
        gold = final.strip().replace(",", "")
        completion = row["answer"] if i % 2 == 0 else f"{body}#### {int(gold) + 1}"
        items.append(Item(prompt=row["question"], completion=completion, reference=gold))
    return items


def math_batch(limit: int | None):
    from reward_service import Item

    return [Item(prompt=row["problem"], completion=row["solution"], reference=row["answer"])
            for row in load("math500/test.jsonl")[:limit]]


def serial_rate(items) -> tuple[float, float]:
    """items/s and mean score, one item at a time in this process (no isolation)."""
    from reward_service import resolve
    from reward_service.math_accuracy import parse_reference

    parse_reference.cache_clear()
    fn = resolve("math_accuracy")
    start = time.perf_counter()
    total = 0.0
    for item in items:
        total += float(fn([item.prompt], [item.completion], [item.reference],
                          completion_tokens=[0], truncated=[False])[0])
    return len(items) / (time.perf_counter() - start), total / len(items)


def grouped(items):
    """The items in consecutive groups of GROUP (one call per group and function)."""
    import dataclasses

    return [dataclasses.replace(item, group_id=f"g{i // GROUP}") for i, item in enumerate(items)]


def pool_rate(cfg, items) -> tuple[float, float, int]:
    """items/s, mean score and abnormal outcomes of a fresh pool (cold reference caches in its
    workers), warmed up on other items first."""
    from reward_service import Item, RewardScorer

    scorer = RewardScorer(cfg)
    try:
        warm = [Item(completion=f"\\boxed{{{i}}}", reference=f"{i}.0") for i in range(64)]
        scorer.score(warm, ["math_accuracy"])
        start = time.perf_counter()
        results = scorer.score(items, ["math_accuracy"])
        seconds = time.perf_counter() - start
    finally:
        scorer.close()
    abnormal = sum(1 for r in results if r.statuses["math_accuracy"] != "ok")
    return len(items) / seconds, sum(r.total for r in results) / len(items), abnormal


def main() -> None:
    args = parse_args()
    sys.path.insert(0, str(REPO))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import logging

    from reward_service import RewardScorer
    from splitrl.config import RewardFunctionConfig, load_config

    logging.basicConfig(level=logging.WARNING)
    cfg = load_config(args.config, args.overrides).reward
    if args.workers is not None:
        cfg.workers = args.workers
    # Only math_accuracy is measured (with its configured options and time limit, if any).
    configured = [f for f in cfg.functions if f.name == "math_accuracy"]
    cfg.functions = configured or [RewardFunctionConfig(name="math_accuracy")]
    gsm_limit, math_limit = (200, 100) if args.quick else (None, None)
    batches = {"gsm8k": gsm8k_batch(gsm_limit), "math": math_batch(math_limit)}

    start = time.perf_counter()
    RewardScorer(cfg).close()
    print(f"pool: {cfg.workers} workers start in {time.perf_counter() - start:.2f} s "
          f"(cores: {os.cpu_count()}, load average: {os.getloadavg()[0]:.1f}, "
          f"timeout_s: {cfg.timeout_s})")
    rows = []
    for name, items in batches.items():
        s_rate, s_mean = serial_rate(items)
        p_rate, p_mean, abnormal = pool_rate(cfg, items)
        g_rate, g_mean, g_abnormal = pool_rate(cfg, grouped(items))
        assert abs(g_mean - p_mean) < 1e-9, (g_mean, p_mean)
        rows.append((name, len(items), s_rate, p_rate, g_rate, s_mean, p_mean,
                     abnormal + g_abnormal))

    print(f"{'batch':<7} {'items':>6} {'serial items/s':>15} {'pool items/s':>13} "
          f"{'ratio':>6} {f'pool {GROUP}/call':>14} {'ratio':>6} {'mean (serial/pool)':>19} "
          f"{'timeouts+errors':>16}")
    for name, n, s_rate, p_rate, g_rate, s_mean, p_mean, abnormal in rows:
        print(f"{name:<7} {n:>6} {s_rate:>15.1f} {p_rate:>13.1f} {p_rate / s_rate:>5.2f}x "
              f"{g_rate:>14.1f} {g_rate / s_rate:>5.2f}x {s_mean:>9.3f}/{p_mean:<9.3f} "
              f"{abnormal:>16}")


if __name__ == "__main__":
    main()
