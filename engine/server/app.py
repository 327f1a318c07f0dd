"""The FastAPI app: routes, API key, error bodies, metrics. HTTP only; the engine does the work.

Bodies are parsed by hand rather than by FastAPI so the order of checks is the client's
contract: API key (401), then size (413), JSON and fields (400), then model name (404).
"""
from __future__ import annotations

import logging
import secrets
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from ..async_engine import AsyncEngine
from . import errors, openapi
from .body import read_json
from .chat_completions import create_chat_completion
from .completions import create_completion
from .errors import APIError, bad_request
from .metrics import MetricsMiddleware, ServerMetrics
from .schemas import ChatCompletionRequest, CompletionRequest
from .state import Limits, ServerState
from .tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize, tokenizer_info

log = logging.getLogger(__name__)

_BODY_ERRORS = (400, 401, 404, 413)


def build_app(llm, served_model_name: str | None = None, api_key: str | None = None,
              limits: Limits | None = None) -> FastAPI:
    """An app serving `llm`. Apps built over the same LLM share its one AsyncEngine loop;
    the app that started the loop stops it when it shuts down."""
    core = llm.engine
    owns = not isinstance(core.driver, AsyncEngine)
    engine = AsyncEngine(core) if owns else core.driver
    name = served_model_name or llm.model_path.name
    if llm.tokenizer.is_byte_level:
        llm.tokenizer.token_bytes(0)  # build the byte table (seconds) now, not in the first request
    state = ServerState(engine, llm.tokenizer, name, str(llm.model_path), llm.max_model_len,
                        llm.model.cfg.vocab_size, ServerMetrics(core), limits or Limits())

    @asynccontextmanager
    async def lifespan(_app):
        yield
        if owns:
            engine.shutdown()

    app = FastAPI(title="engine: DeepSeek-V4 OpenAI-compatible server", lifespan=lifespan,
                  docs_url=None, redoc_url=None)
    app.state.server = state
    errors.install(app)
    app.add_middleware(MetricsMiddleware, metrics=state.metrics)
    openapi.install(app, {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
                          "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest},
                    {"/v1/completions": _BODY_ERRORS + (503,), "/v1/chat/completions": _BODY_ERRORS + (503,),
                     "/tokenize": _BODY_ERRORS, "/detokenize": _BODY_ERRORS, "/v1/models": (401,),
                     "/v1/models/{model}": (401, 404), "/health": (503,), "/tokenizer_info": (401,)})

    def authorize(request: Request):
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")

    def check_model(model: str | None):
        if model is not None and model != state.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server has {state.model_name!r}",
                           "model", "model_not_found")

    async def parse(request: Request, schema: type[BaseModel]) -> BaseModel:
        authorize(request)
        body = await read_json(request, state.limits.max_body_bytes)
        try:
            req = schema.model_validate(body)
        except ValidationError as e:
            raise errors.from_validation(e.errors()) from None
        refused = req.unsupported()
        if refused is not None:
            raise bad_request(refused[1], refused[0])
        check_model(req.model)
        return req

    def model_card() -> dict:
        return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "engine",
                "root": state.model_root, "max_model_len": state.max_model_len}

    @app.get("/v1/models")
    async def list_models(request: Request):
        authorize(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str, request: Request):
        authorize(request)
        check_model(model)
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await create_completion(state, request, await parse(request, CompletionRequest))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await create_chat_completion(state, request, await parse(request, ChatCompletionRequest))

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        return tokenize(state, await parse(request, TokenizeRequest))

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        return detokenize(state, await parse(request, DetokenizeRequest))

    @app.get("/tokenizer_info")
    async def tokenizer_info_route(request: Request):
        authorize(request)
        return tokenizer_info(state)

    @app.get("/health")
    async def health():
        if engine.error is not None:
            return JSONResponse(errors.error_body(503, f"the engine loop died: {engine.error!r}"), status_code=503)
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        """Prometheus text exposition format."""
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
