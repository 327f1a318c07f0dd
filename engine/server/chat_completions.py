"""POST /v1/chat/completions: DeepSeek-V4 chat encoding in, reasoning / content / tool calls out.

The completion text is split by engine.chat's parser (the same machine streamed or not),
so streamed deltas add up to the non-streamed message.
"""
from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..chat import StreamingParser, parse_completion
from ..core import CompletionOutput, RequestOutput
from .inputs import chat_params, chat_prompt, check_context, check_n
from .logprobs import chat_logprobs, vllm_prompt_logprobs
from .schemas import ChatCompletionRequest
from .serving import ClientGone, collect, event_stream, prime, usage
from .state import ServerState, new_id
from .streaming import ChoiceCursor, RequestGroup


def _finish_reason(reason: str | None, called_tools: bool) -> str | None:
    return "tool_calls" if called_tools and reason == "stop" else reason


def chat_message(comp: CompletionOutput, thinking: bool, single_tool_call: bool = False) -> tuple[dict, str | None]:
    """(assistant message, finish_reason) of a finished completion."""
    parsed = parse_completion(comp.text, thinking)
    calls = parsed.tool_calls[:1] if single_tool_call else parsed.tool_calls
    msg = {"role": "assistant", "content": parsed.content if parsed.content or not calls else None,
           "reasoning_content": parsed.reasoning_content}
    if calls:
        msg["tool_calls"] = calls
    return msg, _finish_reason(comp.finish_reason, bool(calls))


def chat_choice(tokenizer, index: int, comp: CompletionOutput, thinking: bool, top_logprobs: int | None,
                single_tool_call: bool = False) -> dict:
    msg, reason = chat_message(comp, thinking, single_tool_call)
    lp = chat_logprobs(tokenizer, comp.logprobs or [], top_logprobs) if top_logprobs is not None else None
    return {"index": index, "message": msg, "logprobs": lp, "finish_reason": reason}


class ChatChoiceStream:
    """Deltas of one streamed choice: text released by the cursor goes through the parser;
    a tool call is sent whole, in one delta, once its DSML block has closed."""

    def __init__(self, index: int, stop: list[str], thinking: bool, single_tool_call: bool = False):
        self.index, self.single = index, single_tool_call
        self.cursor = ChoiceCursor(stop)
        self.parser = StreamingParser(thinking)
        self.num_calls = 0

    def delta(self, comp: CompletionOutput) -> tuple[dict, list, str | None] | None:
        """(delta, new logprob entries, finish_reason) or None when there is nothing to send."""
        step = self.cursor.advance(comp)
        if step is None:
            return None
        got = self.parser.push(step.text)
        reasoning, content = got.reasoning, got.content
        if step.finish_reason is not None:
            rest = self.parser.flush()
            reasoning, content = reasoning + rest.reasoning, content + rest.content
        calls = self.parser.take_tool_calls()
        if self.single:
            calls = calls[:max(0, 1 - self.num_calls)]
        delta = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [{"index": self.num_calls + j, **c} for j, c in enumerate(calls)]
            self.num_calls += len(calls)
        reason = _finish_reason(step.finish_reason, self.num_calls > 0)
        if not delta and not step.logprobs and reason is None:
            return None
        return delta, step.logprobs, reason


class _Stream:
    def __init__(self, state: ServerState, req: ChatCompletionRequest, prompt_len: int, stop: list[str],
                 thinking: bool, rid: str, created: int):
        self.state, self.prompt_len = state, prompt_len
        single = req.parallel_tool_calls is False
        self.choices = [ChatChoiceStream(i, stop, thinking, single) for i in range(req.n)]
        self.top = (req.top_logprobs or 0) if req.logprobs else None
        self.final: RequestOutput | None = None
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_name}

    def _chunk(self, choice: dict) -> dict:
        chunk = {**self.base, "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def head(self) -> list[dict]:
        return [self._chunk({"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}) for c in self.choices]

    def on_output(self, _k: int, out: RequestOutput) -> list[dict]:
        self.final = out
        chunks = []
        for comp in out.outputs:
            got = self.choices[comp.index].delta(comp)
            if got is None:
                continue
            delta, entries, reason = got
            lp = chat_logprobs(self.state.tokenizer, entries, self.top) if self.top is not None else None
            chunks.append(self._chunk({"index": comp.index, "delta": delta, "logprobs": lp,
                                       "finish_reason": reason}))
        return chunks

    def tail(self) -> list[dict]:
        if not self.include_usage:
            return []
        return [{**self.base, "choices": [], "usage": usage([self.prompt_len], [self.final])}]


async def create_chat_completion(state: ServerState, request: Request, req: ChatCompletionRequest) -> Response:
    state.check_overload()
    check_n(req, state.max_n)
    prompt, thinking = chat_prompt(req, state.tokenizer, state.vocab_size, state.max_model_len)
    params = chat_params(req)
    check_context([prompt], params.max_tokens, "max_completion_tokens" if req.max_completion_tokens is not None
                  else "max_tokens", state.max_model_len)
    rid, created = new_id("chatcmpl"), int(time.time())
    group = RequestGroup(state.engine, [prompt.ids], params, rid, state.metrics)
    if req.stream:
        first = await prime(group)
        s = _Stream(state, req, len(prompt.ids), params.stop, thinking, rid, created)
        return event_stream(group, first, s.head(), s.on_output, s.tail)
    try:
        (final,) = await collect(group, request)
    except ClientGone:
        return Response(status_code=499)
    top = (req.top_logprobs or 0) if req.logprobs else None
    single = req.parallel_tool_calls is False
    choices = [chat_choice(state.tokenizer, c.index, c, thinking, top, single) for c in final.outputs]
    body = {"id": rid, "object": "chat.completion", "created": created, "model": state.model_name,
            "choices": choices, "usage": usage([len(prompt.ids)], [final])}
    if req.prompt_logprobs is not None:  # vLLM puts them beside the choices
        body["prompt_logprobs"] = vllm_prompt_logprobs(state.tokenizer, final.prompt_logprobs, final.prompt_ranks)
    return JSONResponse(body)
