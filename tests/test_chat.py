"""DeepSeek-V4 chat encoding and completion parsing."""

import json

import pytest

from engine.chat import (
    BOS, EOS, REASONING_EFFORT_MAX, StreamingParser, encode_chat, encode_messages,
    parse_completion, render_tools,
)
from engine.tokenizer import Tokenizer

SYS = {"role": "system", "content": "You are a helpful assistant."}
Q = {"role": "user", "content": "What is 2+2?"}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(None)


def test_official_example_ids(tok):
    base = [0, 3476, 477, 260, 11502, 22896, 16, 128803, 3085, 344, 223, 20, 13, 20, 33, 128804]
    assert encode_chat(tok, [SYS, Q]) == base + [128822]
    assert encode_chat(tok, [SYS, Q], thinking=True) == base + [128821]


def test_no_system():
    assert encode_messages([Q]) == f"{BOS}<｜User｜>What is 2+2?<｜Assistant｜></think>"


def _multi_turn():
    return [SYS, Q,
            {"role": "assistant", "content": "4", "reasoning_content": "2+2 is 4"},
            {"role": "user", "content": "And 3+3?"}]


def test_multi_turn_chat():
    assert encode_messages(_multi_turn()) == (
        f"{BOS}You are a helpful assistant.<｜User｜>What is 2+2?<｜Assistant｜></think>4{EOS}"
        "<｜User｜>And 3+3?<｜Assistant｜></think>")


def test_multi_turn_thinking_drops_earlier_reasoning():
    out = encode_messages(_multi_turn(), thinking=True)
    assert "2+2 is 4" not in out
    assert out == (
        f"{BOS}You are a helpful assistant.<｜User｜>What is 2+2?<｜Assistant｜></think>4{EOS}"
        "<｜User｜>And 3+3?<｜Assistant｜><think>")


def test_reasoning_kept_when_tools_present_or_asked():
    kept = (f"<｜User｜>What is 2+2?<｜Assistant｜><think>2+2 is 4</think>4{EOS}"
            "<｜User｜>And 3+3?<｜Assistant｜><think>")
    assert encode_messages(_multi_turn(), thinking=True, tools=[WEATHER]).endswith(kept)
    assert encode_messages(_multi_turn(), thinking=True, drop_thinking=False).endswith(kept)


def test_finished_conversation_without_generation_prompt():
    msgs = [Q, {"role": "assistant", "content": "4", "reasoning_content": "easy"}]
    assert encode_messages(msgs, add_generation_prompt=False) == (
        f"{BOS}<｜User｜>What is 2+2?<｜Assistant｜></think>4{EOS}")
    # The last turn (after the last user message) keeps its reasoning.
    assert encode_messages(msgs, thinking=True, add_generation_prompt=False) == (
        f"{BOS}<｜User｜>What is 2+2?<｜Assistant｜><think>easy</think>4{EOS}")


def test_reasoning_effort():
    out = encode_messages([SYS, Q], thinking=True, reasoning_effort="max")
    assert out.startswith(BOS + REASONING_EFFORT_MAX + "You are a helpful assistant.")
    assert REASONING_EFFORT_MAX.startswith("Reasoning Effort: Absolute maximum")
    # Chat mode and the lower levels add nothing.
    assert encode_messages([SYS, Q], reasoning_effort="max") == encode_messages([SYS, Q])
    assert (encode_messages([SYS, Q], thinking=True, reasoning_effort="high")
            == encode_messages([SYS, Q], thinking=True))
    with pytest.raises(ValueError, match="reasoning_effort"):
        encode_messages([Q], reasoning_effort="extreme")


def test_tools_block_in_system():
    out = encode_messages([SYS, Q], tools=[WEATHER])
    schema = json.dumps(WEATHER["function"], ensure_ascii=False)
    assert out.startswith(BOS + "You are a helpful assistant.\n\n## Tools\n\n")
    assert f"### Available Tool Schemas\n\n{schema}\n\nYou MUST strictly follow" in out
    assert out.endswith("invoke tool calls.\n<｜User｜>What is 2+2?<｜Assistant｜></think>")
    assert '<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">' in render_tools([WEATHER])
    # Without a system message the block still sits right after BOS.
    assert encode_messages([Q], tools=[WEATHER]).startswith(BOS + "\n\n## Tools\n\n")


def _tool_conversation():
    calls = [{"id": "c1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
             {"id": "c2", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 3}'}}]
    return [Q, {"role": "assistant", "content": "Checking.", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "c2", "content": "sunny"},
            {"role": "tool", "tool_call_id": "c1", "content": "rain"}]


def test_tool_calls_and_results_rendering():
    out = encode_messages(_tool_conversation(), tools=[WEATHER])
    assert out.endswith(
        "<｜User｜>What is 2+2?<｜Assistant｜></think>Checking.\n\n"
        "<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Rome</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        f"</｜DSML｜tool_calls>{EOS}"
        # Results come back in one user turn, in call order (c1 before c2).
        "<｜User｜><tool_result>rain</tool_result>\n\n<tool_result>sunny</tool_result>"
        "<｜Assistant｜></think>")


def test_tool_call_round_trip():
    msgs = _tool_conversation()[:2]
    prompt = encode_messages(msgs, tools=[WEATHER], add_generation_prompt=False)
    completion = prompt.split("<｜Assistant｜></think>")[-1]
    parsed = parse_completion(completion, thinking=False)
    assert parsed.reasoning_content is None
    assert parsed.content == "Checking."
    want = msgs[1]["tool_calls"]
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["get_weather"] * 2
    for got, ref in zip(parsed.tool_calls, want):
        assert got["type"] == "function" and got["id"].startswith("call_")
        assert json.loads(got["function"]["arguments"]) == json.loads(ref["function"]["arguments"])
    # Re-encoding the parsed message reproduces the same prompt.
    again = [Q, {"role": "assistant", "content": parsed.content, "tool_calls": parsed.tool_calls}]
    assert encode_messages(again, tools=[WEATHER], add_generation_prompt=False) == prompt


THINKING_TOOL_COMPLETION = (
    "I should call the tool.</think>Let me look.\n\n<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="search">\n'
    '<｜DSML｜parameter name="query" string="true">深度 "求索"\n2</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="opts" string="false">{"top_k": 5, "safe": true}</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>" + EOS)


def test_parse_thinking_with_tool_call():
    p = parse_completion(THINKING_TOOL_COMPLETION, thinking=True)
    assert p.reasoning_content == "I should call the tool."
    assert p.content == "Let me look."
    (call,) = p.tool_calls
    assert call["function"]["name"] == "search"
    assert json.loads(call["function"]["arguments"]) == {
        "query": '深度 "求索"\n2', "opts": {"top_k": 5, "safe": True}}


def test_parse_plain_and_truncated():
    assert parse_completion("hmm</think>4" + EOS, thinking=True).content == "4"
    p = parse_completion("still thinking", thinking=True)  # cut off before </think>
    assert (p.reasoning_content, p.content, p.tool_calls) == ("still thinking", "", [])
    p = parse_completion("The answer is 4.  \n", thinking=False)
    assert (p.reasoning_content, p.content) == (None, "The answer is 4.  \n")
    # An unclosed tool block is surfaced as content rather than dropped.
    p = parse_completion("x\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke", thinking=False)
    assert p.content == "x\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke" and p.tool_calls == []


def _stream(text, thinking, step):
    parser = StreamingParser(thinking)
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    deltas = list(parser.feed(pieces))
    return deltas, parser


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_streaming_matches_one_shot(step):
    deltas, parser = _stream(THINKING_TOOL_COMPLETION, True, step)
    reasoning = "".join(d.reasoning for d in deltas)
    content = "".join(d.content for d in deltas)
    assert reasoning == "I should call the tool."
    assert content == "Let me look."
    assert all("DSML" not in d.content and "<" not in d.content for d in deltas)
    assert [c["function"]["name"] for c in parser.take_tool_calls()] == ["search"]
    assert parser.take_tool_calls() == []


def test_streaming_with_tokenizer_deltas(tok):
    text = "推理😀 step</think>答案: 4 🎉 <b>bold</b>"
    det, parser = tok.detokenizer(), StreamingParser(thinking=True)
    outs = [parser.push(det.push(i)) for i in tok.encode(text)]
    outs += [parser.push(det.flush()), parser.flush()]
    assert "".join(o.reasoning for o in outs) == "推理😀 step"
    assert "".join(o.content for o in outs) == "答案: 4 🎉 <b>bold</b>"


def test_streaming_releases_text_early():
    parser = StreamingParser(thinking=False)
    assert parser.push("Hello ") == ("", "Hello")  # trailing space held
    assert parser.push("world <") == ("", " world")  # "<" might open a tool block
    assert parser.push("3") == ("", " <3")


@pytest.mark.parametrize("messages, match", [
    ([], "non-empty"),
    ([{"role": "robot", "content": "hi"}], "unknown role"),
    ([{"role": "user"}], "missing 'content'"),
    ([{"content": "hi"}], "unknown role"),
    (["hi"], "expected a dict"),
    ([Q, {"role": "assistant", "content": "4"}], "end with a user or tool"),
    ([SYS], "end with a user or tool"),
    ([{"role": "assistant", "content": "4"}, Q], "must follow a user"),
    ([Q, {"role": "system", "content": "late"}], "system messages must come before"),
    ([Q, {"role": "assistant"}, Q], "needs 'content' or 'tool_calls'"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], "unsupported content part"),
    ([Q, {"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}, Q],
     "tool_calls"),
])
def test_invalid_messages_raise(messages, match):
    with pytest.raises(ValueError, match=match):
        encode_messages(messages)


def test_invalid_tools_raise():
    with pytest.raises(ValueError, match="tools"):
        encode_messages([Q], tools=[{"type": "function"}])
    with pytest.raises(ValueError, match="tools"):
        encode_messages([Q], tools={"name": "x"})


def test_content_parts_and_developer_role():
    parts = {"role": "user", "content": [{"type": "text", "text": "What is "},
                                         {"type": "text", "text": "2+2?"}]}
    assert encode_messages([parts]) == encode_messages([Q])
    dev = {"role": "developer", "content": "What is 2+2?"}
    assert encode_messages([dev]) == encode_messages([Q])


def test_streaming_long_tool_argument():
    body = "line of file content 文件\n" * 2000
    text = ("\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"write\">\n"
            f'<｜DSML｜parameter name="text" string="true">{body}</｜DSML｜parameter>\n'
            "</｜DSML｜invoke>\n</｜DSML｜tool_calls>")
    deltas, parser = _stream(text, False, 3)
    assert deltas == []
    (call,) = parser.tool_calls
    assert json.loads(call["function"]["arguments"]) == {"text": body}
