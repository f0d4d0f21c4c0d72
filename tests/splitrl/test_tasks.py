"""Built-in tasks: arithmetic table, GSM8K/MATH-500 references, generic files, the registry."""

from __future__ import annotations

import json

import pytest

from splitrl.tasks import get_task, list_tasks, parse_gsm8k_answer


def test_registry_lists_tasks_and_names_unknown_ones():
    assert {"arithmetic", "gsm8k", "math500", "files"} <= set(list_tasks())
    with pytest.raises(ValueError, match="unknown task 'gsm9k'"):
        get_task("gsm9k")
    with pytest.raises(ValueError, match="no option 'max_operands'"):
        get_task("arithmetic", max_operands=3)


def test_arithmetic_default_is_the_25_prompt_single_digit_table():
    task = get_task("arithmetic")
    rows = task.rows("train")
    assert len(rows) == 25
    assert len({r["prompt_id"] for r in rows}) == 25
    by_id = {r["prompt_id"]: r for r in rows}
    assert by_id["arith-3+4"]["prompt"] == "3+4=" and by_id["arith-3+4"]["reference"] == "7"
    assert all(len(r["reference"]) == 1 for r in rows)
    assert task.rows("test") == rows
    assert task.reward_functions[0]["name"] == "exact_answer"
    assert task.sampling["max_new_tokens"] == 2


def test_arithmetic_train_fraction_is_seeded_and_eval_is_the_full_table():
    a = get_task("arithmetic", max_operand=9, train_fraction=0.5, seed=1)
    b = get_task("arithmetic", max_operand=9, train_fraction=0.5, seed=1)
    c = get_task("arithmetic", max_operand=9, train_fraction=0.5, seed=2)
    assert a.rows("train") == b.rows("train") != c.rows("train")
    assert len(a.rows("train")) == 50 and len(a.rows("test")) == 100
    assert get_task("arithmetic", max_operand=9, fixed_width=True).answer(1, 2) == "03"


def test_arithmetic_corpus_covers_every_digit():
    text = "".join(get_task("arithmetic").corpus())
    assert set("0123456789+=") == set(text)


def test_gsm8k_references_are_integers_without_commas(shared_data):
    rows = get_task("gsm8k", path=shared_data / "gsm8k").rows("test")
    assert len(rows) == 1319
    refs = [rows[i]["reference"] for i in range(len(rows))]
    assert all(r.lstrip("-").isdigit() for r in refs), [r for r in refs if not r.isdigit()]
    raw = [json.loads(line)["answer"] for line in
           (shared_data / "gsm8k" / "test.jsonl").read_text().splitlines()]
    with_commas = [i for i, a in enumerate(raw) if "," in a.rsplit("####", 1)[1]]
    assert with_commas, "expected some answers like 1,080 in the test split"
    assert refs[with_commas[0]] == raw[with_commas[0]].rsplit("####", 1)[1].strip().replace(
        ",", "")
    first = rows[0]
    assert first["prompt_id"] == "gsm8k-test-0" and first["prompt"].startswith("Janet")
    assert first["reference"] == "18" and first["messages"] is None


def test_gsm8k_instruction_is_appended(shared_data):
    row = get_task("gsm8k", path=shared_data / "gsm8k", instruction="boxed").rows("test")[0]
    assert row["prompt"].endswith("\\boxed{}.")
    row = get_task("gsm8k", path=shared_data / "gsm8k", instruction="Answer:").rows("test")[0]
    assert row["prompt"].endswith("\nAnswer:")


def test_parse_gsm8k_answer():
    assert parse_gsm8k_answer("so 1,000 + 80\n#### 1,080") == "1080"
    with pytest.raises(ValueError, match="####"):
        parse_gsm8k_answer("no final answer")


def test_math500_reference_is_the_answer_field(shared_data):
    task = get_task("math500", path=shared_data / "math500")
    rows = task.rows("test")
    assert len(rows) == 500
    raw = json.loads((shared_data / "math500" / "test.jsonl").read_text().splitlines()[0])
    assert rows[0]["reference"] == raw["answer"].strip()
    assert rows[0]["prompt"] == raw["problem"]
    # The other columns reach the reward functions with their types.
    assert rows[0]["columns"] == {k: v for k, v in raw.items() if k != "problem"}
    assert isinstance(rows[0]["columns"]["level"], int)
    with pytest.raises(ValueError, match="no split 'train'"):
        task.rows("train")


def test_files_task_maps_fields_and_accepts_chat_messages(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in [
        {"q": "1+1?", "a": "2", "id": "x1"},
        {"q": [{"role": "user", "content": "2+2?"}], "a": 4, "id": "x2"},
    ]) + "\n")
    task = get_task("files", path=str(tmp_path), prompt_field="q", answer_field="a",
                    id_field="id", id_prefix="toy")
    rows = task.rows("train")
    assert rows[0]["prompt"] == "1+1?" and rows[0]["prompt_id"] == "toy-x1"
    assert rows[1]["messages"] == [{"role": "user", "content": "2+2?"}]
    assert rows[1]["reference"] == "4"
    with pytest.raises(ValueError, match="prompt_field='question' is not a column"):
        get_task("files", path=str(data)).rows("train")
    assert get_task("files", path=str(data)).splits == ("train",)


def test_files_task_passes_every_other_column_with_its_type(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in [
        {"question": "1+1?", "answer": "2", "difficulty": 1, "tags": ["easy"]},
        {"question": "9*9?", "answer": "81", "difficulty": 3, "tags": ["mul", "hard"]},
    ]) + "\n")
    rows = get_task("files", path=str(data)).rows("train")
    assert rows[1]["columns"] == {"answer": "81", "difficulty": 3, "tags": ["mul", "hard"]}
    reserved = tmp_path / "reserved.jsonl"
    reserved.write_text(json.dumps({"question": "q", "answer": "a", "completions": 1}) + "\n")
    with pytest.raises(ValueError, match="'completions'.*reserved keyword"):
        get_task("files", path=str(reserved)).rows("train")
    # An answer column called `reference` is the reference: it is not passed twice.
    named = tmp_path / "named.jsonl"
    named.write_text(json.dumps({"question": "q", "reference": "7", "id": 3}) + "\n")
    row = get_task("files", path=str(named), answer_field="reference").rows("train")[0]
    assert row["reference"] == "7" and row["columns"] == {"id": 3}


def _datasets_cache_with_hub_gsm8k(cache, shared_data):
    """A `datasets` cache holding `openai/gsm8k` (config `main`, test split) as loading it from
    the hub leaves it: `datasets`' own Arrow files and dataset_info.json under
    `openai___gsm8k/main/0.0.0/<hash>/`. Written by `datasets`' json builder from the shipped
    copy (the hub itself is unreachable here) and moved to the hub dataset's place."""
    import shutil

    from datasets.packaged_modules.json.json import Json

    builder = Json(cache_dir=str(cache / "build"), dataset_name="gsm8k", config_name="main",
                   data_files={"test": str(shared_data / "gsm8k" / "test.jsonl")})
    builder.download_and_prepare()
    hub_place = cache / "openai___gsm8k" / "main" / "0.0.0" / "cached"
    shutil.copytree(builder.cache_dir, hub_place, ignore=shutil.ignore_patterns("*.lock"))
    shutil.rmtree(cache / "build")


def test_gsm8k_without_a_path_is_the_hub_dataset_from_the_datasets_cache(
        shared_data, tmp_path, monkeypatch):
    import datasets

    _datasets_cache_with_hub_gsm8k(tmp_path, shared_data)
    monkeypatch.delenv("SPLITRL_DATA_DIR")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path))
    assert datasets.config.HF_DATASETS_OFFLINE  # no hub: what it reads is the cache
    task = get_task("gsm8k")
    assert (task.path, task.subset) == ("openai/gsm8k", "main")
    rows = task.rows("test")
    assert len(rows) == 1319
    assert rows[0]["prompt_id"] == "gsm8k-test-0" and rows[0]["prompt"].startswith("Janet")
    assert rows[0]["reference"] == "18"


@pytest.mark.parametrize("name,hub", [("gsm8k", "openai/gsm8k"),
                                      ("math500", "HuggingFaceH4/MATH-500")])
def test_named_task_without_hub_or_copy_names_both_ways_out(name, hub, tmp_path, monkeypatch):
    import datasets

    monkeypatch.delenv("SPLITRL_DATA_DIR", raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path))  # empty
    with pytest.raises(FileNotFoundError) as error:
        get_task(name).rows("test")
    message = str(error.value)
    for way_out in (hub, "trainer.data.path", "SPLITRL_DATA_DIR", "datasets` has it in its cache"):
        assert way_out in message, message


def test_data_dir_variable_points_named_tasks_at_local_copies(shared_data, monkeypatch):
    monkeypatch.setenv("SPLITRL_DATA_DIR", str(shared_data))
    assert get_task("math500").path == str(shared_data / "math500")
    assert len(get_task("math500").rows("test")) == 500
