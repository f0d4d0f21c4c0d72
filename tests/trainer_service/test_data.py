"""PromptStream: seeded epoch shuffles, exact resume from a saved cursor, epochs, formatting."""

from __future__ import annotations

import json

import pytest

from splitrl.config import DataConfig
from splitrl.tasks import get_task
from trainer_service.orchestration.data import PromptStream


def arithmetic_stream(**kw) -> PromptStream:
    task = get_task("arithmetic")
    return PromptStream(task.rows("train"), eval_rows=task.rows("test"), **kw)


def ids(batch):
    return [(r["prompt_id"], r["epoch"]) for r in batch]


def test_seeded_shuffle_is_deterministic_and_seed_dependent():
    a, b, c = (arithmetic_stream(seed=s) for s in (7, 7, 8))
    first = ids(a.next_batch(40))
    assert first == ids(b.next_batch(40))
    assert first != ids(c.next_batch(40))
    unshuffled = arithmetic_stream(shuffle=False).next_batch(3)
    assert [r["prompt_id"] for r in unshuffled] == ["arith-0+0", "arith-0+1", "arith-0+2"]


def test_each_epoch_serves_every_prompt_exactly_once_in_a_new_order():
    stream = arithmetic_stream(seed=3)
    served = [r for _ in range(10) for r in stream.next_batch(16)]  # 160 rows = 6.4 epochs
    for epoch in range(6):
        in_epoch = [r["prompt_id"] for r in served if r["epoch"] == epoch]
        assert sorted(in_epoch) == sorted(r["prompt_id"] for r in stream.rows)
    orders = [[r["prompt_id"] for r in served if r["epoch"] == e] for e in range(2)]
    assert orders[0] != orders[1]
    assert stream.epoch == 6 and stream.index == 10 and stream.served == 160


def test_state_dict_resumes_at_exactly_the_same_next_batch():
    stream = arithmetic_stream(seed=5)
    for _ in range(3):
        stream.next_batch(16)  # mid-epoch 1
    state = json.loads(json.dumps(stream.state_dict()))
    expected = [ids(stream.next_batch(16)) for _ in range(4)]

    resumed = arithmetic_stream(seed=5)
    resumed.load_state_dict(state)
    assert [ids(resumed.next_batch(16)) for _ in range(4)] == expected
    assert resumed.state_dict() == stream.state_dict()


def test_peek_shows_the_next_batch_across_an_epoch_end_without_serving_it():
    stream = arithmetic_stream(seed=5, epochs=2)
    stream.next_batch(20)  # 5 rows left in epoch 0
    state = stream.state_dict()
    peeked = stream.peek(8)
    assert stream.state_dict() == state
    assert peeked == stream.next_batch(8)
    assert [r["epoch"] for r in peeked] == [0] * 5 + [1] * 3


def test_load_state_dict_rejects_a_cursor_of_other_data():
    state = arithmetic_stream(seed=5).state_dict()
    with pytest.raises(ValueError, match="seed=5"):
        arithmetic_stream(seed=6).load_state_dict(state)
    other = PromptStream(get_task("arithmetic", max_operand=3).rows("train"), seed=5)
    with pytest.raises(ValueError, match="size=25"):
        other.load_state_dict(state)


def test_finite_epochs_end_the_stream():
    stream = arithmetic_stream(epochs=2)
    batches = [stream.next_batch(20) for _ in range(3)]
    assert [len(b) for b in batches] == [20, 20, 10]
    assert stream.exhausted and stream.next_batch(4) == []
    assert len({(r["prompt_id"], r["epoch"]) for b in batches for r in b}) == 50


def test_eval_rows_are_the_table_in_order_and_limited():
    stream = arithmetic_stream(eval_size=5)
    assert [r["prompt_id"] for r in stream.eval_rows()][:2] == ["arith-0+0", "arith-0+1"]
    assert len(stream.eval_rows()) == 5 and len(stream.eval_rows(100)) == 25


def test_system_prompt_and_chat_template_formatting():
    plain = arithmetic_stream(system_prompt="Add.", shuffle=False).next_batch(1)[0]
    assert plain["prompt"] == "Add.\n\n0+0=" and plain["messages"] is None
    chat = arithmetic_stream(system_prompt="Add.", chat_template=True, shuffle=False)
    row = chat.next_batch(1)[0]
    assert row["prompt"] is None
    assert row["messages"] == [{"role": "system", "content": "Add."},
                               {"role": "user", "content": "0+0="}]
    # The columns go along (typed) for the reward functions.
    assert row["columns"] == {"a": 0, "b": 0} and plain["columns"] == {"a": 0, "b": 0}


def test_from_config_with_local_files_maps_fields(tmp_path):
    for split, n in (("train", 7), ("test", 3)):
        rows = [{"problem": f"{split} {i}", "solution": f"... #### 1,00{i}"} for i in range(n)]
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = DataConfig(task="files", path=str(tmp_path), prompt_field="problem",
                        answer_field="solution", shuffle_seed=1, epochs=1,
                        options={"reference_format": "gsm8k", "id_prefix": "toy"})
    stream = PromptStream.from_config(config)
    batch = stream.next_batch(10)
    assert len(batch) == 7 and stream.exhausted
    assert {r["prompt_id"] for r in batch} == {f"toy-train-{i}" for i in range(7)}
    assert {r["reference"] for r in batch} == {f"100{i}" for i in range(7)}
    assert [r["prompt"] for r in stream.eval_rows()] == ["test 0", "test 1", "test 2"]


def test_from_config_builtin_gsm8k_and_bad_eval_split(shared_data):
    config = DataConfig(task="gsm8k", path=str(shared_data / "gsm8k"), eval_size=16)
    stream = PromptStream.from_config(config)
    assert stream.size == 7473 and len(stream.eval_rows()) == 16
    assert stream.next_batch(2)[0]["prompt_id"].startswith("gsm8k-train-")
    with pytest.raises(ValueError, match="data.split: task 'math500' has no split 'train'"):
        PromptStream.from_config(DataConfig(task="math500", path=str(shared_data / "math500")))
    with pytest.raises(ValueError, match="data: task 'arithmetic' has no option 'path'"):
        PromptStream.from_config(DataConfig(task="arithmetic", path="x"))


def test_prompts_the_tokenizer_cannot_encode_are_refused_with_what_is_lost(tmp_path):
    """The demo's character vocabulary drops letters: "Tom has 3 apples and gets 3 more"
    reached the model as "33", silently. A byte-level BPE encodes the same data."""
    from splitrl.tokenizer import load_tokenizer, train_bpe_tokenizer, train_char_tokenizer

    rows = [{"question": "Tom has 3 apples and gets 3 more", "answer": "6"},
            {"question": "1+2=", "answer": "3"}, {"question": "2+2=", "answer": "4"}]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = DataConfig(task="files", path=str(tmp_path / "train.jsonl"), eval_split=None)
    digits = load_tokenizer(train_char_tokenizer(["0123456789+="], tmp_path / "chars"))
    with pytest.raises(ValueError) as refused:
        PromptStream.from_config(config, tokenizer=digits)
    assert ("cannot encode 14 distinct character(s) of the prompts and drops them: "
            "'Tadeghlmnoprst'; 1 of 3 prompts would reach the model changed") in str(refused.value)
    assert "'Tom has 3 apples and gets 3 more' is seen as '" in str(refused.value)
    assert PromptStream.from_config(DataConfig(task="arithmetic"), tokenizer=digits)  # 1+2=
    with pytest.raises(ValueError, match=r"(\d+) of \1 prompts would reach the model changed"):
        # The chat template's own text ("user", "assistant") is lost for every prompt.
        PromptStream.from_config(DataConfig(task="arithmetic", chat_template=True),
                                 tokenizer=digits)
    bpe = load_tokenizer(train_bpe_tokenizer(["1+2=3 apples"] * 4, tmp_path / "bpe",
                                             vocab_size=300))
    assert len(PromptStream.from_config(config, tokenizer=bpe).next_batch(3)) == 3
