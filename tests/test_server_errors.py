"""Every way a request can be refused (400, 401, 404, 503), in OpenAI's error shape, and the
fields that are ignored or accepted rather than refused."""
import pytest

from engine.server.app import build_app
from server_util import MODEL, MSGS, WEATHER, assert_error, chat, client, complete, post, run
from server_util import app, llm  # noqa: F401  (module fixtures)

BAD_COMPLETIONS = [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -3}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"), ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"n": 0}, "n"), ({"logprobs": 21}, "logprobs"),
    ({"top_k": -2}, "top_k"), ({"min_p": 2}, "min_p"), ({"presence_penalty": 3}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"stop": [""]}, "stop"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"max_tokens": "many"}, "max_tokens"), ({"prompt": []}, "prompt"), ({"prompt": [[]]}, "prompt"),
    ({"prompt": [10 ** 9]}, "prompt"), ({"prompt": [1.5, "a"]}, "prompt"), ({"prompt": None}, "prompt"),
    ({"prompt": list(range(1, 1025))}, "prompt"),  # the context is 1024 tokens
]


@pytest.mark.parametrize("patch,param", BAD_COMPLETIONS)
def test_completion_bad_values_are_400(app, patch, param):
    assert_error(post(app, "/v1/completions", {"model": MODEL, "prompt": "Hi", **patch}), 400, param)


BAD_CHAT = [
    ({"messages": []}, "messages"), ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "assistant", "content": "x"}]}, "messages"), ({"messages": "hi"}, "messages"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"n": -1}, "n"), ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"chat_template_kwargs": {"thinking": "yes"}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"thinking": True, "reasoning_effort": "extreme"}}, "reasoning_effort"),
    ({"messages": [{"role": "user", "content": "hello " * 1100}]}, "messages"),
]


@pytest.mark.parametrize("patch,param", BAD_CHAT)
def test_chat_bad_values_are_400(app, patch, param):
    assert_error(post(app, "/v1/chat/completions", {"model": MODEL, "messages": MSGS, **patch}), 400, param)


UNSUPPORTED = [
    ("/v1/completions", {"logit_bias": {"11": 5}}, "logit_bias"), ("/v1/completions", {"suffix": "end"}, "suffix"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"store": True}, "store"),
    ("/v1/chat/completions", {"logit_bias": {"11": 5}}, "logit_bias"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"tool_choice": "required", "tools": [WEATHER]}, "tool_choice"),
    ("/v1/chat/completions", {"tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                              "tools": [WEATHER]}, "tool_choice"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"audio": {"voice": "alloy"}}, "audio"),
    ("/v1/chat/completions", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("/v1/chat/completions", {"web_search_options": {}}, "web_search_options"),
]


@pytest.mark.parametrize("path,patch,param", UNSUPPORTED)
def test_unsupported_fields_are_refused_by_name(app, path, patch, param):
    base = {"prompt": "Hi"} if path == "/v1/completions" else {"messages": MSGS}
    err = assert_error(post(app, path, {"model": MODEL, **base, **patch}), 400, param)
    assert "support" in err["message"]


def test_unknown_fields_ignored_and_harmless_known_ones_accepted(app):
    extra = {"user": "u-1", "not_a_field": {"x": 1}, "metadata": {"k": "v"}, "service_tier": "auto",
             "best_of": 1, "response_format": {"type": "text"}, "parallel_tool_calls": True, "store": False}
    assert complete(app, prompt="Hi", max_tokens=1, **{k: extra[k] for k in ("user", "not_a_field", "best_of")})
    assert chat(app, max_tokens=1, **extra)["choices"]


def test_malformed_bodies_are_400(app):
    async def go():
        async with client(app) as c:
            return [await c.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}),
                    await c.post("/v1/chat/completions", content=b"[1, 2]"),
                    await c.post("/v1/completions", content=b"\xff\xfe"),
                    await c.post("/v1/chat/completions", json={"model": MODEL})]
    for r in run(go()):
        assert_error(r, 400)


def test_unknown_model_and_route_are_404(app):
    assert_error(post(app, "/v1/completions", {"model": "gpt-4", "prompt": "Hi"}), 404, "model")
    err = assert_error(post(app, "/v1/chat/completions", {"model": "gpt-4", "messages": MSGS, "stream": True}),
                       404, "model")
    assert err["code"] == "model_not_found"
    assert_error(post(app, "/v1/nothing", {}), 404)


def test_api_key(app, llm):
    keyed = build_app(llm, MODEL, api_key="sk-secret")  # shares the running engine loop
    assert keyed.state.server.engine is app.state.server.engine

    async def go():
        async with client(keyed) as c:
            return [await c.get("/v1/models"),
                    await c.get("/v1/models", headers={"Authorization": "Bearer wrong"}),
                    await c.post("/v1/completions", content=b"{bad json"),  # 401 before 400
                    await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                                 headers={"Authorization": "Bearer sk-secret"}),
                    await c.get("/health"), await c.get("/metrics")]
    none, wrong, bad_json, ok, health, metrics = run(go())
    for r in (none, wrong, bad_json):
        assert assert_error(r, 401)["code"] == "invalid_api_key"
    assert ok.status_code == 200 and health.status_code == 200 and metrics.status_code == 200


def test_overload_is_503(app, llm, monkeypatch):
    sched = llm.engine.scheduler
    monkeypatch.setattr(sched, "max_waiting", 0)  # every new request is over the limit
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    assert assert_error(post(app, "/v1/completions", body), 503)["code"] == "overloaded"
    # and when only the engine notices (the request passed the server's early check)
    monkeypatch.setattr(app.state.server, "check_overload", lambda: None)
    assert_error(post(app, "/v1/completions", body), 503)
    assert_error(post(app, "/v1/chat/completions", {"model": MODEL, "messages": MSGS, "stream": True}), 503)
    monkeypatch.undo()
    assert complete(app, prompt="Hi", max_tokens=1)["choices"]
