"""The two ways a handler answers: one JSON body when all requests finish, or an SSE stream.

A client that goes away is noticed either way: a stream is cancelled by Starlette when the
connection drops, a non-streamed request polls for the disconnect between outputs; both
close the RequestGroup, which aborts the engine requests and frees their cache.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from ..core import RequestOutput
from .errors import from_engine_error
from .streaming import DONE, RequestGroup, sse

_DISCONNECT_POLL_S = 0.25


class ClientGone(Exception):
    pass


async def collect(group: RequestGroup, request: Request) -> list[RequestOutput]:
    """Final output of every request in the group (raises APIError or ClientGone)."""
    finals: list[RequestOutput | None] = [None] * len(group.request_ids)
    next_poll = time.monotonic() + _DISCONNECT_POLL_S
    try:
        async for k, out in group:
            finals[k] = out
            if time.monotonic() >= next_poll:
                next_poll = time.monotonic() + _DISCONNECT_POLL_S
                if await request.is_disconnected():
                    raise ClientGone
    except ClientGone:
        raise
    except Exception as e:
        raise from_engine_error(e) from None
    finally:
        group.close()
    return finals


async def prime(group: RequestGroup) -> tuple[int, RequestOutput]:
    """The first output, before any header is sent: a request the engine refuses (overload,
    a prompt too big for the cache) still gets its status code rather than a 200 stream."""
    try:
        return await group.__anext__()
    except Exception as e:
        group.close()
        raise from_engine_error(e) from None


def event_stream(group: RequestGroup, first: tuple[int, RequestOutput], head: list[dict],
                 on_output: Callable[[int, RequestOutput], list[dict]],
                 tail: Callable[[], list[dict]]) -> StreamingResponse:
    """SSE: head chunks, the chunks of every output, tail chunks, [DONE]. An error after the
    headers went out can only be told in-band, as an OpenAI error object, then [DONE]."""

    async def body():
        try:
            for chunk in head:
                yield sse(chunk)
            for chunk in on_output(*first):
                yield sse(chunk)
            async for k, out in group:
                for chunk in on_output(k, out):
                    yield sse(chunk)
            for chunk in tail():
                yield sse(chunk)
            yield DONE
        except Exception as e:
            yield sse(from_engine_error(e).body())
            yield DONE
        finally:
            group.close()

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def usage(prompt_lens: list[int], finals: list[RequestOutput | None]) -> dict:
    done = sum(len(c.token_ids) for out in finals if out is not None for c in out.outputs)
    prompt = sum(prompt_lens)
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}
