"""Failing reward functions stop a real run loudly; a dataset with one prompt too long for the
samplers trains to completion under each length policy (or, with `error`, refuses to start)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from splitrl_app.launch import up
from tests.e2e.harness import run_config, trained_records

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
SHORT = ("trainer.eval_before=false", "trainer.eval_after=false", "trainer.prompts_per_step=4",
         "algorithm.group_size=8", "reward.workers=1", "services.num_samplers=1")


@pytest.fixture
def user_module_path(monkeypatch):
    """The services import `e2e_rewards` as a user's module from PYTHONPATH."""
    monkeypatch.setenv("PYTHONPATH", str(HERE))


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_raising_wrong_length_and_non_number_functions_stop_the_run(arith_model, tmp_path,
                                                                    capsys, user_module_path):
    run_dir = tmp_path / "run"
    functions = ("[{name: exact_answer}, {name: 'e2e_rewards:think_format'}, "
                 "{name: 'e2e_rewards:too_few'}, {name: 'e2e_rewards:not_a_number'}]")
    cfg = run_config(arith_model, run_dir, "trainer.steps=3", f"reward.functions={functions}",
                     *SHORT)
    code = up.main(cfg)
    console = capsys.readouterr()
    assert code != 0
    text = console.out + console.err
    for name, message in (
        ("e2e_rewards:think_format", "RuntimeError: think_format cannot parse the completion"),
        ("e2e_rewards:too_few", "returned 7 scores for 8 completions"),
        ("e2e_rewards:not_a_number", "score is not a number: str"),
    ):
        assert f"reward function '{name}' failed on 32 (32 errors) of 32 completions" in text, (
            name, text[-3000:])
        assert message in text, (name, text[-3000:])
    assert "stopping the run" in text and "first batch" in text
    assert "e2e_rewards:too_few (trl style, weight 1)" in console.out  # the detected style
    last = metrics(run_dir)[-1]
    for name in ("think_format", "too_few", "not_a_number"):
        assert last[f"reward/e2e_rewards:{name}/errors"] == 32.0
    assert last["reward/exact_answer/errors"] == 0.0
    trained = run_dir / "trained_prompts.jsonl"
    assert not trained.exists() or not trained.read_text().strip()  # nothing was trained on


LONG = "1+" * 20 + "1="  # 42 tokens in the character vocabulary; the samplers take 30


def write_data(directory: Path) -> None:
    directory.mkdir()
    rows = [{"question": f"{a}+{b}=", "answer": str(a + b), "a": a, "b": b}
            for a in range(4) for b in range(4)]
    rows.insert(5, {"question": LONG, "answer": "21", "a": 20, "b": 1})
    (directory / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("policy", ["drop", "truncate_left", "error"])
def test_one_over_long_row_under_each_length_policy(arith_model, tmp_path, capsys, policy,
                                                    user_module_path):
    run_dir, data = tmp_path / "run", tmp_path / "data"
    write_data(data)
    steps = 5  # 20 prompts: more than the 16 short rows, so the long row's turn comes
    cfg = run_config(arith_model, run_dir, f"trainer.steps={steps}", "trainer.data.task=files",
                     f"trainer.data.path={data / 'train.jsonl'}", "trainer.data.eval_split=null",
                     f"trainer.data.long_prompt_policy={policy}",
                     "reward.functions=[{name: 'e2e_rewards:sum_of_columns'}]",
                     "reward.accuracy_function=e2e_rewards:sum_of_columns", *SHORT)
    code = up.main(cfg)
    console = capsys.readouterr()
    if policy == "error":
        assert code == 2
        assert "1 of 17 train prompts are longer than 30 tokens" in console.err
        assert "train-5 (42 tokens)" in console.err
        assert not (run_dir / "logs").exists()  # refused before any service started
        return
    assert code == 0, console.err[-3000:]
    assert "1 of 17 train prompts are longer than 30 tokens" in console.out
    uids = [u.split("#")[0] for r in trained_records(run_dir) for u in r["uids"]]
    assert len(uids) == steps * 4
    records = metrics(run_dir)
    assert all(r["counts/redispatched"] == 0.0 for r in records)  # no sampler refused a prompt
    assert records[-1]["reward/e2e_rewards:sum_of_columns/errors"] == 0.0  # typed a, b arrived
    sampler_logs = "".join(p.read_text() for p in (run_dir / "logs").glob("sampler-*.log"))
    assert "max_sequence_length" not in sampler_logs
    if policy == "drop":
        assert "train-train-5" not in uids and records[-1]["data/long_prompts_dropped"] == 1.0
    else:
        assert "train-train-5" in uids and records[-1]["data/long_prompts_truncated"] == 1.0
