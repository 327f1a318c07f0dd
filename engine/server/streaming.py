"""Driving engine requests from a handler: several requests as one stream, per-choice deltas, SSE.

A handler never steps the model: it awaits outputs the engine thread pushes (AsyncEngine),
so the event loop stays free for every other connection.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from ..async_engine import AsyncEngine
from ..core import CompletionOutput, RequestOutput
from ..sampler import SamplingParams

DONE = "data: [DONE]\n\n"


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


_END = object()


class RequestGroup:
    """The engine requests behind one HTTP request (one per prompt), read as one stream of
    (prompt index, cumulative RequestOutput). `close()` aborts whatever is unfinished."""

    def __init__(self, engine: AsyncEngine, prompts: list[list[int]], params: SamplingParams, base_id: str,
                 metrics=None):
        self._q: asyncio.Queue = asyncio.Queue()
        self._left = len(prompts)
        self._metrics = metrics
        self.request_ids = [f"{base_id}-{k}" for k in range(len(prompts))]
        self._tasks = [asyncio.create_task(self._pump(k, engine.generate(p, params, rid)))
                       for k, (p, rid) in enumerate(zip(prompts, self.request_ids))]

    async def _pump(self, k: int, gen):
        # One task per request, so several prompts advance together; cancelling the task
        # closes the engine iterator, which aborts the request and frees its cache.
        try:
            async for out in gen:
                if self._metrics is not None:
                    self._metrics.observe(out)
                self._q.put_nowait((k, out))
        except Exception as e:
            self._q.put_nowait((k, e))
        finally:
            self._q.put_nowait((k, _END))

    def __aiter__(self):
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        while self._left:
            k, item = await self._q.get()
            if item is _END:
                self._left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                return k, item
        raise StopAsyncIteration

    def close(self):
        # synchronous on purpose: it runs in finally blocks of cancelled handlers
        for t in self._tasks:
            t.cancel()
        if self._metrics is not None:
            for rid in self.request_ids:
                self._metrics.forget(rid)


@dataclass
class Step:
    text: str                        # newly released text
    logprobs: list[dict[int, float]]  # entries of the tokens new since the last step
    finish_reason: str | None        # set once, on the choice's last step


class ChoiceCursor:
    """What one choice has newly produced since the last look.

    The engine cuts a stop string from the text only when it completes, so while a
    choice runs the last (longest stop - 1) characters are held back: a stop string is
    never streamed, and the streamed text is always a prefix of the final one.
    """

    def __init__(self, stop: list[str]):
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.sent_chars = 0
        self.sent_tokens = 0
        self.done = False

    def advance(self, comp: CompletionOutput) -> Step | None:
        if self.done:
            return None
        finished = comp.finish_reason is not None
        end = len(comp.text) if finished else max(self.sent_chars, len(comp.text) - self.hold)
        text = comp.text[self.sent_chars:end]
        lps = (comp.logprobs or [])[self.sent_tokens:]
        self.sent_chars, self.sent_tokens = end, len(comp.token_ids)
        self.done = finished
        if not text and not lps and not finished:
            return None
        return Step(text, lps, comp.finish_reason)
