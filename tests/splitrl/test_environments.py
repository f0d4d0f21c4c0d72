"""Environments: tool-call parsing per format, tool discovery and schemas (TRL's convention),
the built-ins, and episodes in real isolated worker processes (errors, time-outs, a hung
tool killed and its episode carried on)."""

from __future__ import annotations

from fractions import Fraction

import pytest

from splitrl.environments import (
    ToolCall,
    ToolRunner,
    describe,
    detect_format,
    make_environment,
    parse_tool_calls,
    tool_methods,
    tool_schemas,
)
from splitrl.environments.api import BadArguments, bind_arguments
from splitrl.environments.builtin import evaluate_arithmetic, run_python
from splitrl.environments.render import ObservationRenderer
from splitrl.tokenizer import load_tokenizer, train_bpe_tokenizer
from tests.splitrl.chat_templates import LLAMA31, LLAMA31_SPECIALS, QWEN25, QWEN25_SPECIALS

FIX = "tests.splitrl.environment_fixtures:"


# ----------------------------------------------------------------------------- parsing


def test_qwen_calls_are_tool_call_blocks_of_json():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculate", "arguments": {"expression": '
            '"2*3"}}\n</tool_call>\n<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}'
            '\n</tool_call>')
    assert parse_tool_calls(text, "qwen") == [ToolCall("calculate", {"expression": "2*3"}),
                                              ToolCall("f", {"x": 1})]
    assert parse_tool_calls("The answer is 6.", "qwen") == []
    bad, unclosed = parse_tool_calls('<tool_call>{"name": calc}</tool_call> <tool_call>{',
                                     "qwen")
    assert bad.error.startswith("not valid JSON") and unclosed.error.endswith("</tool_call>")


def test_llama3_call_is_the_whole_turn_as_json():
    assert parse_tool_calls('{"name": "calculate", "parameters": {"expression": "1+1"}}',
                            "llama3") == [ToolCall("calculate", {"expression": "1+1"})]
    assert parse_tool_calls('<|python_tag|>{"name": "f", "arguments": {}}', "llama3") == [
        ToolCall("f", {})]
    assert parse_tool_calls("It is 2.", "llama3") == []
    (bad,) = parse_tool_calls('{"parameters": {}}', "llama3")
    assert bad.error == 'expected a JSON object with a "name" string'


def test_tiny_call_is_a_bang_then_name_and_arguments():
    assert parse_tool_calls("!", "tiny") == [ToolCall("")]
    assert parse_tool_calls(" !add cat 2", "tiny") == [ToolCall("add", ["cat", "2"])]
    assert parse_tool_calls("7", "tiny") == []


def test_format_is_detected_from_the_chat_template():
    assert detect_format("{% if tools %}<tool_call>{% endif %}") == "qwen"
    assert detect_format("{{ '<|start_header_id|>ipython<|end_header_id|>' }}") == "llama3"
    assert detect_format(None) == "tiny"


# ----------------------------------------------------------------------------- the API


def test_trl_style_environment_tools_and_schemas():
    env = make_environment(FIX + "TrlWordCounter")
    assert sorted(tool_methods(env)) == ["add", "finish"]
    add = next(s for s in tool_schemas(env) if s["function"]["name"] == "add")
    assert add["function"]["parameters"] == {
        "type": "object", "required": ["word"],
        "properties": {"word": {"type": "string", "description": "The word to add."},
                       "times": {"type": "integer", "description": "How many times to add it."}}}
    info = describe("calculator")
    assert [t["function"]["name"] for t in info.tools] == ["calculate"]


def test_positional_arguments_take_the_annotated_types():
    env = make_environment(FIX + "TrlWordCounter")
    assert bind_arguments(env.add, ["cat", "3"]) == {"word": "cat", "times": 3}
    assert bind_arguments(env.add, {"word": "cat"}) == {"word": "cat"}
    with pytest.raises(BadArguments, match="expected int"):
        bind_arguments(env.add, ["cat", "three"])
    with pytest.raises(BadArguments):
        bind_arguments(env.add, {"colour": "red"})


def test_calculator_is_exact_and_refuses_code():
    assert evaluate_arithmetic("(3 + 4) * 12 / 7") == 12
    assert evaluate_arithmetic("1,000 * 0.1") == 100
    assert evaluate_arithmetic("2^10") == 1024
    assert evaluate_arithmetic("1/3") == Fraction(1, 3)
    for bad in ("__import__('os')", "9**9**9", "1/0", "x + 1"):
        with pytest.raises(ValueError):
            evaluate_arithmetic(bad)
    assert make_environment("calculator").calculate("10 / 4") == "2.5"


def test_python_sandbox_runs_code_without_network_or_forever():
    assert run_python("print(6 * 7)") == "42\n"
    out = run_python("import socket\nsocket.create_connection(('127.0.0.1', 9))")
    assert "PermissionError" in out and "socket" in out
    assert "timed out after 1 s" in run_python("while True: pass", timeout_s=1.0)
    assert "MemoryError" in run_python("x = bytearray(1 << 32)", memory_mb=256)


# ----------------------------------------------------------------------------- episodes


@pytest.fixture(scope="module")
def runner():
    with ToolRunner(FIX + "Misbehaving", workers=1, timeout_s=1.0, kill_grace_s=0.5) as r:
        yield r


def test_trl_environment_runs_unchanged_in_a_worker():
    with ToolRunner(FIX + "TrlWordCounter", workers=1) as r:
        assert r.tool_names == ["add", "finish"]
        assert r.start("e", {"word": "cat"}).text == "Target word: cat"
        assert r.call("e", ToolCall("add", {"word": "cat", "times": 2})).text == "2"
        assert r.call("e", ToolCall("add", ["cat"])).text == "3"
        last = r.call("e", ToolCall("finish"))
        assert (last.status, last.text, last.done, last.reward) == ("ok", "bye", True, 3.0)
        assert r.end("e") == 3.0


def test_batched_starts_and_ends_keep_each_episodes_own_environment():
    """`start_many` starts a batch on one worker (the next in turn), `end_many` ends episodes
    of any workers, one round trip per worker, and each gets its own environment's reward."""
    with ToolRunner(FIX + "TrlWordCounter", workers=2) as r:
        started = r.start_many([("a", {"word": "cat"}), ("b", {"word": "dog"})])
        assert [s.text for s in started] == ["Target word: cat", "Target word: dog"]
        assert r.start("c", {"word": "eel"}).status == "ok"  # on the other worker
        assert r.by_worker(["a", "c", "b", "nope"]) == [["a", "b"], ["c"], ["nope"]]
        assert r.call("b", ToolCall("add", ["dog"])).text == "1"  # b's own counts, not a's
        for episode, times in (("a", 3), ("b", 1), ("c", 2)):
            r.call(episode, ToolCall("add", {"word": "x", "times": times}))
            r.call(episode, ToolCall("finish"))
        assert r.end_many(["c", "nope", "a", "b"]) == [2.0, None, 3.0, 2.0]
        assert r.end_many(["a"]) == [None]  # ended


def test_episodes_ending_after_the_runner_closed_end_quietly_and_start_no_worker():
    """A sampler shutting down closes its runner while episode threads still end theirs: they
    get no reward and no IndexError, and no worker is started again after the close."""
    r = ToolRunner(FIX + "TrlWordCounter", workers=1)
    r.start("e", {"word": "cat"})
    (worker,) = r._workers  # noqa: SLF001 - the process the close must stop for good
    r.close()
    assert r.end("e") is None
    with pytest.raises(KeyError, match="was not started"):
        r.call("e", ToolCall("add", {"word": "cat"}))
    with pytest.raises(RuntimeError, match="is closed"):
        r.start("f", {"word": "dog"})
    assert worker.request(("start", "g", {"word": "dog"}), 1.0) is None
    assert not worker.process.is_alive() and worker.generation == 0


def test_errors_become_observations(runner):
    runner.start("errs", {})
    unknown = runner.call("errs", ToolCall("nope"))
    assert unknown.status == "unknown" and "count, fail, hang, sleep" in unknown.text
    raised = runner.call("errs", ToolCall("fail"))
    assert (raised.status, raised.text) == ("error", "tool 'fail' raised ValueError: no luck")
    bad = runner.call("errs", ToolCall("count", ["extra"]))
    assert bad.status == "malformed"
    ambiguous = runner.call("errs", ToolCall(""))  # a bare call needs a single tool
    assert ambiguous.status == "unknown"
    assert runner.call("errs", ToolCall("count")).text == "1"


def test_a_slow_tool_times_out_and_the_episode_goes_on(runner):
    runner.start("slow", {})
    assert runner.call("slow", ToolCall("count")).text == "1"
    slow = runner.call("slow", ToolCall("sleep"))
    assert slow.status == "timeout" and "timed out after 1 s" in slow.text
    assert runner.call("slow", ToolCall("count")).text == "2"


def test_a_hung_tool_is_killed_and_its_episodes_restored(runner):
    runner.start("hung", {})
    runner.start("bystander", {})
    assert runner.call("bystander", ToolCall("count")).text == "1"
    assert runner.call("hung", ToolCall("count")).text == "1"
    pid = runner._workers[0].process.pid
    hung = runner.call("hung", ToolCall("hang"))
    assert hung.status == "timeout" and runner._workers[0].process.pid != pid
    # Both episodes lived on the killed worker: each is started again and its calls replayed.
    assert runner.call("hung", ToolCall("count")).text == "2"
    assert runner.call("bystander", ToolCall("count")).text == "2"


def test_lookup_pays_its_call_reward_for_exactly_one_call():
    env = make_environment("lookup", {"call_reward": 0.2})
    env.reset(secret=7)
    assert env.reward == 0.0
    assert env.lookup() == "7" and env.reward == 0.2
    assert env.lookup() == "7" and env.reward == 0.0  # calling again instead of answering


# ----------------------------------------------------------------------------- chat templates


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    texts = ["lookup the value", "the answer is 7", '{"name": "lookup", "arguments": {}}'] * 20
    return train_bpe_tokenizer(texts, tmp_path_factory.mktemp("bpe"), vocab_size=300)


def _with_template(path, template: str, specials: tuple[str, ...]):
    tokenizer = load_tokenizer(path, "PreTrainedTokenizerFast")  # a transformers one, to edit
    tokenizer.add_special_tokens({"additional_special_tokens": list(specials)})
    tokenizer.chat_template = template
    return tokenizer


LOOKUP_SCHEMA = {"type": "function", "function": {
    "name": "lookup", "description": "The value.", "parameters": {"type": "object",
                                                                  "properties": {}}}}


def test_qwen25_observation_is_one_user_turn_of_tool_responses(bpe_dir):
    tokenizer = _with_template(bpe_dir, QWEN25, QWEN25_SPECIALS)
    assert detect_format(tokenizer.chat_template) == "qwen"
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    renderer = ObservationRenderer(tokenizer, [LOOKUP_SCHEMA], [im_end])
    text = renderer.text([("lookup", "7"), ("lookup", "8")])
    # the turn stopped at <|im_end|>: the newline the template writes after it comes first
    assert text == ("\n<|im_start|>user\n<tool_response>\n7\n</tool_response>\n<tool_response>"
                    "\n8\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    ids = renderer.ids([("lookup", "7")])
    assert ids == tokenizer.encode(renderer.text([("lookup", "7")]), add_special_tokens=False)
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 2
    # kept per distinct results and stop: a caller's list is its own, `stopped` keys apart
    ids.append(-1)
    assert renderer.ids([("lookup", "7")]) == ids[:-1]
    assert renderer.ids([("lookup", "7")], stopped=False) == tokenizer.encode(
        renderer.text([("lookup", "7")], stopped=False), add_special_tokens=False) != ids[:-1]
    assert renderer.text([("lookup", "7")], stopped=False).startswith("<|im_end|>\n")


def test_llama31_observation_is_an_ipython_turn_per_result(bpe_dir):
    tokenizer = _with_template(bpe_dir, LLAMA31, LLAMA31_SPECIALS)
    assert detect_format(tokenizer.chat_template) == "llama3"
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    renderer = ObservationRenderer(tokenizer, [LOOKUP_SCHEMA], [eot])
    assert renderer.text([("lookup", "7"), ("lookup", "8")]) == (
        '<|start_header_id|>ipython<|end_header_id|>\n\n"7"<|eot_id|>'
        '<|start_header_id|>ipython<|end_header_id|>\n\n"8"<|eot_id|>'
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = renderer.ids([("lookup", "7")])
    header = [tokenizer.convert_tokens_to_ids(t) for t in ("<|start_header_id|>",
                                                           "<|end_header_id|>")]
    assert ids[:1] == header[:1] and ids.count(header[1]) == 2 and ids.count(eot) == 1
    assert renderer.text([("lookup", "7")], stopped=False).startswith("<|eot_id|>")
