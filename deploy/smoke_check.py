"""Checks what a compose run left behind (used by ``deploy/smoke.sh``; standard library only, so
it runs with the host's ``python3`` and no project venv).

    python3 deploy/smoke_check.py --trained trained_prompts.jsonl --summary summary.json \\
        --log trainer.log --steps 60 --prompts-per-step 16 \\
        [--samplers samplers.tsv --expect-samplers 3] [--expect-resume] [--expect-accuracy]

What it checks, from the trainer's own records:

- every step 1..steps was trained once, each on ``prompts-per-step`` prompts;
- work per sampler (the ``samplers`` field), mapped to container names by ``--samplers``
  (``NAME<TAB>ADDRESS-HOST`` lines); every expected sampler got work;
- the run's greedy accuracy before and after training, from the fields the trainer writes to
  ``summary.json`` (``eval_before/accuracy``, ``eval_after/accuracy``; not from its console
  text, whose wording may change), and that the run ended ``done`` at ``--steps``;
- with ``--expect-resume``, from the trainer's JSON log lines, that it stopped at a step and
  resumed from exactly that step.

Exactly-once accounting (no prompt lost or trained twice, across restarts) is not repeated
here: ``smoke.sh`` runs the project's own ``splitrl audit`` on the run directory in the volume.

Exit status 0 when every check passes; the summary is printed either way.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

STOPPED_MSG = "stopped; resume continues from this step"
RESUMED_MSG = "resumed from checkpoint"


@dataclass
class Audit:
    """What ``trained_prompts.jsonl`` says about a run."""

    steps: list[int]
    uids: int
    per_sampler: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def audit_trained(records: list[dict], steps: int, prompts_per_step: int) -> Audit:
    """Steps, batch sizes and work per sampler of a finished run's ``trained_prompts.jsonl``."""
    step_list = [int(r["step"]) for r in records]
    out = Audit(
        steps=step_list,
        uids=sum(len(r["uids"]) for r in records),
        per_sampler=Counter(s for r in records for s in r["samplers"]),
    )
    if sorted(step_list) != list(range(1, steps + 1)):
        repeated = sorted(s for s, n in Counter(step_list).items() if n > 1)
        missing = sorted(set(range(1, steps + 1)) - set(step_list))
        out.problems.append(f"steps: expected 1..{steps} once each, missing {missing[:10]}, "
                            f"repeated {repeated[:10]}")
    for r in records:
        if len(r["uids"]) != prompts_per_step:
            out.problems.append(f"step {r['step']}: {len(r['uids'])} prompts, expected "
                                f"{prompts_per_step}")
        if len(r["samplers"]) != len(r["uids"]):
            out.problems.append(f"step {r['step']}: {len(r['samplers'])} sampler ids for "
                                f"{len(r['uids'])} prompts")
    return out


def restarted_total(counts: list[float]) -> float:
    """The total of a counter that starts again from 0 whenever its process restarts."""
    total = 0.0
    for prev, cur in zip(counts, counts[1:], strict=False):
        if cur < prev:
            total += prev
    return total + (counts[-1] if counts else 0.0)


def log_records(text: str) -> list[dict]:
    """The JSON log lines of a container log (other lines, e.g. warnings, are skipped)."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def accuracy(summary: dict) -> tuple[float, float, int] | None:
    """(accuracy before, after, the step "before" was measured at) from the trainer's
    ``summary.json``, or None when the run has not both. A trainer that resumed measures
    "before" at the step it resumed from (``eval_before/step``)."""
    before, after = summary.get("eval_before/accuracy"), summary.get("eval_after/accuracy")
    if before is None or after is None:
        return None
    return float(before), float(after), int(summary.get("eval_before/step", 0))


def resumes(text: str) -> list[tuple[int, int]]:
    """(step the trainer stopped at, step it resumed from) for every stop followed by a start."""
    pairs = []
    stopped = None
    for rec in log_records(text):
        if rec.get("msg") == STOPPED_MSG:
            stopped = int(rec["step"])
        elif rec.get("msg") == RESUMED_MSG:
            pairs.append((-1 if stopped is None else stopped, int(rec["step"])))
            stopped = None
    return pairs


def sampler_names(path: Path | None) -> dict[str, str]:
    """Address host -> container name, from ``NAME<TAB>HOST`` lines."""
    if path is None:
        return {}
    names = {}
    for line in path.read_text().splitlines():
        if line.strip():
            name, host = line.split("\t")
            names[host.strip()] = name.strip().lstrip("/")
    return names


def check(args: argparse.Namespace) -> int:
    problems: list[str] = []
    result = audit_trained(read_jsonl(args.trained), args.steps, args.prompts_per_step)
    problems += result.problems
    names = sampler_names(args.samplers)
    print(f"steps trained: {len(result.steps)} (expected {args.steps}); prompts trained: "
          f"{result.uids}")
    print("work per sampler (prompts):")
    for sampler_id, n in sorted(result.per_sampler.items()):
        host = sampler_id.rsplit(":", 1)[0]
        print(f"  {names.get(host, '?'):<28} {sampler_id:<24} {n}")
    if args.expect_samplers:
        if len(result.per_sampler) != args.expect_samplers:
            problems.append(f"{len(result.per_sampler)} samplers got work, expected "
                            f"{args.expect_samplers}")
        idle = sorted(set(names.values()) - {names.get(s.rsplit(':', 1)[0])
                                             for s in result.per_sampler})
        if idle:
            problems.append(f"samplers that got no work: {idle}")
    if args.metrics:
        counts = [m["counts/redispatched"] for m in read_jsonl(args.metrics)
                  if "counts/redispatched" in m]
        print(f"prompts re-dispatched after a sampler failed: {int(restarted_total(counts))}")
    summary = json.loads(args.summary.read_text())
    if summary.get("state") != "done" or summary.get("step") != args.steps:
        problems.append(f"summary.json: state {summary.get('state')!r} at step "
                        f"{summary.get('step')}, expected 'done' at step {args.steps}")
    acc = accuracy(summary)
    if acc is None:
        problems.append("summary.json has no eval_before/accuracy and eval_after/accuracy")
    else:
        at = f" (measured at step {acc[2]})" if acc[2] else ""
        print(f"greedy accuracy: {acc[0]:.3f}{at} -> {acc[1]:.3f}")
        if args.expect_accuracy and not acc[1] > acc[0]:
            problems.append(f"accuracy did not improve: {acc[0]:.3f} -> {acc[1]:.3f}")
    log = args.log.read_text() if args.log else ""
    if args.expect_resume:
        pairs = resumes(log)
        print(f"trainer stops and resumes (stopped at step, resumed from step): {pairs}")
        if not pairs:
            problems.append("the trainer never resumed from a checkpoint")
        for stopped, resumed in pairs:
            if stopped != resumed or resumed <= 0:
                problems.append(f"stopped at step {stopped} but resumed from step {resumed}")
    for p in problems:
        print(f"FAILED: {p}")
    print("all checks passed" if not problems else f"{len(problems)} checks failed")
    return 0 if not problems else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trained", type=Path, required=True, help="trained_prompts.jsonl")
    p.add_argument("--summary", type=Path, required=True, help="the run's summary.json")
    p.add_argument("--log", type=Path, help="the trainer container's log (stops and resumes)")
    p.add_argument("--metrics", type=Path, help="metrics.jsonl (re-dispatch count)")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--prompts-per-step", type=int, required=True)
    p.add_argument("--samplers", type=Path, help="NAME<TAB>HOST lines, one per sampler")
    p.add_argument("--expect-samplers", type=int, default=0)
    p.add_argument("--expect-resume", action="store_true")
    p.add_argument("--expect-accuracy", action="store_true",
                   help="fail unless the accuracy after training beats the one before")
    return check(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
