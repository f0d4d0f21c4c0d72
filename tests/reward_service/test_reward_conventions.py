"""TRL's and EasyDeL's reward functions, unchanged, through the real reward service.

The expected scores are what each function computes when called the way its own trainer calls
it (TRL: keyword arguments with every column, one value per completion; EasyDeL: ``prompts``,
``completions`` and ``batch``), and, where TRL's guide prints them, the guide's own outputs.
"""

from __future__ import annotations

import json

import grpc
import published_rewards as pub
import pytest

from reward_service import resolve
from reward_service.conventions import TrainerState, detect
from splitrl.reward_protocol import RewardOutcome
from splitrl.v1 import common_pb2, reward_pb2

P = "pathological_rewards:"
PUB = "published_rewards:"


def score(stub, items, functions):
    return stub.Score(reward_pb2.ScoreRequest(items=items, functions=list(functions)), timeout=60)


def item(completion, *, prompt="", reference="", group="", columns=None, messages=None,
         ids=(), item_id=""):
    msg = reward_pb2.ScoreItem(
        item_id=item_id, prompt=prompt, completion=completion, reference=reference,
        group_id=group, completion_ids=list(ids), completion_tokens=len(ids),
        columns_json=json.dumps(columns) if columns else "")
    for m in messages or ():
        msg.prompt_messages.add(role=m["role"], content=m["content"])
    return msg


def scores_of(reply, name):
    return [s.scores[name] for s in reply.scores]


@pytest.mark.parametrize("name,style", [
    ("trl_reward_token_count", "trl"), ("trl_reward_char_count", "trl"),
    ("trl_format_reward_func", "trl"), ("trl_reward_ground_truth", "trl"),
    ("trl_math_reward_func", "trl"), ("trl_async_reward_func", "trl"),
    ("format_reward", "trl"), ("accuracy_reward", "easydel"),
])
def test_style_is_detected_from_the_signature(name, style):
    assert detect(getattr(pub, name)).style == style
    assert resolve("math_accuracy").style == "splitrl"
    assert resolve(P + "completion_length").style == "splitrl"


def test_list_reward_functions_reports_each_style(reward_stub):
    reply = reward_stub.ListRewardFunctions(reward_pb2.ListRewardFunctionsRequest(), timeout=10)
    styles = {f.name: f.style for f in reply.functions}
    assert styles["math_accuracy"] == "splitrl"
    assert styles[PUB + "trl_reward_char_count"] == "trl"
    assert styles[PUB + "accuracy_reward"] == "easydel"


def test_trl_guide_examples_score_what_the_guide_prints(reward_stub):
    # Examples 1 and 1.1: two prompts (two groups), token counts and character counts.
    items = [item(" blue.", prompt="The sky is", group="sky", ids=[6303, 13]),
             item(" in the sky.", prompt="The sun is", group="sun", ids=[304, 279, 12884, 13])]
    reply = score(reward_stub, items, [PUB + "trl_reward_token_count",
                                       PUB + "trl_reward_char_count"])
    assert scores_of(reply, PUB + "trl_reward_token_count") == [2.0, 4.0]
    assert scores_of(reply, PUB + "trl_reward_char_count") == [6.0, 12.0]

    # Example 2, conversational: prompts and completions arrive as messages.
    done = ("<think>The sum of 1 and 2 is 3, which we multiply by 4 to get 12.</think>"
            "<answer>(1 + 2) * 4 = 12</answer>")
    plain = "The sum of 3 and 1 is 4, which we multiply by 2 to get 8. So (3 + 1) * 2 = 8."
    items = [item(done, group="a", messages=[
                 {"role": "assistant", "content": "What is the result of (1 + 2) * 4?"}]),
             item(plain, group="b", messages=[
                 {"role": "assistant", "content": "What is the result of (3 + 1) * 2?"}])]
    reply = score(reward_stub, items, [PUB + "trl_format_reward_func"])
    assert scores_of(reply, PUB + "trl_format_reward_func") == [1.0, 0.0]

    # Example 3: the dataset's ground_truth column reaches the function.
    items = [item(r" The solution is \boxed{2}.", group="1", columns={"ground_truth": "2"},
                  prompt="Problem: Solve the equation $2x + 3 = 7$. Solution:"),
             item(r" The solution is \boxed{6}.", group="2", columns={"ground_truth": "5"},
                  prompt="Problem: Solve the equation $3x - 5 = 10$.")]
    reply = score(reward_stub, items, [PUB + "trl_reward_ground_truth"])
    assert scores_of(reply, PUB + "trl_reward_ground_truth") == [1.0, 0.0]


def test_trl_multi_task_example_scores_none_as_no_score(reward_stub):
    rows = [("What is 2+2?", "math", "4"),
            ("Write a function that returns the sum of two numbers.", "code",
             "def add(a, b): return a + b"),
            ("What is 3*4?", "math", "13"),
            ("Write a function that returns the product of two numbers.", "code", "no")]
    items = [item(c, prompt=p, group=str(i), columns={"task": t})
             for i, (p, t, c) in enumerate(rows)]
    math_fn, code_fn = PUB + "trl_math_reward_func", PUB + "trl_coding_reward_func"
    reply = score(reward_stub, items, [math_fn, code_fn])
    expected = pub.trl_math_reward_func(prompts=[r[0] for r in rows],
                                        completions=[r[2] for r in rows],
                                        task=[r[1] for r in rows])
    assert expected == [1.0, None, -1.0, None]
    assert scores_of(reply, math_fn) == [0.0 if e is None else e for e in expected]
    assert [s.reasons.get(math_fn, "") for s in reply.scores] == [
        "", "no score (None)", "", "no score (None)"]
    # The guide's coding function tests t == "coding" while its data says "code": all None.
    assert all(s.reasons[code_fn] == "no score (None)" for s in reply.scores)
    assert all(s.outcomes[code_fn] == RewardOutcome.NO_SCORE for s in reply.scores)


def test_trl_async_example(reward_stub):
    reply = score(reward_stub, [item("x", group="g"), item("", group="g")],
                  [PUB + "trl_async_reward_func"])
    assert scores_of(reply, PUB + "trl_async_reward_func") == [1.0, 0.0]


def easydel_group():
    system = "The assistant first thinks, then answers within <answer> </answer> tags."
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": "What is half of one?"}]
    completions = [
        "<think>one over two</think> <answer>$\\frac{1}{2}$</answer>",
        "<think>hmm</think><answer>$\\frac{1}{3}$</answer>",
        "the answer is $0.5$",
        "<think>x</think>",
    ]
    return messages, completions, "$\\frac{1}{2}$"


def test_easydel_tutorial_functions_score_what_they_compute(reward_stub):
    messages, completions, reference = easydel_group()
    assert len(completions) == pub.num_return_sequences
    items = [item(c, reference=reference, group="q", messages=messages, item_id=str(i))
             for i, c in enumerate(completions)]
    reply = score(reward_stub, items, [PUB + "format_reward", PUB + "accuracy_reward"])
    # What EasyDeL passes: one prompt per completion, chat completions, the prompt's batch.
    chat = [[{"role": "assistant", "content": c}] for c in completions]
    kwargs = {"prompts": [messages] * len(completions), "completions": chat,
              "batch": {"reference": [reference]}}
    expected_format = pub.format_reward(**kwargs)
    expected_accuracy = pub.accuracy_reward(**kwargs)
    assert expected_format == [1.0, 1.0, 0.0, 0.0]
    assert expected_accuracy == [1.0, 0.0, 1.0, 0.0]
    assert scores_of(reply, PUB + "format_reward") == expected_format
    assert scores_of(reply, PUB + "accuracy_reward") == expected_accuracy


def test_a_group_is_one_call_and_single_items_are_calls_of_their_own(reward_stub):
    grouped = [item(str(i), group="g") for i in range(5)]
    alone = [item("a"), item("b")]
    other = [item(str(i), group="h") for i in range(3)]
    reply = score(reward_stub, grouped + alone + other, [P + "batch_size"])
    assert scores_of(reply, P + "batch_size") == [5.0] * 5 + [1.0, 1.0] + [3.0] * 3


def test_columns_keep_their_json_types(reward_stub):
    items = [item("x", group="g", columns={"difficulty": 3, "tags": ["a", "b"]}),
             item("y", group="g", columns={"difficulty": 3, "tags": ["a", "b"]})]
    reply = score(reward_stub, items, [P + "typed_columns"])
    assert scores_of(reply, P + "typed_columns") == [5.0, 5.0]


def test_a_required_argument_the_data_lacks_is_an_error_naming_it(reward_stub):
    reply = score(reward_stub, [item("\\boxed{2}", group="g")], [PUB + "trl_reward_ground_truth"])
    reason = reply.scores[0].reasons[PUB + "trl_reward_ground_truth"]
    assert reason.startswith("error: TypeError: the function requires argument 'ground_truth'")


def test_a_hung_batch_times_out_every_item_and_frees_its_worker(reward_stub):
    items = [item(str(i), group="g") for i in range(3)]
    reply = score(reward_stub, items, [P + "hang_ignoring_alarm"])
    assert [s.reasons[P + "hang_ignoring_alarm"] for s in reply.scores] == ["timeout"] * 3
    assert {s.outcomes[P + "hang_ignoring_alarm"] for s in reply.scores} == {
        RewardOutcome.TIMEOUT}
    reply = score(reward_stub, [item("\\boxed{7}", reference="7")], ["math_accuracy"])
    assert reply.scores[0].scores["math_accuracy"] == 1.0


def test_a_failing_batch_fails_every_item_with_its_reason(reward_stub):
    reply = score(reward_stub, [item(str(i), group="g") for i in range(3)],
                  [P + "wrong_length", P + "raise_error"])
    for s in reply.scores:
        assert s.reasons[P + "wrong_length"] == "error: returned 2 scores for 3 completions"
        assert s.outcomes[P + "wrong_length"] == s.outcomes[P + "raise_error"] == (
            RewardOutcome.ERROR)
        assert s.reasons[P + "raise_error"] == (
            "error: RuntimeError: this reward function is broken")


def _code(call):
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def test_bad_columns_and_groups_are_invalid_argument(reward_stub):
    bad = item("1", columns={"completions": 1})
    code, details = _code(lambda: score(reward_stub, [item("1"), bad], ["exact_answer"]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "items[1].columns_json['completions']" in details and "reserved" in details
    not_object = reward_pb2.ScoreItem(completion="1", columns_json="[1, 2]")
    code, details = _code(lambda: score(reward_stub, [not_object], ["exact_answer"]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "JSON object" in details
    mixed = [item("1", prompt="2+2=", group="g"), item("1", prompt="3+3=", group="g")]
    code, details = _code(lambda: score(reward_stub, mixed, ["exact_answer"]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "items[1].group_id" in details and "prompt" in details


def test_direct_calls_take_our_convention_whatever_the_style():
    # The loaded function is callable as f(prompts, completions, references, **columns).
    fn = resolve(PUB + "trl_reward_ground_truth")
    assert fn(["p", "q"], ["\\boxed{2}", "\\boxed{3}"], ["", ""],
              ground_truth=["2", "2"]) == [1.0, 0.0]
    assert TrainerState(3).global_step == 3
    assert common_pb2.Prompt(columns_json="{}").columns_json == "{}"


def test_options_a_function_does_not_take_fail_at_load():
    with pytest.raises(ValueError, match="bad options .*takes no argument 'bogus'"):
        resolve(P + "completion_length", {"bogus": 1})
    assert resolve(P + "completion_length", {"scale": 2.0})(["p"], ["abc"], [""]) == [6.0]
