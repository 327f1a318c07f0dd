"""POST /v1/completions: one engine request per prompt, n samples each; choice index
= prompt index * n + sample index, as OpenAI numbers them.

echo repeats the prompt before the completion; with logprobs it also gives each prompt
token's logprob (computed in the prefill), which is how lm-eval scores loglikelihood tasks."""
from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..core import CompletionOutput, RequestOutput
from .inputs import Prompt, check_context, check_n, completion_params, completion_prompts
from .logprobs import completion_logprobs, echo_entries, vllm_prompt_logprobs
from .schemas import CompletionRequest
from .serving import ClientGone, collect, event_stream, prime, usage
from .state import ServerState, new_id
from .streaming import ChoiceCursor, RequestGroup


def _echo_text(state: ServerState, p: Prompt) -> str:
    return p.text if p.text is not None else state.tokenizer.decode(p.ids, skip_special_tokens=True)


def completion_choice(tokenizer, index: int, comp: CompletionOutput, echo: str, logprobs: bool,
                      prompt_entries: list | None = None) -> dict:
    """prompt_entries: the echoed prompt's logprob entries, put before the completion's."""
    entries = (prompt_entries or []) + (comp.logprobs or [])
    lp = completion_logprobs(tokenizer, entries)[0] if logprobs else None
    return {"index": index, "text": echo + comp.text, "logprobs": lp, "finish_reason": comp.finish_reason}


def _prompt_parts(state: ServerState, req: CompletionRequest, out: RequestOutput) -> tuple[list, dict]:
    """(echoed prompt logprob entries, extra choice fields) of one prompt's output."""
    entries = echo_entries(out.prompt_token_ids, out.prompt_logprobs) if req.echo and req.logprobs is not None else []
    extra = {}
    if req.prompt_logprobs is not None:
        extra["prompt_logprobs"] = vllm_prompt_logprobs(state.tokenizer, out.prompt_logprobs, out.prompt_ranks)
    return entries, extra


class _Stream:
    """Chunks of a streamed completion, one per choice that has news. A choice's first chunk
    carries the echoed prompt (text and logprobs), as vLLM streams it."""

    def __init__(self, state: ServerState, req: CompletionRequest, prompts: list[Prompt], stop: list[str],
                 rid: str, created: int):
        self.state, self.req, self.prompts, self.n = state, req, prompts, req.n
        self.cursors = [ChoiceCursor(stop) for _ in range(len(prompts) * req.n)]
        self.echo = [_echo_text(state, p) if req.echo else "" for p in prompts for _ in range(req.n)]
        self.first = [True] * len(self.cursors)
        self.offsets = [0] * len(self.cursors)
        self.finals: list[RequestOutput | None] = [None] * len(prompts)
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.base = {"id": rid, "object": "text_completion", "created": created, "model": state.model_name}

    def _chunk(self, choices: list[dict]) -> dict:
        chunk = {**self.base, "choices": choices}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def on_output(self, k: int, out: RequestOutput) -> list[dict]:
        self.finals[k] = out
        chunks = []
        for comp in out.outputs:
            index = k * self.n + comp.index
            step = self.cursors[index].advance(comp)
            if step is None:
                continue
            text, self.echo[index] = self.echo[index] + step.text, ""
            entries, extra = _prompt_parts(self.state, self.req, out) if self.first[index] else ([], {})
            self.first[index] = False
            lp = None
            if self.req.logprobs is not None:
                lp, self.offsets[index] = completion_logprobs(self.state.tokenizer, entries + step.logprobs,
                                                              self.offsets[index])
            chunks.append(self._chunk([{"index": index, "text": text, "logprobs": lp,
                                        "finish_reason": step.finish_reason, **extra}]))
        return chunks

    def tail(self) -> list[dict]:
        if not self.include_usage:
            return []
        return [{**self.base, "choices": [], "usage": usage([len(p.ids) for p in self.prompts], self.finals)}]


async def create_completion(state: ServerState, request: Request, req: CompletionRequest) -> Response:
    state.check_overload()
    check_n(req, state.max_n)
    prompts = completion_prompts(req, state.tokenizer, state.vocab_size, state.max_model_len, state.max_request_seqs)
    params = completion_params(req)
    check_context(prompts, params.max_tokens, "max_tokens", state.max_model_len)
    rid, created = new_id("cmpl"), int(time.time())
    group = RequestGroup(state.engine, [p.ids for p in prompts], params, rid, state.metrics)
    if req.stream:
        first = await prime(group)
        s = _Stream(state, req, prompts, params.stop, rid, created)
        return event_stream(group, first, [], s.on_output, s.tail)
    try:
        finals = await collect(group, request)
    except ClientGone:
        return Response(status_code=499)
    choices = []
    for k, (p, out) in enumerate(zip(prompts, finals)):
        entries, extra = _prompt_parts(state, req, out)
        for c in out.outputs:
            choices.append({**completion_choice(state.tokenizer, k * req.n + c.index, c,
                                                _echo_text(state, p) if req.echo else "",
                                                req.logprobs is not None, entries), **extra})
    return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                         "choices": choices, "usage": usage([len(p.ids) for p in prompts], finals)})
