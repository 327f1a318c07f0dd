"""Fuzzing the request models against the app in process (hypothesis): whatever a client sends,
the answer is never a 5xx and always comes (a per-request timeout), and errors have OpenAI's
shape. Bounded: few examples, small max_tokens, a wall-clock budget for the whole run."""
import asyncio
import json
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import LLM
from engine.server.app import build_app
from engine.server.state import Limits
from server_util import MODEL, client

BUDGET_S = 40.0
_start = []

junk = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.floats(allow_nan=True),
                 st.text(max_size=8), st.lists(st.integers(-3, 5), max_size=3), st.dictionaries(st.text(max_size=3),
                                                                                                 st.integers(), max_size=2))
small_int = st.one_of(st.integers(-2, 3), junk)
text = st.text(max_size=12)  # includes lone surrogates: sent as \\udXXX escapes
ids = st.lists(st.integers(-5, 129300), max_size=6)
prompt = st.one_of(text, st.lists(text, max_size=3), ids, st.lists(ids, max_size=3), junk)
content = st.one_of(text, st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", 3]),
                                                          "text": st.one_of(text, junk)}), max_size=2), junk)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", "x", 1])},
                                optional={"content": content, "tool_call_id": junk | text,
                                          "tool_calls": st.lists(st.fixed_dictionaries(
                                              {"id": junk | text, "function": st.fixed_dictionaries(
                                                  {"name": junk | text}, optional={"arguments": junk | text})}),
                                              max_size=2) | junk})
common = {"model": st.sampled_from([MODEL, "other"]) | junk, "max_tokens": small_int, "n": small_int,
          "temperature": st.floats(-1, 3) | junk, "top_p": junk, "top_k": small_int, "seed": junk,
          "stop": st.lists(text, max_size=2) | junk, "stream": st.booleans() | junk, "logprobs": small_int,
          "prompt_logprobs": small_int, "stream_options": st.fixed_dictionaries({"include_usage": junk}) | junk,
          "presence_penalty": junk, "best_of": small_int}
completion = st.fixed_dictionaries({"prompt": prompt}, optional={**common, "echo": st.booleans() | junk})
# chat's max_tokens is always there and never null: unset, a chat generates up to the context
chat = st.fixed_dictionaries({"messages": st.lists(message, max_size=3) | junk,
                              "max_tokens": st.integers(-2, 3) | st.text(max_size=3)},
                             optional={**{k: v for k, v in common.items() if k != "max_tokens"}, "tools": st.lists(junk, max_size=2) | junk, "top_logprobs": small_int,
                                       "tool_choice": junk, "chat_template_kwargs": junk})
tokenize = st.fixed_dictionaries({}, optional={"prompt": text | junk, "messages": st.lists(message, max_size=2),
                                               "tokens": ids | junk, "add_special_tokens": junk})
routes = st.one_of(st.tuples(st.just("/v1/completions"), completion), st.tuples(st.just("/v1/chat/completions"), chat),
                   st.tuples(st.sampled_from(["/tokenize", "/detokenize"]), tokenize))


@pytest.fixture(scope="module")
def app(tiny_ckpt):
    llm = LLM(tiny_ckpt("tiny", 0), device="cpu", dtype=torch.float32, max_num_seqs=4, numerics="plain")
    app = build_app(llm, MODEL, limits=Limits(max_n=4, max_request_seqs=8))
    yield app
    app.state.server.engine.shutdown()


def _send(app, path: str, raw: bytes):
    async def go():
        async with client(app) as c:
            return await asyncio.wait_for(c.post(path, content=raw, headers={"content-type": "application/json"}), 30)
    return asyncio.run(go())


def _check(r):
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.endswith("data: [DONE]\n\n")
        for part in r.text.split("\n\n")[:-2]:
            assert "error" not in json.loads(part[6:]) or part.count('"code"'), part


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(route=routes)
def test_fuzz_request_models(app, route):
    if not _start:
        _start.append(time.monotonic())
    if time.monotonic() - _start[0] > BUDGET_S:
        return  # the budget is spent: the remaining examples are skipped, not failed
    path, body = route
    _check(_send(app, path, json.dumps(body).encode()))


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(raw=st.binary(max_size=40) | st.text(max_size=40).map(lambda s: s.encode("utf-8", "surrogatepass")),
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]))
def test_fuzz_raw_bytes(app, raw, path):
    r = _send(app, path, raw)
    assert r.status_code == 400, r.text
