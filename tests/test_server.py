"""The OpenAI-compatible app against its ASGI interface (httpx, no sockets): shapes, streaming,
batching, aborts, metrics. Tool calls are checked on canned completions, since the tiny
random model never writes one. Error cases are in test_server_errors.py."""
import asyncio
import json

from engine.chat import DSML, TOOL_END, TOOL_START, encode_chat, parse_completion
from engine.core import CompletionOutput
from engine.server.chat_completions import ChatChoiceStream, chat_choice
from engine.server.inputs import chat_prompt
from engine.server.schemas import ChatCompletionRequest
from server_util import MODEL, MSGS, WEATHER, assert_error, chat, client, complete, events, post, run, stream, wait_idle
from server_util import app, llm  # noqa: F401  (module fixtures)


# ---------------------------------------------------------------- models, health

def test_models_and_health(app):
    async def go():
        async with client(app) as c:
            return [await c.get(p) for p in ("/v1/models", f"/v1/models/{MODEL}", "/v1/models/nope", "/health")]
    models, one, missing, health = run(go())
    assert models.json()["object"] == "list" and [m["id"] for m in models.json()["data"]] == [MODEL]
    assert one.json()["id"] == MODEL and one.json()["max_model_len"] == 1024
    assert_error(missing, 404, "model")
    assert health.status_code == 200


# ---------------------------------------------------------------- completions

def test_completion_string_prompt(app):
    out = complete(app, prompt="Hello world", max_tokens=5, temperature=0, ignore_eos=True)
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-") and out["model"] == MODEL
    (choice,) = out["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and isinstance(choice["text"], str)
    assert out["usage"]["completion_tokens"] == 5
    assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] + 5


def test_completion_prompt_forms_agree(app, llm):
    ids = llm.tokenizer.encode("Hello world", add_bos=True)
    args = dict(max_tokens=4, temperature=0, ignore_eos=True)
    text = complete(app, prompt="Hello world", **args)["choices"][0]["text"]
    as_ids = complete(app, prompt=ids, **args)
    assert as_ids["choices"][0]["text"] == text and as_ids["usage"]["prompt_tokens"] == len(ids)
    many = complete(app, prompt=["Hello world", "Goodbye"], **args)
    assert [c["index"] for c in many["choices"]] == [0, 1] and many["choices"][0]["text"] == text
    lists = complete(app, prompt=[ids, ids[:2]], **args)
    assert lists["choices"][0]["text"] == text and lists["usage"]["completion_tokens"] == 8


def test_completion_echo(app):
    plain = complete(app, prompt="Hello world", max_tokens=3, temperature=0)["choices"][0]["text"]
    echoed = complete(app, prompt="Hello world", max_tokens=3, temperature=0, echo=True)["choices"][0]["text"]
    assert echoed == "Hello world" + plain


def test_completion_logprobs(app):
    out = complete(app, prompt="Hello world", max_tokens=4, temperature=0, ignore_eos=True, logprobs=3)
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 4
    assert "".join(lp["tokens"]) == out["choices"][0]["text"]
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    for tok, val, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert 3 <= len(top) <= 4 and top[tok] == val and val <= 0
        assert val == max(top.values())  # greedy picks the best


def test_completion_stream_equals_non_stream(app):
    body = dict(prompt=["Hello world", "Goodbye"], max_tokens=6, temperature=0, n=2, ignore_eos=True)
    want = complete(app, **body)
    chunks = stream(app, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert len({c["id"] for c in chunks}) == 1
    assert len({c["created"] for c in chunks}) == 1
    *body_chunks, last = chunks
    assert last["choices"] == [] and last["usage"] == want["usage"]
    texts, reasons = {}, {}
    for c in body_chunks:
        assert c["object"] == "text_completion" and c["usage"] is None
        for ch in c["choices"]:
            texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
            if ch["finish_reason"] is not None:
                assert ch["index"] not in reasons, "one finish_reason per choice"
                reasons[ch["index"]] = ch["finish_reason"]
    assert texts == {c["index"]: c["text"] for c in want["choices"]}
    assert reasons == {c["index"]: "length" for c in want["choices"]}


def test_stream_without_usage_has_no_usage_chunk(app):
    chunks = stream(app, "/v1/completions", dict(prompt="Hi", max_tokens=2, temperature=0))
    assert all(c["choices"] and "usage" not in c for c in chunks)


def test_stop_string_cut_and_never_streamed(app):
    full = complete(app, prompt="Hello world", max_tokens=12, temperature=0, ignore_eos=True)["choices"][0]["text"]
    stop = next(full[i:i + 3] for i in range(2, len(full) - 3) if "\ufffd" not in full[i:i + 3]
                and full[i:i + 3].strip())
    body = dict(prompt="Hello world", max_tokens=12, temperature=0, ignore_eos=True, stop=[stop, "zzzz-never"])
    cut = complete(app, **body)["choices"][0]
    assert cut["text"] == full[:full.find(stop)] and cut["finish_reason"] == "stop"
    pieces = [ch["text"] for c in stream(app, "/v1/completions", body) for ch in c["choices"]]
    assert "".join(pieces) == cut["text"] and all(stop not in p for p in pieces)


def test_seeded_sampling_repeats(app):
    body = dict(prompt="Hello", max_tokens=5, temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, seed=7,
                presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1, ignore_eos=True)
    a, b = complete(app, **body), complete(app, **body)
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    two = complete(app, **{**body, "n": 2})
    assert [c["index"] for c in two["choices"]] == [0, 1]
    assert two["choices"][0]["text"] != two["choices"][1]["text"]  # children get distinct seeds


# ---------------------------------------------------------------- chat

def test_chat_plain(app):
    out = chat(app, max_tokens=5, temperature=0)
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    (choice,) = out["choices"]
    msg = choice["message"]
    assert msg["role"] == "assistant" and isinstance(msg["content"], str) and msg["reasoning_content"] is None
    assert choice["finish_reason"] in ("length", "stop") and "tool_calls" not in msg
    assert out["usage"]["prompt_tokens"] == len(encode_chat(app.state.server.tokenizer, MSGS))


def test_chat_thinking_split(app, llm):
    ids = encode_chat(llm.tokenizer, MSGS, thinking=True, reasoning_effort="max")
    raw = complete(app, prompt=ids, max_tokens=6, temperature=0)["choices"][0]["text"]
    want = parse_completion(raw, thinking=True)
    out = chat(app, max_tokens=6, temperature=0,
               chat_template_kwargs={"thinking": True, "reasoning_effort": "max"})
    msg = out["choices"][0]["message"]
    assert out["usage"]["prompt_tokens"] == len(ids)
    assert msg["reasoning_content"] == want.reasoning_content and msg["content"] == want.content
    assert want.reasoning_content  # the tiny model never closes its thinking in 6 tokens


def test_chat_stream_equals_non_stream(app):
    for kwargs in ({}, {"chat_template_kwargs": {"thinking": True}}):
        body = dict(max_tokens=6, temperature=0, n=2, messages=MSGS, **kwargs)
        want = chat(app, **body)
        chunks = stream(app, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
        assert len({(c["id"], c["created"]) for c in chunks}) == 1
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == want["usage"]
        got = {i: {"content": "", "reasoning_content": "", "roles": [], "reasons": []} for i in (0, 1)}
        for c in chunks[:-1]:
            assert c["object"] == "chat.completion.chunk"
            for ch in c["choices"]:
                g, d = got[ch["index"]], ch["delta"]
                if "role" in d:
                    assert not g["content"] and not g["reasoning_content"], "role comes first"
                    g["roles"].append(d["role"])
                g["content"] += d.get("content") or ""
                g["reasoning_content"] += d.get("reasoning_content") or ""
                if ch["finish_reason"] is not None:
                    g["reasons"].append(ch["finish_reason"])
        for ch in want["choices"]:
            g, msg = got[ch["index"]], ch["message"]
            assert g["roles"] == ["assistant"] and g["reasons"] == [ch["finish_reason"]]
            assert g["content"] == msg["content"]
            assert g["reasoning_content"] == (msg["reasoning_content"] or "")


def test_chat_logprobs(app):
    out = chat(app, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == out["usage"]["completion_tokens"]
    for e in content:
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"} and len(e["top_logprobs"]) == 2
        assert e["top_logprobs"][0]["logprob"] >= e["top_logprobs"][1]["logprob"]
        assert e["top_logprobs"][0]["token"] == e["token"] and isinstance(e["bytes"], list)
    assert chat(app, max_tokens=2, logprobs=True)["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []


def test_tools_reach_the_prompt(app, llm):
    server = app.state.server
    req = ChatCompletionRequest(messages=MSGS, tools=[WEATHER])
    prompt, thinking = chat_prompt(req, llm.tokenizer, server.vocab_size, server.max_model_len)
    text = llm.tokenizer.decode(prompt.ids)
    assert "## Tools" in text and '"name": "get_weather"' in text and not thinking
    with_tools = chat(app, max_tokens=1, tools=[WEATHER])["usage"]["prompt_tokens"]
    without = chat(app, max_tokens=1)["usage"]["prompt_tokens"]
    assert with_tools == len(prompt.ids) > without
    assert chat(app, max_tokens=1, tools=[WEATHER], tool_choice="none")["usage"]["prompt_tokens"] == without
    assert_error(post(app, "/v1/chat/completions", {"messages": MSGS, "tools": [{"type": "function"}]}), 400, "tools")


def _canned(n_calls=1, thinking=False):
    invokes = [f'<{DSML}invoke name="get_weather">\n'
               f'<{DSML}parameter name="city" string="true">Paris</{DSML}parameter>\n'
               f'<{DSML}parameter name="days" string="false">{d}</{DSML}parameter>\n</{DSML}invoke>'
               for d in range(3, 3 + n_calls)]
    text = ("I should look it up.</think>" if thinking else "") + "Let me check.\n\n" + TOOL_START + "\n" \
        + "\n".join(invokes) + "\n" + TOOL_END
    return text


def test_tool_calls_from_canned_completion(llm):
    for thinking in (False, True):
        comp = CompletionOutput(0, _canned(thinking=thinking), [1, 2, 3], "stop")
        choice = chat_choice(llm.tokenizer, 0, comp, thinking, None)
        msg = choice["message"]
        assert choice["finish_reason"] == "tool_calls" and msg["content"] == "Let me check."
        assert msg["reasoning_content"] == ("I should look it up." if thinking else None)
        (call,) = msg["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}
    two = CompletionOutput(0, _canned(2), [1], "stop")
    assert len(chat_choice(llm.tokenizer, 0, two, False, None)["message"]["tool_calls"]) == 2
    single = chat_choice(llm.tokenizer, 0, two, False, None, single_tool_call=True)  # parallel_tool_calls=false
    assert len(single["message"]["tool_calls"]) == 1
    cut = CompletionOutput(0, "Let me check.", [1], "length")
    assert chat_choice(llm.tokenizer, 0, cut, False, None)["finish_reason"] == "length"


def test_tool_calls_streamed_from_canned_deltas():
    text = _canned(2, thinking=True)
    s = ChatChoiceStream(0, stop=[], thinking=True)
    deltas, reasons = [], []
    for end in range(0, len(text) + 1, 5):
        done = end >= len(text)
        got = s.delta(CompletionOutput(0, text if done else text[:end], list(range(end)), "stop" if done else None))
        if got is not None:
            deltas.append(got[0])
            reasons.append(got[2])
    if not reasons or reasons[-1] is None:
        got = s.delta(CompletionOutput(0, text, list(range(len(text))), "stop"))
        deltas.append(got[0])
        reasons.append(got[2])
    assert [r for r in reasons if r] == ["tool_calls"]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "I should look it up."
    assert "".join(d.get("content", "") for d in deltas) == "Let me check."
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [c["index"] for c in calls] == [0, 1]
    assert [json.loads(c["function"]["arguments"])["days"] for c in calls] == [3, 4]


# ---------------------------------------------------------------- concurrency, aborts

def test_concurrent_requests_are_batched(app, llm):
    async def go():
        peak = 0
        done = asyncio.Event()

        async def watch():
            nonlocal peak
            while not done.is_set():
                peak = max(peak, llm.engine.num_running())
                await asyncio.sleep(0.005)

        async with client(app) as c:
            w = asyncio.create_task(watch())
            reqs = [c.post("/v1/completions", json={"prompt": f"Hello {i}", "max_tokens": 8, "ignore_eos": True,
                                                    "temperature": 0})
                    for i in range(3)]
            reqs += [c.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 8, "stream": True,
                                                          "ignore_eos": True}) for _ in range(2)]
            # bad requests in the middle change nothing for the others
            reqs += [c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 0}),
                     c.post("/v1/completions", json={"prompt": [10 ** 9]})]
            out = await asyncio.gather(*reqs)
            done.set()
            await w
        return out, peak

    out, peak = run(go())
    assert [r.status_code for r in out] == [200] * 5 + [400, 400]
    assert all(r.json()["usage"]["completion_tokens"] == 8 for r in out[:3])
    assert all(events(r.text)[-1]["choices"][0]["finish_reason"] == "length" for r in out[3:5])
    assert peak >= 2, "requests were not decoded together"
    assert not llm.engine.has_unfinished()


async def _drive(app, body, disconnect_after_chunks: int):
    """Call the ASGI app directly; the client disconnects after some body chunks."""
    payload = json.dumps(body).encode()
    sent = asyncio.Event()
    if disconnect_after_chunks == 0:
        sent.set()  # gone before any answer
    chunks = 0
    messages = []

    async def receive():
        if not messages:
            messages.append("body")
            return {"type": "http.request", "body": payload, "more_body": False}
        await sent.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        nonlocal chunks
        messages.append(message)
        if message["type"] == "http.response.body" and message.get("body"):
            chunks += 1
        if chunks >= disconnect_after_chunks:
            sent.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": body.pop("_path"), "raw_path": b"", "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json")], "client": ("t", 1),
             "server": ("t", 80)}
    await asyncio.wait_for(app(scope, receive, send), 30)
    return chunks


def test_client_disconnect_frees_the_request(app, llm):
    free = len(llm.cache.free_blocks)
    long = {"max_tokens": 500, "ignore_eos": True, "stream": True}
    chunks = run(_drive(app, {"_path": "/v1/completions", "prompt": "Hello", **long}, 3))
    assert chunks < 20  # the stream ended soon after the disconnect, not after 500 tokens
    assert wait_idle(llm) and len(llm.cache.free_blocks) == free
    run(_drive(app, {"_path": "/v1/chat/completions", "messages": MSGS, **long}, 2))
    assert wait_idle(llm) and len(llm.cache.free_blocks) == free
    # not streamed: the handler polls for the disconnect between outputs
    run(_drive(app, {"_path": "/v1/completions", "prompt": "Hello", "max_tokens": 500, "ignore_eos": True}, 0))
    assert wait_idle(llm) and len(llm.cache.free_blocks) == free
    assert len(llm.cache.free_slots) == 4


# ---------------------------------------------------------------- metrics

def test_metrics_series(app):
    complete(app, prompt="Hello", max_tokens=2)
    post(app, "/v1/completions", {"prompt": "Hello", "max_tokens": 0})

    async def go():
        async with client(app) as c:
            return await c.get("/metrics")
    text = run(go()).text
    for series in ("engine_http_requests_total", "engine_prompt_tokens_total", "engine_generation_tokens_total",
                   "engine_num_requests_running", "engine_num_requests_waiting", "engine_kv_cache_usage_ratio",
                   "engine_time_to_first_token_seconds_bucket", "engine_inter_token_latency_seconds_bucket",
                   "engine_e2e_request_latency_seconds_count"):
        assert series in text, series
    assert 'engine_http_requests_total{endpoint="/v1/completions",status="200"}' in text
    assert 'engine_http_requests_total{endpoint="/v1/completions",status="400"}' in text
    gen = next(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("engine_generation_tokens_total"))
    assert gen > 0
