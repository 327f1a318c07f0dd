"""Request body -> what the engine takes: prompt token ids and SamplingParams.

Everything a bad request can trip on is checked here, before the engine sees it, so
the client gets a 400 naming the field and the engine loop never handles bad input.
"""
from __future__ import annotations

from dataclasses import dataclass

INT64 = (-(1 << 63), (1 << 63) - 1)

from ..chat import encode_chat
from ..sampler import MAX_LOGPROBS, SamplingParams
from .errors import bad_request
from .schemas import ChatCompletionRequest, CompletionRequest


@dataclass
class Prompt:
    ids: list[int]
    text: str | None  # what echo repeats; None for token-id prompts until decoded


def _check_ids(ids: list[int], vocab: int, max_model_len: int, param: str):
    if not ids:
        raise bad_request("prompt is empty", param)
    if any(t < 0 or t >= vocab for t in ids):
        raise bad_request(f"prompt token ids must be in [0, {vocab})", param)
    if len(ids) >= max_model_len:
        raise bad_request(f"the prompt has {len(ids)} tokens; this model's context is {max_model_len} tokens "
                          "(prompt plus at least one generated token)", param)


def completion_prompts(req: CompletionRequest, tokenizer, vocab: int, max_model_len: int,
                       max_seqs: int) -> list[Prompt]:
    p = req.prompt
    if isinstance(p, str) or (p and isinstance(p[0], int)):
        p = [p]
    if not p:
        raise bad_request("prompt must not be empty", "prompt")
    if len(p) * req.n > max_seqs:  # before tokenizing: a huge batch costs nothing to refuse
        raise bad_request(f"{len(p)} prompts x n={req.n} is {len(p) * req.n} sequences; "
                          f"this server takes at most {max_seqs} per request", "prompt")
    out = []
    for one in p:
        if isinstance(one, str):
            out.append(Prompt(tokenizer.encode(one, add_bos=True), one))  # as the engine would
        else:
            out.append(Prompt(list(one), None))
        _check_ids(out[-1].ids, vocab, max_model_len, "prompt")
    return out


def chat_options(req: ChatCompletionRequest) -> tuple[bool, str | None]:
    """(thinking, reasoning_effort): chat_template_kwargs win over the top-level field."""
    kw = req.chat_template_kwargs or {}
    thinking = kw.get("thinking", kw.get("enable_thinking", False))
    if not isinstance(thinking, bool):
        raise bad_request("chat_template_kwargs.thinking must be a boolean", "chat_template_kwargs")
    effort = kw.get("reasoning_effort", req.reasoning_effort)
    if effort is not None and not isinstance(effort, str):
        raise bad_request("reasoning_effort must be a string", "reasoning_effort")
    return thinking, effort


def chat_prompt(req: ChatCompletionRequest, tokenizer, vocab: int, max_model_len: int) -> tuple[Prompt, bool]:
    """The DeepSeek-V4 prompt for the conversation, and whether it opens in thinking mode."""
    thinking, effort = chat_options(req)
    # tool_choice "none": the model is not offered the tools at all
    tools = req.tool_dicts() if req.tool_choice != "none" else None
    try:
        ids = encode_chat(tokenizer, req.message_dicts(), thinking=thinking, tools=tools or None,
                          reasoning_effort=effort)
    except ValueError as e:
        msg = str(e)
        param = "tools" if msg.startswith("tools") else "reasoning_effort" if "reasoning_effort" in msg else "messages"
        raise bad_request(msg, param) from None
    _check_ids(ids, vocab, max_model_len, "messages")
    return Prompt(ids, None), thinking


def _in(value, lo, hi, name, lo_open=False):
    if value is None:
        return
    ok = (lo < value if lo_open else lo <= value) and value <= hi
    if not ok:
        left = "(" if lo_open else "["
        raise bad_request(f"{name} must be in {left}{lo}, {hi}], got {value}", name)


def check_n(req, max_n: int):
    """n (and best_of, which must equal it) in [1, max_n]: each sample is a sequence."""
    for name in ("n", "best_of"):
        value = getattr(req, name, None)
        if value is not None and not 1 <= value <= max_n:
            raise bad_request(f"{name} must be in [1, {max_n}], got {value}", name)


def check_context(prompts: list[Prompt], max_tokens: int | None, param: str, max_model_len: int):
    """vLLM's refusal (and message) for prompt + max_tokens past the context."""
    for p in prompts:
        if max_tokens is not None and len(p.ids) + max_tokens > max_model_len:
            raise bad_request(f"'{param}' is too large: {max_tokens}. This model's maximum context length is "
                              f"{max_model_len} tokens and your request has {len(p.ids)} input tokens "
                              f"({max_tokens} > {max_model_len} - {len(p.ids)}).", param)


def sampling_params(req, max_tokens: int | None, max_tokens_param: str, logprobs: int | None,
                    logprobs_param: str, prompt_logprobs: int | None = None, min_max_tokens: int = 1
                    ) -> SamplingParams:
    if req.n < 1:
        raise bad_request(f"n must be >= 1, got {req.n}", "n")
    if max_tokens is not None and max_tokens < min_max_tokens:
        hint = " (0, the prompt alone, needs echo or prompt_logprobs)" if max_tokens == 0 else ""
        raise bad_request(f"{max_tokens_param} must be >= {min_max_tokens}, got {max_tokens}{hint}", max_tokens_param)
    for value, name in ((logprobs, logprobs_param), (prompt_logprobs, "prompt_logprobs")):
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise bad_request(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}", name)
    if req.seed is not None and not INT64[0] <= req.seed <= INT64[1]:
        raise bad_request(f"seed must be a 64-bit signed integer, got {req.seed}", "seed")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")
    _in(req.temperature, 0, 2, "temperature")
    _in(req.top_p, 0, 1, "top_p", lo_open=True)
    _in(req.min_p, 0, 1, "min_p")
    _in(req.presence_penalty, -2, 2, "presence_penalty")
    _in(req.frequency_penalty, -2, 2, "frequency_penalty")
    if req.top_k is not None and req.top_k < -1:
        raise bad_request(f"top_k must be -1 (off) or >= 0, got {req.top_k}", "top_k")
    if req.repetition_penalty is not None and not req.repetition_penalty > 0:
        raise bad_request(f"repetition_penalty must be > 0, got {req.repetition_penalty}", "repetition_penalty")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(not s for s in stop):
        raise bad_request("stop strings must not be empty", "stop")
    given = {k: getattr(req, k) for k in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                                          "frequency_penalty", "repetition_penalty")
             if getattr(req, k) is not None}
    try:
        return SamplingParams(n=req.n, max_tokens=max_tokens, stop=stop, ignore_eos=req.ignore_eos,
                              logprobs=logprobs, prompt_logprobs=prompt_logprobs, **given)
    except ValueError as e:  # anything the checks above missed, still named
        raise bad_request(str(e), str(e).split(" ", 1)[0]) from None


def prompt_logprobs_k(req: CompletionRequest) -> int | None:
    """Alternatives per prompt token: echo with logprobs needs them (lm-eval's loglikelihood),
    and vLLM's prompt_logprobs asks for them directly; the larger of the two is computed."""
    asked = [k for k in (req.logprobs if req.echo else None, req.prompt_logprobs) if k is not None]
    return max(asked) if asked else None


def completion_params(req: CompletionRequest) -> SamplingParams:
    # OpenAI's completions default is 16 tokens; 0 (prompt only) when the prompt is the answer
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    k = prompt_logprobs_k(req)
    floor = 0 if req.echo or req.prompt_logprobs is not None else 1
    return sampling_params(req, max_tokens, "max_tokens", req.logprobs, "logprobs", k, floor)


def chat_params(req: ChatCompletionRequest) -> SamplingParams:
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    if req.max_completion_tokens is not None:
        max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, param = req.max_tokens, "max_tokens"  # None: up to the context length
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return sampling_params(req, max_tokens, param, logprobs, "top_logprobs", req.prompt_logprobs)
