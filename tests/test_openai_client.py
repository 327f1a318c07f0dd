"""The official `openai` client against a real uvicorn server on a free port: what a user
of the server actually sees, streaming and disconnects over a socket included."""
import asyncio
import socket
import threading
import time

import httpx
import openai
import pytest
import torch
import uvicorn

from engine import LLM
from engine.server.app import build_app

MODEL = "tiny-served"
KEY = "sk-test-key"
MSGS = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(tiny_ckpt("tiny", 0), device="cpu", dtype=torch.float32, max_num_seqs=4, numerics="plain")


@pytest.fixture(scope="module")
def base_url(llm):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(llm, MODEL, api_key=KEY), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(500):
        if server.started:
            break
        time.sleep(0.01)
    assert server.started
    yield f"http://127.0.0.1:{port}/v1"
    server.should_exit = True
    thread.join(timeout=15)
    sock.close()
    assert llm.engine.driver is None  # the app's lifespan stopped the engine loop it started


@pytest.fixture(scope="module")
def oai(base_url):
    return openai.OpenAI(base_url=base_url, api_key=KEY, max_retries=0, timeout=60)


def wait_idle(llm, timeout=10.0) -> bool:
    for _ in range(int(timeout / 0.02)):
        if not llm.engine.has_unfinished():
            return True
        time.sleep(0.02)
    return False


def test_models(oai):
    assert [m.id for m in oai.models.list().data] == [MODEL]
    assert oai.models.retrieve(MODEL).id == MODEL


def test_completions(oai, llm):
    one = oai.completions.create(model=MODEL, prompt="Hello world", max_tokens=4, temperature=0, logprobs=2,
                                 extra_body={"ignore_eos": True})
    (choice,) = one.choices
    assert choice.finish_reason == "length" and one.usage.completion_tokens == 4
    assert len(choice.logprobs.tokens) == 4 and len(choice.logprobs.top_logprobs[0]) >= 2
    many = oai.completions.create(model=MODEL, prompt=["Hello world", "Bye"], max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in many.choices] == [0, 1] and many.choices[0].text == choice.text
    ids = oai.completions.create(model=MODEL, prompt=llm.tokenizer.encode("Hello world", add_bos=True),
                                 max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    assert ids.choices[0].text == choice.text
    echo = oai.completions.create(model=MODEL, prompt="Hello world", max_tokens=4, temperature=0, echo=True,
                                  extra_body={"ignore_eos": True})
    assert echo.choices[0].text == "Hello world" + choice.text


def test_completion_stream_equals_non_stream(oai):
    args = dict(model=MODEL, prompt="Hello world", max_tokens=6, temperature=0, n=2, extra_body={"ignore_eos": True})
    want = oai.completions.create(**args)
    chunks = list(oai.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == want.usage.completion_tokens
    text = {0: "", 1: ""}
    for c in chunks[:-1]:
        for ch in c.choices:
            text[ch.index] += ch.text
    assert text == {c.index: c.text for c in want.choices}


def test_chat(oai):
    out = oai.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=5, temperature=0, user="someone",
                                      logprobs=True, top_logprobs=2)
    msg = out.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str) and not msg.tool_calls
    assert len(out.choices[0].logprobs.content) == out.usage.completion_tokens
    think = oai.chat.completions.create(model=MODEL, messages=MSGS, max_completion_tokens=5, temperature=0,
                                        extra_body={"chat_template_kwargs": {"thinking": True}})
    assert think.choices[0].message.model_extra["reasoning_content"]


def test_chat_stream_equals_non_stream(oai):
    args = dict(model=MODEL, messages=MSGS, max_tokens=6, temperature=0)
    want = oai.chat.completions.create(**args).choices[0]
    chunks = list(oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and chunks[-1].choices == [] and chunks[-1].usage.total_tokens > 0
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == want.message.content
    assert [c.choices[0].finish_reason for c in chunks[:-1] if c.choices[0].finish_reason] == [want.finish_reason]


def test_n2_and_tools_accepted(oai):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    out = oai.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=3, n=2, seed=1, tools=tools)
    assert [c.index for c in out.choices] == [0, 1]


def test_errors(oai, base_url, llm, monkeypatch):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL, prompt="Hi", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        oai.chat.completions.create(model=MODEL, messages=MSGS, logit_bias={"1": 1})
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="gpt-4o", messages=MSGS)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0).models.list()
    monkeypatch.setattr(llm.engine.scheduler, "max_waiting", 0)
    with pytest.raises(openai.InternalServerError) as e:
        oai.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    assert e.value.status_code == 503


def test_lm_eval_request_shape(oai, llm):
    """echo + logprobs on token-id prompts (lm-eval's loglikelihood), max_tokens 1 and 0, through the
    official client: one logprob per prompt token, the model's own (full forward) log-softmax."""
    ids = llm.tokenizer.encode("The capital of France is Paris", add_bos=True)
    want = torch.log_softmax(llm.model(torch.tensor([ids]))[0].double(), dim=-1)
    for max_tokens in (1, 0):
        out = oai.completions.create(model=MODEL, prompt=[ids], max_tokens=max_tokens, logprobs=1, echo=True,
                                     temperature=0)
        lp = out.choices[0].logprobs
        assert len(lp.token_logprobs) == len(ids) + max_tokens and lp.token_logprobs[0] is None
        for i in range(1, len(ids)):
            ref = want[i - 1, ids[i]].item()
            assert abs(lp.token_logprobs[i] - ref) <= 1e-4 * max(1.0, abs(ref))
    plp = oai.completions.create(model=MODEL, prompt=ids, max_tokens=1, extra_body={"prompt_logprobs": 1})
    assert len(plp.choices[0].model_extra["prompt_logprobs"]) == len(ids)


def test_bounds_and_bad_input_through_the_client(oai, base_url):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL, prompt="x", max_tokens=1, n=10 ** 9)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError, match="maximum context length is 1024 tokens") as e:
        oai.completions.create(model=MODEL, prompt="x", max_tokens=10 ** 9)
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, max_tokens=1, messages=[
            {"role": "user", "content": "x"}, {"role": "tool", "content": "r", "tool_call_id": {"a": 1}}])
    assert e.value.body["param"] == "messages"
    headers = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    r = httpx.post(f"{base_url}/completions", content=b'{"prompt": "\xed\xb3\xbf"}'.decode("unicode_escape")
                   .encode("latin-1"), headers=headers)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("request body is not valid UTF-8")
    r = httpx.get(f"{base_url}/completions", headers=headers)
    assert r.status_code == 405 and r.headers["allow"] == "POST"


def test_concurrent_clients(base_url, llm):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=KEY, max_retries=0, timeout=60)

    async def go():
        reqs = [client.completions.create(model=MODEL, prompt=f"Hi {i}", max_tokens=6, temperature=0)
                for i in range(4)]
        reqs += [client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=6) for _ in range(2)]
        out = await asyncio.gather(*reqs)
        await client.close()
        return out

    out = asyncio.run(go())
    assert len(out) == 6 and all(o.choices for o in out)
    assert wait_idle(llm)


def test_disconnect_mid_stream_frees_the_request(oai, base_url, llm):
    free = len(llm.cache.free_blocks)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base_url}/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    assert wait_idle(llm) and len(llm.cache.free_blocks) == free
    stream = oai.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=500, stream=True,
                                         extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    assert wait_idle(llm) and len(llm.cache.free_blocks) == free
    assert len(llm.cache.free_slots) == 4
