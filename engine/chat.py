"""DeepSeek-V4 chat format: prompt encoding and completion parsing.

V4 ships no chat template; the official `encoding/encoding_dsv4.py` builds
prompts in code.  This re-implements that format (arch spec section 7):
    <BOS>{effort}{system}[\n\n{tools}]<｜User｜>{user}<｜Assistant｜></think>{answer}<EOS>...
Consecutive user/tool messages form one user turn (parts joined by "\n\n",
tool results in call order); the assistant prefix is `<think>` when reasoning
follows and `</think>` otherwise; tool calls are DSML blocks after the content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Iterable, Iterator, NamedTuple

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
TOOL_START = f"<{DSML}tool_calls>"
TOOL_END = f"</{DSML}tool_calls>"

# Prompt text the model was trained on; it must match byte for byte.
TOOLS_TEMPLATE = f"""## Tools

You have access to a set of tools to help answer the user's question. \
You can invoke tools by writing a "<{DSML}tool_calls>" block like the following:

<{DSML}tool_calls>
<{DSML}invoke name="$TOOL_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$TOOL_NAME2">
...
</{DSML}invoke>
</{DSML}tool_calls>

String parameters should be specified as is and set `string="true"`. \
For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning \
inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_END} with tool calls or final response.

### Available Tool Schemas

@@TOOL_SCHEMAS@@

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""

# "Think Max" instruction, from the V4 release's encoding_dsv4.py (also Table 3
# of the tech report).  It goes right after BOS, in thinking mode only.  Later
# revisions of that file (the 0731 "official" ladder) shift the levels: this
# text becomes "high" and "max" gets a new "Beyond maximum ..." paragraph;
# we follow the release this checkpoint shipped with.
REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem "
    "to resolve the root cause, rigorously stress-testing your logic against all potential "
    "paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate "
    "step, considered alternative, and rejected hypothesis to ensure absolutely no assumption "
    "is left unchecked.\n\n"
)
# Levels OpenAI clients send; only "max" (and the "xhigh" alias) changes the prompt.
_EFFORT_PREFIX = {None: "", "none": "", "minimal": "", "low": "", "medium": "",
                  "high": "", "xhigh": REASONING_EFFORT_MAX, "max": REASONING_EFFORT_MAX}


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False)


# ---------------------------------------------------------------- encoding

def _text(content, where: str, sep: str = "") -> str:
    """Plain string from an OpenAI `content` (str or list of text parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"{where}: unsupported content part {kind!r} (text only)")
        return sep.join(str(part.get("text") or "") for part in content)
    if content is None:
        raise ValueError(f"{where}: missing 'content'")
    raise ValueError(f"{where}: 'content' must be a string or a list of text parts")


def _tool_function(tool, i: int) -> dict:
    # OpenAI shape {"type": "function", "function": {...}}; a bare function dict is accepted too.
    fn = tool.get("function", tool) if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"tools[{i}]: expected {{'type': 'function', 'function': {{'name': ...}}}}")
    return fn


def render_tools(tools: list[dict]) -> str:
    """The "## Tools" block appended (after "\\n\\n") to the system text."""
    schemas = "\n".join(_json(_tool_function(t, i)) for i, t in enumerate(tools))
    return TOOLS_TEMPLATE.replace("@@TOOL_SCHEMAS@@", schemas)


def _call_arguments(raw, where: str) -> dict:
    if isinstance(raw, dict):
        return raw
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return {}
    if not isinstance(raw, str):
        raise ValueError(f"{where}: 'arguments' must be a JSON string or an object")
    try:
        args = json.loads(raw)
    except json.JSONDecodeError:
        args = None
    # The official encoder keeps unparsable arguments under one "arguments" key.
    return args if isinstance(args, dict) else {"arguments": raw}


def _render_tool_calls(tool_calls: list, where: str) -> str:
    invokes = []
    for j, call in enumerate(tool_calls):
        w = f"{where}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"{w}: expected {{'function': {{'name': ..., 'arguments': ...}}}}")
        params = []
        for key, value in _call_arguments(fn.get("arguments"), w).items():
            is_str = isinstance(value, str)
            params.append(f'<{DSML}parameter name="{key}" string="{"true" if is_str else "false"}">'
                          f"{value if is_str else _json(value)}</{DSML}parameter>")
        invokes.append(f'<{DSML}invoke name="{fn["name"]}">\n' + "\n".join(params)
                       + f"\n</{DSML}invoke>")
    return f"\n\n{TOOL_START}\n" + "\n".join(invokes) + f"\n{TOOL_END}"


@dataclass
class _UserTurn:
    parts: list = field(default_factory=list)  # (text, tool_call_id or None, is_tool)

    def render(self, call_order: dict[str, int]) -> str:
        # Tool results are put in the order the calls were made (stable sort,
        # unknown ids first), as the official encoder does.
        tools = sorted((p for p in self.parts if p[2]), key=lambda p: call_order.get(p[1], 0))
        it = iter(tools)
        ordered = [next(it) if p[2] else p for p in self.parts]
        return USER + "\n\n".join(f"<tool_result>{t}</tool_result>" if is_tool else t
                                  for t, _, is_tool in ordered)


def _assistant_turn(msg: dict, where: str) -> dict:
    calls = msg.get("tool_calls") or []
    if not isinstance(calls, list):
        raise ValueError(f"{where}: 'tool_calls' must be a list")
    content = msg.get("content")
    if content is None and not calls and "content" not in msg:
        raise ValueError(f"{where}: assistant message needs 'content' or 'tool_calls'")
    reasoning = msg.get("reasoning_content", msg.get("reasoning")) or ""
    return {"content": "" if content is None else _text(content, where),
            "reasoning": _text(reasoning, where + ".reasoning_content"),
            "tool_calls": _render_tool_calls(calls, where) if calls else "",
            "call_ids": [_call_id(c.get("id"), f"{where}.tool_calls[{j}].id")
                         for j, c in enumerate(calls) if isinstance(c, dict)]}


def _call_id(value, where: str) -> str | None:
    """Tool call ids are strings (they key the order tool results are put back in)."""
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{where}: a tool call id must be a string, got {type(value).__name__}")
    return value


def _split_turns(messages: list[dict]) -> tuple[list[str], list]:
    """Validate messages; return (system texts, [_UserTurn | assistant dict])."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    systems, turns = [], []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise ValueError(f"{where}: expected a dict, got {type(msg).__name__}")
        role = msg.get("role")
        if role == "system":
            if turns:
                raise ValueError(f"{where}: system messages must come before all other messages")
            systems.append(_text(msg.get("content"), where))
        elif role in ("user", "developer", "tool"):
            is_tool = role == "tool"
            text = _text(msg.get("content"), where, sep="\n\n" if is_tool else "")
            if not turns or not isinstance(turns[-1], _UserTurn):
                turns.append(_UserTurn())
            turns[-1].parts.append((text, _call_id(msg.get("tool_call_id"), where + ".tool_call_id"), is_tool))
        elif role == "assistant":
            if not turns or not isinstance(turns[-1], _UserTurn):
                raise ValueError(f"{where}: an assistant message must follow a user or tool message")
            turns.append(_assistant_turn(msg, where))
        else:
            raise ValueError(f"{where}: unknown role {role!r} "
                             "(expected system, user, developer, assistant or tool)")
    return systems, turns


def encode_messages(messages: list[dict], thinking: bool = False, tools: list[dict] | None = None,
                    reasoning_effort: str | None = None, add_generation_prompt: bool = True,
                    drop_thinking: bool = True) -> str:
    """Render an OpenAI-style message list as a V4 prompt string (BOS included).

    Reasoning of assistant turns before the last user turn is dropped in
    thinking mode unless `tools` are given (the model needs its earlier
    reasoning in agentic loops) or `drop_thinking=False`.
    """
    if reasoning_effort not in _EFFORT_PREFIX:
        raise ValueError(f"unknown reasoning_effort {reasoning_effort!r}; "
                         f"expected one of {[k for k in _EFFORT_PREFIX if k]}")
    if tools is not None and not isinstance(tools, list):
        raise ValueError("tools must be a list of OpenAI tool definitions")
    systems, turns = _split_turns(messages)
    if add_generation_prompt and not (turns and isinstance(turns[-1], _UserTurn)):
        raise ValueError("a generation prompt needs the messages to end with a user or tool message")

    prompt = BOS + (_EFFORT_PREFIX[reasoning_effort] if thinking else "")
    prompt += "\n\n".join(systems)
    if tools:
        prompt += "\n\n" + render_tools(tools)
    drop = drop_thinking and not tools
    last_user = max(k for k, t in enumerate(turns) if isinstance(t, _UserTurn)) if turns else -1
    call_order: dict[str, int] = {}
    for k, turn in enumerate(turns):
        keep_reasoning = thinking and (not drop or k >= last_user)
        if isinstance(turn, _UserTurn):
            prompt += turn.render(call_order)
            if k + 1 < len(turns) or add_generation_prompt:
                prompt += ASSISTANT + (THINK_START if keep_reasoning else THINK_END)
        else:
            if keep_reasoning:
                prompt += turn["reasoning"] + THINK_END
            prompt += turn["content"] + turn["tool_calls"] + EOS
            call_order = {cid: j for j, cid in enumerate(turn["call_ids"]) if cid}
    return prompt


def encode_chat(tokenizer, messages: list[dict], **kwargs) -> list[int]:
    """Token ids of `encode_messages(messages, **kwargs)` (BOS included as id)."""
    return tokenizer.encode(encode_messages(messages, **kwargs))


# ----------------------------------------------------------------- parsing

_INVOKE_RE = re.compile(rf'<{DSML}invoke\s+name="([^"]*)"\s*>(.*?)</{DSML}invoke>', re.DOTALL)
_PARAM_RE = re.compile(
    rf'<{DSML}parameter\s+name="([^"]*)"\s+string="(true|false)"\s*>(.*?)</{DSML}parameter>',
    re.DOTALL)


def _param_value(raw: str, is_str: bool):
    if is_str:
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw  # model wrote a non-JSON value; keep its text rather than fail


def _parse_tool_block(block: str) -> list[dict]:
    calls = []
    for name, body in _INVOKE_RE.findall(block):
        args = {k: _param_value(v, s == "true") for k, s, v in _PARAM_RE.findall(body)}
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": name, "arguments": _json(args)}})
    return calls


def _held_suffix(buf: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of `buf` that could start one of `markers`."""
    best = 0
    for m in markers:
        for k in range(min(len(buf), len(m) - 1), best, -1):
            if buf.endswith(m[:k]):
                best = k
                break
    return best


def _first_marker(buf: str, markers: tuple[str, ...], start: int = 0) -> tuple[int, str | None]:
    hits = [(i, m) for m in markers if (i := buf.find(m, start)) >= 0]
    return min(hits) if hits else (-1, None)


class StreamDelta(NamedTuple):
    reasoning: str
    content: str


class StreamingParser:
    """Splits streamed completion text into reasoning and content deltas.

    In thinking mode everything before `</think>` is reasoning.  DSML
    tool-call blocks are held back until closed, then parsed into
    `tool_calls` (fetch new ones with `take_tool_calls()`); they never show
    up in content.  Text after EOS (if the caller passes it) is ignored.
    `parse_completion` runs this same machine, so streamed and one-shot
    results agree.
    """

    def __init__(self, thinking: bool):
        self.thinking = thinking
        self._state = "reasoning" if thinking else "content"
        self._buf = ""
        self._after_block = False
        self.tool_calls: list[dict] = []
        self._taken = 0
        self._scanned = 0  # tool state: buffer prefix already searched for the end tag

    def push(self, delta: str) -> StreamDelta:
        self._buf += delta
        out = ([], [])
        while self._step(*out):
            pass
        return StreamDelta("".join(out[0]), "".join(out[1]))

    def flush(self) -> StreamDelta:
        """End of stream: release held text (an unclosed tool block becomes content)."""
        (buf, self._buf), (state, self._state) = (self._buf, ""), (self._state, "done")
        if state == "content" and self._after_block:
            buf = buf.lstrip()
        return StreamDelta(buf if state == "reasoning" else "", "" if state == "reasoning" else buf)

    def feed(self, deltas: Iterable[str]) -> Iterator[StreamDelta]:
        """Push every delta, then flush; yields only non-empty deltas."""
        for d in deltas:
            out = self.push(d)
            if out.reasoning or out.content:
                yield out
        out = self.flush()
        if out.reasoning or out.content:
            yield out

    def take_tool_calls(self) -> list[dict]:
        """Tool calls completed since the last call."""
        new = self.tool_calls[self._taken:]
        self._taken = len(self.tool_calls)
        return new

    def _step(self, reasoning: list, content: list) -> bool:
        """Consume what can be decided now; True if the state changed."""
        if self._state == "reasoning":
            return self._step_reasoning(reasoning)
        if self._state == "done":
            self._buf = ""
            return False
        return (self._step_content if self._state == "content" else self._step_tool)(content)

    def _step_reasoning(self, out: list) -> bool:
        i, m = _first_marker(self._buf, (THINK_END, EOS))
        if m is None:
            cut = len(self._buf) - _held_suffix(self._buf, (THINK_END, EOS))
            out.append(self._buf[:cut])
            self._buf = self._buf[cut:]
            return False
        out.append(self._buf[:i])
        self._buf = self._buf[i + len(m):]
        self._state = "content" if m == THINK_END else "done"
        return True

    def _step_content(self, out: list) -> bool:
        if self._after_block:
            # Whitespace between a tool block and what follows is format, not content.
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            self._after_block = False
        i, m = _first_marker(self._buf, (TOOL_START, EOS))
        if m is None:
            safe = self._buf[:len(self._buf) - _held_suffix(self._buf, (TOOL_START, EOS))]
            # Trailing whitespace is held too: the "\n\n" before a tool block is dropped.
            cut = len(safe.rstrip())
            out.append(self._buf[:cut])
            self._buf = self._buf[cut:]
            return False
        if m == EOS:
            out.append(self._buf[:i])
            self._state, self._buf = "done", ""
        else:
            text = self._buf[:i].rstrip()
            out.append(text)
            # Keep the dropped whitespace in case the block turns out malformed.
            self._state, self._buf = "tool", self._buf[len(text):]
        return True

    def _step_tool(self, out: list) -> bool:
        # Long tool arguments arrive in many deltas; only search the new tail.
        start = max(0, self._scanned - max(len(TOOL_END), len(EOS)))
        i, m = _first_marker(self._buf, (TOOL_END, EOS), start)
        self._scanned = len(self._buf)
        if m is None:
            return False
        self._scanned = 0
        if m == EOS:  # unterminated block: surface it rather than lose it
            out.append(self._buf[:i])
            self._state = "done"
            return True
        block, self._buf = self._buf[:i + len(m)], self._buf[i + len(m):]
        calls = _parse_tool_block(block)
        if calls:
            self.tool_calls.extend(calls)
            self._after_block = True
        else:
            out.append(block)
        self._state = "content"
        return True


@dataclass
class ParsedCompletion:
    reasoning_content: str | None
    content: str
    tool_calls: list[dict]


def parse_completion(text: str, thinking: bool) -> ParsedCompletion:
    """Split a finished completion into reasoning, content and OpenAI tool calls.

    In thinking mode a completion without `</think>` (cut off while
    reasoning) is all reasoning.  In chat mode reasoning_content is None.
    """
    parser = StreamingParser(thinking)
    first, last = parser.push(text), parser.flush()
    reasoning = first.reasoning + last.reasoning
    return ParsedCompletion(reasoning_content=reasoning if thinking else None,
                            content=first.content + last.content,
                            tool_calls=parser.tool_calls)
