"""Issue 13's API for real clients, against the ASGI app (httpx, no sockets): prompt logprobs in
lm-eval's request shape checked against the model's own full forward, per-request limits, no 5xx
from any input, 405 with Allow, /tokenize and friends, and the OpenAPI spec."""
import logging

import httpx
import pytest
import torch

from engine import LLM
from engine.server.app import build_app
from engine.server.state import Limits
from server_util import MODEL, MSGS, assert_error, client, events, run

CTX = 1024


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    # chunk_size 8: a prompt's logprobs span several prefill chunks
    return LLM(tiny_ckpt("tiny", 0), device="cpu", dtype=torch.float32, max_num_seqs=4, numerics="plain",
               chunk_size=8)


@pytest.fixture(scope="module")
def app(llm):
    app = build_app(llm, MODEL, limits=Limits(max_n=8, max_request_seqs=16, max_body_bytes=1 << 20))
    yield app
    app.state.server.engine.shutdown()


def post(app, path, body, **kw):
    async def go():
        async with client(app) as c:
            return await c.post(path, json=body, **kw)
    return run(go())


def ok(r) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def full_logprobs(llm, ids) -> torch.Tensor:
    """log_softmax of a cache-free forward over the whole prompt: [S, V]."""
    return torch.log_softmax(llm.model(torch.tensor([ids]))[0].double(), dim=-1)


# ---------------------------------------------------------------- prompt logprobs (lm-eval)

def test_lm_eval_loglikelihood_shape(app, llm):
    """lm-eval's local-completions request: token-id prompts, echo, logprobs 1, max_tokens 1 and 0;
    one logprob per prompt token, equal to the model's own log-softmax at the position before."""
    ctx = llm.tokenizer.encode("The capital of France is", add_bos=True)
    cont = llm.tokenizer.encode(" Paris, a city on the Seine river")
    ids = ctx + cont  # 17 tokens: three prefill chunks of 8
    short = ids[:5]
    for max_tokens in (1, 0):
        out = ok(post(app, "/v1/completions", {"model": MODEL, "prompt": [ids, short], "max_tokens": max_tokens,
                                               "logprobs": 1, "echo": True, "temperature": 0}))
        assert [c["index"] for c in out["choices"]] == [0, 1]
        for choice, p in zip(out["choices"], (ids, short)):
            lp = choice["logprobs"]
            n = len(p) + max_tokens
            assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            assert lp["tokens"][:len(p)] == [llm.tokenizer.decode([t]) for t in p]
            assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
            want = full_logprobs(llm, p)
            for i in range(1, len(p)):
                got, ref = lp["token_logprobs"][i], want[i - 1, p[i]].item()
                assert abs(got - ref) <= 1e-4 * max(1.0, abs(ref)), (i, got, ref)
                top = lp["top_logprobs"][i]
                assert 1 <= len(top) <= 2 and lp["tokens"][i] in top
                best = want[i - 1].max().item()
                assert abs(max(top.values()) - best) <= 1e-4 * max(1.0, abs(best))
            if max_tokens == 0:
                assert choice["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 0
        # lm-eval's is_greedy / sum over the continuation works on this body
        lp = out["choices"][0]["logprobs"]
        cont_lps = lp["token_logprobs"][len(ctx):len(ids)]
        assert len(cont_lps) == len(cont) and all(v < 0 for v in cont_lps)


def test_echo_text_prompt_n_and_stream_agree(app, llm):
    body = {"model": MODEL, "prompt": "Hello world, how are you today my friend", "max_tokens": 3, "logprobs": 2,
            "echo": True, "temperature": 0, "n": 2, "ignore_eos": True}
    out = ok(post(app, "/v1/completions", body))
    ids = llm.tokenizer.encode(body["prompt"], add_bos=True)
    a, b = (c["logprobs"] for c in out["choices"])
    assert a["token_logprobs"][:len(ids)] == b["token_logprobs"][:len(ids)]  # one prompt, computed once
    assert out["choices"][0]["text"].startswith(body["prompt"])
    assert len(out["choices"][0]["logprobs"]["tokens"]) == len(ids) + 3
    r = post(app, "/v1/completions", {**body, "stream": True})
    chunks = events(r.text)
    merged = {}
    for c in chunks:
        for ch in c["choices"]:
            m = merged.setdefault(ch["index"], {"text": "", "tokens": [], "token_logprobs": []})
            m["text"] += ch["text"]
            m["tokens"] += ch["logprobs"]["tokens"]
            m["token_logprobs"] += ch["logprobs"]["token_logprobs"]
    for ch in out["choices"]:
        m = merged[ch["index"]]
        assert m["text"] == ch["text"] and m["tokens"] == ch["logprobs"]["tokens"]
        assert m["token_logprobs"][0] is None and ch["logprobs"]["token_logprobs"][0] is None
        assert m["token_logprobs"][1:] == pytest.approx(ch["logprobs"]["token_logprobs"][1:], rel=1e-5)


def test_vllm_prompt_logprobs_field(app, llm):
    ids = llm.tokenizer.encode("One two three four five six seven eight nine ten", add_bos=True)
    out = ok(post(app, "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 3}))
    plp = out["choices"][0]["prompt_logprobs"]
    assert out["choices"][0]["logprobs"] is None and plp[0] is None and len(plp) == len(ids)
    want = full_logprobs(llm, ids)
    for i in range(1, len(ids)):
        entry = plp[i][str(ids[i])]
        ref = want[i - 1, ids[i]].item()
        assert abs(entry["logprob"] - ref) <= 1e-4 * max(1.0, abs(ref))
        assert entry["rank"] == 1 + int((want[i - 1] > want[i - 1, ids[i]] + 1e-9).sum())
        assert 3 <= len(plp[i]) <= 4 and sorted(e["rank"] for t, e in plp[i].items() if t != str(ids[i]))[:3] == [1, 2, 3]
    chat = ok(post(app, "/v1/chat/completions", {"model": MODEL, "messages": MSGS, "max_tokens": 1,
                                                  "prompt_logprobs": 0}))
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


# ---------------------------------------------------------------- bounded requests

BOUNDS = [
    ({"n": 1e9}, "n"), ({"n": 100000}, "n"), ({"n": 9}, "n"), ({"best_of": 9, "n": 9}, "n"),
    ({"max_tokens": 10 ** 9}, "max_tokens"), ({"max_tokens": CTX}, "max_tokens"),
    ({"seed": 2 ** 63}, "seed"), ({"seed": -2 ** 63 - 1}, "seed"), ({"max_tokens": 0}, "max_tokens"),
    ({"prompt": ["a"] * 3, "n": 6}, "prompt"), ({"prompt": list(range(5, 5 + CTX))}, "prompt"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"), ({"echo": True, "logprobs": 21}, "logprobs"),
]


@pytest.mark.parametrize("patch,param", BOUNDS)
def test_limits_are_400_naming_the_param(app, patch, param):
    err = assert_error(post(app, "/v1/completions", {"model": MODEL, "prompt": "Hi", **patch}), 400, param)
    if param == "max_tokens" and patch["max_tokens"]:
        assert "maximum context length is 1024 tokens" in err["message"] and "input tokens" in err["message"]


def test_limits_on_chat_and_edges_accepted(app):
    assert_error(post(app, "/v1/chat/completions", {"model": MODEL, "messages": MSGS, "max_tokens": 10 ** 9}),
                 400, "max_tokens")
    assert_error(post(app, "/v1/chat/completions", {"model": MODEL, "messages": MSGS, "n": 10 ** 6}), 400, "n")
    assert ok(post(app, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "seed": 2 ** 63 - 1,
                                            "n": 2}))["choices"]
    big = {"model": MODEL, "prompt": "x" * (1 << 20)}
    assert assert_error(post(app, "/v1/completions", big), 413)["code"] == "body_too_large"


# ---------------------------------------------------------------- no 500 from input

RAW = [b'{"prompt": "\xed\xb3\xbf"}', b'{"prompt": "\\udcff"}', b"[" * 100000, b'{"max_tokens": 1' + b"1" * 5000 + b"}",
       b"", b"null", b'{"prompt": NaN, "max_tokens": Infinity}', b'{"prompt": ["x", 1], "temperature": NaN}']


@pytest.mark.parametrize("raw", RAW, ids=range(len(RAW)))
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_bad_bytes_are_400(app, path, raw):
    async def go():
        async with client(app) as c:
            return await c.post(path, content=raw, headers={"content-type": "application/json"})
    assert_error(run(go()), 400)


def _msgs(*extra):
    return [{"role": "user", "content": "Hi"}, *extra]


CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
BAD_TYPES = [
    {"messages": _msgs({"role": "assistant", "content": None, "tool_calls": [CALL]},
                       {"role": "tool", "content": "r", "tool_call_id": {"a": 1}})},
    {"messages": _msgs({"role": "assistant", "content": None, "tool_calls": [CALL]},
                       {"role": "tool", "content": "r", "tool_call_id": ["x"]})},
    {"messages": _msgs({"role": "assistant", "content": None, "tool_calls": [{**CALL, "id": 7}]},
                       {"role": "user", "content": "go"})},
    {"messages": _msgs({"role": "assistant", "content": None, "tool_calls": [{**CALL, "id": {"x": 1}}]},
                       {"role": "user", "content": "go"})},
    {"messages": [{"role": "user", "content": 5}]}, {"messages": [{"role": "user", "content": {"text": "x"}}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, {"messages": [{"role": 1}]},
    {"messages": [{"content": "x"}]}, {"messages": MSGS, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": [1, 2]}}]},
    {"messages": MSGS, "tools": [{"type": "function", "function": {"name": {"x": 1}}}]},
    {"messages": MSGS, "tools": "all"},
]


@pytest.mark.parametrize("body", BAD_TYPES, ids=range(len(BAD_TYPES)))
def test_mistyped_chat_fields_are_400(app, body):
    assert_error(post(app, "/v1/chat/completions", {"model": MODEL, "max_tokens": 1, **body}), 400)


def test_405_has_allow_and_unknown_route_404(app):
    async def go():
        async with client(app) as c:
            return [await c.get("/v1/completions"), await c.delete("/v1/models"), await c.get("/v2/nothing")]
    get, delete, missing = run(go())
    assert_error(get, 405)
    assert get.headers["allow"] == "POST" and delete.headers["allow"] == "GET"
    assert_error(missing, 404)


def test_a_bug_is_a_logged_500_and_the_server_goes_on(app, monkeypatch, caplog):
    import engine.server.app as app_module

    def broken(_state):
        raise KeyError("a bug")
    monkeypatch.setattr(app_module, "tokenizer_info", broken)

    async def go():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return await c.get("/tokenizer_info")
    with caplog.at_level(logging.ERROR):
        r = run(go())
    assert assert_error(r, 500)["type"] == "server_error"
    assert any(rec.exc_info for rec in caplog.records)
    monkeypatch.undo()
    assert ok(post(app, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1}))["choices"]


# ---------------------------------------------------------------- tokenizer routes, OpenAPI

def test_tokenize_detokenize_tokenizer_info(app, llm):
    ids = ok(post(app, "/tokenize", {"model": MODEL, "prompt": "Hello world"}))
    assert ids["tokens"] == llm.tokenizer.encode("Hello world", add_bos=True) and ids["count"] == len(ids["tokens"])
    assert ids["max_model_len"] == CTX
    bare = ok(post(app, "/tokenize", {"prompt": "Hello world", "add_special_tokens": False, "return_token_strs": True}))
    assert bare["tokens"] == ids["tokens"][1:] and len(bare["token_strs"]) == len(bare["tokens"])
    chat = ok(post(app, "/tokenize", {"messages": MSGS}))
    from engine.chat import encode_chat
    assert chat["tokens"] == encode_chat(llm.tokenizer, MSGS)
    assert ok(post(app, "/detokenize", {"tokens": bare["tokens"]}))["prompt"] == "Hello world"
    assert_error(post(app, "/detokenize", {"tokens": [-1]}), 400, "tokens")
    assert_error(post(app, "/tokenize", {"prompt": "x", "messages": MSGS}), 400)
    assert_error(post(app, "/tokenize", {"model": "other", "prompt": "x"}), 404, "model")

    async def go():
        async with client(app) as c:
            return await c.get("/tokenizer_info")
    info = ok(run(go()))
    assert info["eos_token_id"] == llm.model.cfg.eos_token_id and info["model_max_length"] == CTX


def test_openapi_describes_the_api(app):
    async def go():
        async with client(app) as c:
            return await c.get("/openapi.json")
    spec = ok(run(go()))
    schemas = spec["components"]["schemas"]
    for path, model in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")):
        op = spec["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(model)
        assert {"400", "401", "404", "503"} <= set(op["responses"])
        assert op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("ErrorResponse")
    assert "prompt" in schemas["CompletionRequest"]["properties"] and "Message" in schemas
    assert set(spec["paths"]["/v1/models/{model}"]["get"]["responses"]) == {"200", "401", "404"}
    assert "text/plain" in spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert "422" not in str(spec) and "HTTPValidationError" not in schemas
    assert {"/tokenize", "/detokenize", "/tokenizer_info"} <= set(spec["paths"])
