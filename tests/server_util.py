"""Shared by the ASGI-level server tests: module fixtures (one LLM per test module) and
small request helpers over httpx's ASGI transport."""
import asyncio
import json

import httpx
import pytest
import torch

from engine import LLM
from engine.server.app import build_app

MODEL = "tiny-test"
MSGS = [{"role": "user", "content": "What is 2+2?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(tiny_ckpt("tiny", 0), device="cpu", dtype=torch.float32, max_num_seqs=4, numerics="plain")


@pytest.fixture(scope="module")
def app(llm):
    app = build_app(llm, MODEL)
    yield app
    app.state.server.engine.shutdown()


def run(coro):
    return asyncio.run(coro)


def client(app, **kw):
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60, **kw)


async def _post(app, path, body, **kw):
    async with client(app) as c:
        return await c.post(path, json=body, **kw)


def post(app, path, body):
    return run(_post(app, path, body))


def complete(app, **body):
    r = post(app, "/v1/completions", {"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


def chat(app, **body):
    r = post(app, "/v1/chat/completions", {"model": MODEL, "messages": MSGS, **body})
    assert r.status_code == 200, r.text
    return r.json()


def events(text: str) -> list:
    """SSE body -> parsed chunks; checks the framing and that [DONE] comes last, once."""
    assert text.endswith("data: [DONE]\n\n")
    parts = [p for p in text.split("\n\n") if p]
    assert all(p.startswith("data: ") for p in parts) and parts.count("data: [DONE]") == 1
    return [json.loads(p[6:]) for p in parts[:-1]]


def stream(app, path, body) -> list:
    r = post(app, path, {"model": MODEL, "stream": True, **body})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    return events(r.text)


def assert_error(r, status, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def wait_idle(llm, timeout=10.0):
    async def go():
        for _ in range(int(timeout / 0.02)):
            if not llm.engine.has_unfinished():
                return True
            await asyncio.sleep(0.02)
        return False
    return run(go())


