"""math_accuracy on every GSM8K test row and every MATH-500 row (from ../shared/data)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reward_service import resolve

DATA = (Path(__file__).resolve().parents[2] / "../shared/data").resolve()


def rows(relative: str) -> list[dict]:
    path = DATA / relative
    if not path.is_file():
        pytest.skip(f"{path} not found (the shared data lives in ../shared/data beside the repo)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_every_gsm8k_test_row_scores_one_with_its_gold_answer_and_zero_with_a_wrong_one():
    math_accuracy = resolve("math_accuracy")
    data = rows("gsm8k/test.jsonl")
    assert len(data) == 1319
    failures = []
    for i, row in enumerate(data):
        solution = row["answer"]
        body, final = solution.rsplit("####", 1)
        gold = final.strip().replace(",", "")
        wrong = str(int(gold) + 1)
        completions = [
            solution,  # "... #### N", exactly as written (93 rows write N with commas)
            f"Let me think. {body.strip()} The answer is \\boxed{{{gold}}}.",
            f"{body}#### {wrong}",
            f"The answer is \\boxed{{{wrong}}}.",
        ]
        scores = [float(s) for s in math_accuracy([""] * 4, completions, [gold] * 4)]
        if scores != [1.0, 1.0, 0.0, 0.0]:
            failures.append((i, gold, scores))
    assert not failures, failures[:10]


def test_at_least_495_math500_rows_score_one_with_the_boxed_answer():
    math_accuracy = resolve("math_accuracy")
    data = rows("math500/test.jsonl")
    assert len(data) == 500
    answers = [row["answer"] for row in data]
    completions = [f"So the final answer is $\\boxed{{{a}}}$." for a in answers]
    scores = [float(s) for s in math_accuracy([""] * 500, completions, answers)]
    failures = [(row["unique_id"], row["answer"]) for row, s in zip(data, scores, strict=True)
                if s != 1.0]
    print(f"MATH-500: {500 - len(failures)}/500 score 1.0; failures: {failures}")
    assert len(failures) <= 5, failures
