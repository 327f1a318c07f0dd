"""POST /v1/completions: one engine request per prompt, n samples each; choice index
= prompt index * n + sample index, as OpenAI numbers them."""
from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..core import CompletionOutput, RequestOutput
from .inputs import Prompt, completion_params, completion_prompts
from .logprobs import completion_logprobs
from .schemas import CompletionRequest
from .serving import ClientGone, collect, event_stream, prime, usage
from .state import ServerState, new_id
from .streaming import ChoiceCursor, RequestGroup


def _echo_text(state: ServerState, p: Prompt) -> str:
    return p.text if p.text is not None else state.tokenizer.decode(p.ids, skip_special_tokens=True)


def completion_choice(tokenizer, index: int, comp: CompletionOutput, echo: str, logprobs: bool) -> dict:
    lp = completion_logprobs(tokenizer, comp.logprobs or [])[0] if logprobs else None
    return {"index": index, "text": echo + comp.text, "logprobs": lp, "finish_reason": comp.finish_reason}


class _Stream:
    """Chunks of a streamed completion, one per choice that has news."""

    def __init__(self, state: ServerState, req: CompletionRequest, prompts: list[Prompt], stop: list[str],
                 rid: str, created: int):
        self.state, self.req, self.prompts, self.n = state, req, prompts, req.n
        self.cursors = [ChoiceCursor(stop) for _ in range(len(prompts) * req.n)]
        self.echo = [_echo_text(state, p) if req.echo else "" for p in prompts for _ in range(req.n)]
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
            lp = None
            if self.req.logprobs is not None:
                lp, self.offsets[index] = completion_logprobs(self.state.tokenizer, step.logprobs,
                                                              self.offsets[index])
            chunks.append(self._chunk([{"index": index, "text": text, "logprobs": lp,
                                        "finish_reason": step.finish_reason}]))
        return chunks

    def tail(self) -> list[dict]:
        if not self.include_usage:
            return []
        return [{**self.base, "choices": [], "usage": usage([len(p.ids) for p in self.prompts], self.finals)}]


async def create_completion(state: ServerState, request: Request, req: CompletionRequest) -> Response:
    state.check_overload()
    prompts = completion_prompts(req, state.tokenizer, state.vocab_size, state.max_model_len)
    params = completion_params(req)
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
    choices = [completion_choice(state.tokenizer, k * req.n + c.index, c,
                                 _echo_text(state, p) if req.echo else "", req.logprobs is not None)
               for k, (p, out) in enumerate(zip(prompts, finals)) for c in out.outputs]
    return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                         "choices": choices, "usage": usage([len(p.ids) for p in prompts], finals)})
