"""/openapi.json that describes the API as served.

Handlers parse their bodies by hand (see body.py), so FastAPI would document no request
body and a 422 no route ever answers. This fills in the request bodies from the pydantic
models and the OpenAI error responses each route can give, and drops the 422s."""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"
_WHY = {400: "Invalid request (bad JSON, bad field value, unsupported field)", 401: "Missing or wrong API key",
        404: "Unknown model or route", 405: "Method not allowed", 413: "Request body too large",
        503: "Overloaded or the engine is down"}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def _add_schema(components: dict, model: type[BaseModel]) -> dict:
    schema = model.model_json_schema(ref_template=_REF)
    components.update(schema.pop("$defs", {}))
    components[model.__name__] = schema
    return {"$ref": _REF.format(model=model.__name__)}


def install(app: FastAPI, bodies: dict[str, type[BaseModel]], errors: dict[str, tuple[int, ...]]):
    """bodies: POST path -> request model; errors: path -> the error statuses it answers."""

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = spec.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        error_ref = _add_schema(components, ErrorResponse)
        for path, model in bodies.items():
            spec["paths"][path]["post"]["requestBody"] = {
                "required": True, "content": {"application/json": {"schema": _add_schema(components, model)}}}
        for path, ops in spec["paths"].items():
            for op in ops.values():
                responses = op.setdefault("responses", {})
                responses.pop("422", None)
                for status in errors.get(path, ()):
                    responses[str(status)] = {"description": _WHY[status],
                                              "content": {"application/json": {"schema": error_ref}}}
        app.openapi_schema = spec
        return spec

    app.openapi = openapi
