"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` for every failure.

Clients (the official SDKs included) read `error.message` and branch on the status code,
so nothing may leave the server as FastAPI's default 422 or a bare text 500.
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..async_engine import EngineDead, EngineStopped
from ..core import EngineOverloaded

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 503: "server_error", 500: "server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        return JSONResponse(self.body(), status_code=self.status, headers={**headers, **self.headers})


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def from_engine_error(e: BaseException) -> APIError:
    """What a request's failure inside the engine means to its client."""
    if isinstance(e, EngineOverloaded):
        return APIError(503, f"the server is overloaded: {e}", code="overloaded")
    if isinstance(e, EngineStopped):
        return APIError(503, str(e), code="shutting_down")
    if isinstance(e, EngineDead):
        return APIError(500, str(e), code="engine_dead")
    if isinstance(e, ValueError):  # input the engine refused (checked there too, e.g. KV cache size)
        return bad_request(str(e))
    log.error("request failed in the engine", exc_info=e)
    return APIError(500, f"internal error: {type(e).__name__}")


def from_validation(errors: list[dict]) -> APIError:
    """A 400 naming the first offending field of a pydantic error list."""
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = loc[0] if loc else None
    where = ".".join(loc)
    msg = first.get("msg", "invalid value")
    if first.get("type") == "json_invalid":
        return bad_request(f"request body is not valid JSON: {msg}")
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return bad_request(f"{where}: {msg}{more}" if where else msg + more, param)


def install(app: FastAPI):
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, e: RequestValidationError):
        return from_validation(list(e.errors())).response()

    @app.exception_handler(ValidationError)
    async def _validation(_: Request, e: ValidationError):
        return from_validation(e.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException):
        # keep Starlette's headers: a 405 must say which methods are allowed (Allow)
        return APIError(e.status_code, str(e.detail), headers=e.headers).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        # only ever a bug: logged with its traceback; this request fails, the server goes on
        log.error("unhandled error in %s %s", request.method, request.url.path, exc_info=e)
        return APIError(500, f"internal error: {type(e).__name__}").response()
