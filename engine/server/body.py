"""Reading a request body: bounded in size, valid UTF-8, JSON, an object.

Parsed by hand rather than by FastAPI so the order of checks is the client's contract
(API key first, then this), and so nothing a client can send reaches a handler as an
exception: a body past the limit is a 413, bad bytes or bad JSON a 400."""
from __future__ import annotations

import json

from fastapi import Request

from .errors import APIError, bad_request


async def read_json(request: Request, limit: int) -> dict:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:  # a chunked body that lied or said nothing: stop reading it here
            raise _too_large(limit)
        chunks.append(chunk)
    try:
        text = b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"request body is not valid UTF-8: {e}") from None
    try:
        body = json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, int past 4300 digits, deep nesting
        raise bad_request(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    try:  # "\udcff" escapes decode to lone surrogates, which no tokenizer or response can hold
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request("request body holds a lone UTF-16 surrogate (\\ud800-\\udfff): not valid Unicode") from None
    except (ValueError, RecursionError) as e:
        raise bad_request(f"request body is not valid JSON: {e}") from None
    return body


def _too_large(limit: int) -> APIError:
    return APIError(413, f"request body is larger than this server's limit of {limit} bytes", code="body_too_large")
