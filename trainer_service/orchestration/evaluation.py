"""Evaluation through the training path: greedy pass@1, and pass@k from sampled completions.

Evaluation prompts are work items of the queue's ``eval`` lane: the same dispatcher, the same
``Rollout`` call (one greedy completion per prompt, scored by the reward service), the same
handling of failed samplers. What is measured is what the samplers serve. The eval lane's
requests are reproducible (fixed composition), so the same weights give the same accuracy.

Accuracy is the mean score of one reward function, named in the config
(``reward.accuracy_function``; by default the first configured function): for a function that
scores 0 or 1, the fraction answered correctly.

pass@k (``splitrl eval``): n sampled completions per prompt (the run's sampling settings, each
prompt's noise a function of the seed and its uid), of which c are correct (full marks from the
accuracy function); pass@k is the mean over prompts of Chen et al.'s (2021, "Evaluating Large
Language Models Trained on Code", arXiv:2107.03374) unbiased estimator 1 - C(n-c, k) / C(n, k).
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

from splitrl.config import Config
from trainer_service.orchestration.episode_metrics import episode_metrics
from trainer_service.orchestration.rollouts import EVAL, RolloutGroup, WorkItem, item_seed

log = logging.getLogger(__name__)

SAMPLED = "sampled"  # the lane of pass@k's sampled completions


def accuracy_function(cfg: Config) -> str | None:
    """The reward function that measures correctness, as configured (None: no functions)."""
    if cfg.reward.accuracy_function is not None:
        return cfg.reward.accuracy_function
    return cfg.reward.functions[0].name if cfg.reward.functions else None


def eval_items(rows: list[dict]) -> list[WorkItem]:
    """One eval-lane work item per row, in the split's order (greedy: no seed needed)."""
    return [WorkItem(uid=f"eval:{row['prompt_id']}#{i}", row=row, seq=i, lane=EVAL)
            for i, row in enumerate(rows)]


def sampled_items(rows: list[dict], seed: int) -> list[WorkItem]:
    """One work item per row for the sampled lane; its noise is a function of ``seed`` and the
    row's uid alone, so the samples do not depend on batching or on the sampler."""
    items = []
    for i, row in enumerate(rows):
        uid = f"sample:{row['prompt_id']}#{i}"
        items.append(WorkItem(uid=uid, row=row, seq=i, seed=item_seed(seed, uid), lane=SAMPLED))
    return items


def collect_lane(queue, items: list[WorkItem], lane: str, *,
                 stop: threading.Event | None = None,
                 check: Callable[[], None] | None = None) -> list[RolloutGroup]:
    """Hand ``items`` (all of ``lane``) to the rollout queue and wait for their groups, in the
    items' order (``check``: as ``RolloutQueue.take``). Prompts the samplers refuse are
    dropped (logged); the others are returned."""
    queue.add(items)
    n, groups = len(items), []
    while n > 0:
        taken = queue.take(lane, n, stop=stop, check=check)
        if taken.groups:
            groups = taken.groups
            break
        n -= taken.shortfall  # refused prompts: evaluate the others
    for item, reason in queue.drain_events(lane).dropped:
        log.warning("evaluation prompt dropped", extra={"uid": item.uid, "reason": reason})
    return groups


class RunEvaluation:
    """A training run's greedy evaluations (``trainer.eval_before``, ``eval_every``,
    ``eval_after``): pass@1 on the first ``trainer.data.eval_size`` evaluation rows through
    the samplers (the eval lane); each writes what the model answered to
    ``run_dir/evaluations/<tag>-step<step>.jsonl`` for auditing the accuracy."""

    def __init__(self, cfg: Config, data, queue, *, tokenizer, run_dir: Path,
                 accuracy_fn: str | None, stop: threading.Event,
                 check: Callable[[], None] | None = None):
        self.tcfg = cfg.trainer
        self.data, self.queue, self.tokenizer = data, queue, tokenizer
        self.run_dir, self.accuracy_fn, self.stop = run_dir, accuracy_fn, stop
        self.check = check  # while waiting for groups: as RolloutQueue.take

    def rows(self) -> list[dict]:
        """The rows an evaluation asks about (none: the run has no evaluation split)."""
        return self.data.eval_rows(self.tcfg.data.eval_size)

    def evaluate(self, rows: list[dict], tag: str, step: int) -> dict[str, float]:
        """``<tag>/accuracy``, ``<tag>/reward``... of the weights the samplers serve now."""
        items = eval_items(rows)
        groups = collect_lane(self.queue, items, EVAL, stop=self.stop, check=self.check)
        result = eval_metrics(groups, self.accuracy_fn, len(items))
        write_jsonl(self.run_dir / "evaluations" / f"{tag}-step{step:06d}.jsonl",
                    completion_records(groups, self.accuracy_fn, self.tokenizer))
        return {f"{tag}/{k.split('/', 1)[1]}": v for k, v in result.items()}

    def due(self, step: int) -> bool:
        """``trainer.eval_every``: a periodic evaluation after ``step`` (the last step's is
        eval_after's when that is on)."""
        every = self.tcfg.eval_every
        if not every or step % every or self.stop.is_set():
            return False
        return step < self.tcfg.steps or not self.tcfg.eval_after


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with ``c`` correct among ``n`` samples (k <= n)."""
    if not 0 < k <= n:
        raise ValueError(f"pass@k: expected 0 < k <= n = {n}, got k = {k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_at_k_metrics(groups: list[RolloutGroup], accuracy_fn: str | None,
                      ks: list[int]) -> dict[str, float]:
    """pass@k for each k (mean over the prompts), the mean accuracy of the samples and the
    number of samples per prompt."""
    if not groups:
        return {}
    n = min(len(g.completions) for g in groups)
    out: dict[str, float] = {"samples_per_prompt": float(n), "prompts": float(len(groups))}
    scores = [[_score(c, accuracy_fn) for c in g.completions[:n]] for g in groups]
    out["sampled_accuracy"] = float(np.mean(scores))
    for k in ks:
        out[f"pass@{k}"] = float(np.mean([pass_at_k(n, sum(s >= 1.0 for s in row), k)
                                          for row in scores]))
    return out


def _score(completion, accuracy_fn: str | None) -> float:
    return completion.reward if accuracy_fn is None else completion.rewards.get(accuracy_fn, 0.0)


def eval_metrics(groups: list[RolloutGroup], accuracy_fn: str | None,
                 asked: int) -> dict[str, float]:
    """eval/accuracy, eval/reward, eval/count (answered) and eval/dropped (refused prompts)."""
    completions = [g.completions[0] for g in groups]
    scores = [_score(c, accuracy_fn) for c in completions]
    return {
        "eval/accuracy": float(np.mean(scores)) if scores else 0.0,
        "eval/reward": float(np.mean([c.reward for c in completions])) if completions else 0.0,
        "eval/count": float(len(groups)),
        "eval/dropped": float(asked - len(groups)),
        # Multi-turn episodes: eval/tool_calls (per trajectory), eval/turns...
        **episode_metrics(completions, prefix="eval/"),
    }


def completion_records(groups: list[RolloutGroup], accuracy_fn: str | None,
                       tokenizer) -> list[dict]:
    """What the model answered, one record per prompt, for auditing an accuracy: its id, the
    prompt as the model saw it (its tokens decoded with the chat template and special tokens),
    the reference, and per completion its text, finish reason, score (of the accuracy
    function), every reward function's score and its reasons (math_accuracy's names the answer
    it extracted: "answer '18'", "wrong answer '17'", "no answer found")."""
    records = []
    for group in groups:
        row = group.item.row
        records.append({
            "prompt_id": row["prompt_id"],
            "prompt": tokenizer.decode(group.prompt_token_ids, skip_special_tokens=False),
            "reference": row.get("reference"),
            "completions": [{"text": c.text, "finish_reason": c.finish_reason,
                             "tokens": len(c.token_ids), "score": _score(c, accuracy_fn),
                             "reward": c.reward, "rewards": c.rewards, "reasons": c.reasons}
                            for c in group.completions],
        })
    return records


def write_jsonl(path: str | Path, records: list[dict]) -> Path:
    """``records`` as JSON lines at ``path`` (its folder made), replacing the file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return path


def accuracy_line(summary: dict) -> str | None:
    """"greedy accuracy on the evaluation prompts: 0.300 -> 0.850 (step 150)" from a run's
    summary (a resumed run names the step it started from); None without evaluations. A run
    of tool-using episodes gets a second line, "tool calls per trajectory: 0.02 -> 1.00"."""
    line = _accuracy_line(summary)
    before, after = summary.get("eval_before/tool_calls"), summary.get("eval_after/tool_calls")
    if line is None or (before is None and after is None):
        return line
    calls = " -> ".join(f"{v:.2f}" for v in (before, after) if v is not None)
    return f"{line}\ntool calls per trajectory: {calls}"


def _accuracy_line(summary: dict) -> str | None:
    before, after = summary.get("eval_before/accuracy"), summary.get("eval_after/accuracy")
    text = "greedy accuracy on the evaluation prompts"
    step = f" (step {int(summary['step'])})" if "step" in summary else ""
    if before is None:
        return None if after is None else f"{text}: {after:.3f}{step}"
    start = int(summary.get("eval_before/step", 0))
    text += f": {before:.3f}" + (f" (resumed at step {start})" if start else "")
    return text + (f" -> {after:.3f}{step}" if after is not None else " (not evaluated after)")
