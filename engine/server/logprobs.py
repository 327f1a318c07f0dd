"""Engine logprob entries ({token_id: logprob}, the chosen token first, then the top-k best
first) in the OpenAI shapes: legacy completions, chat, and vLLM's prompt_logprobs."""
from __future__ import annotations

# JSON has no -Infinity; clients expect a finite floor (OpenAI and vLLM use -9999)
_FLOOR = -9999.0


def _lp(v: float) -> float:
    return v if v > _FLOOR else _FLOOR


def _text(tokenizer, tid: int) -> str:
    return tokenizer.decode([tid])


def _bytes(tokenizer, tid: int) -> list[int]:
    try:
        return list(tokenizer.token_bytes(tid))
    except ValueError:  # not a byte-level tokenizer
        return list(_text(tokenizer, tid).encode("utf-8"))


def completion_logprobs(tokenizer, entries: list[dict[int, float] | int], offset: int = 0) -> tuple[dict, int]:
    """{tokens, token_logprobs, top_logprobs, text_offset} and the offset after the last token.

    top_logprobs holds the chosen token as well as the best `logprobs` ones (so up to
    logprobs + 1 entries), as OpenAI documents. A bare token id stands for a token with no
    logprob (the first prompt token under echo: nothing predicts it), null as vLLM has it."""
    tokens, lps, tops, offsets = [], [], [], []
    for e in entries:
        if isinstance(e, int):
            s, lp, top = _text(tokenizer, e), None, None
        else:
            tid, v = next(iter(e.items()))
            s, lp, top = _text(tokenizer, tid), _lp(v), {_text(tokenizer, t): _lp(x) for t, x in e.items()}
        tokens.append(s)
        lps.append(lp)
        tops.append(top)
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}, offset


def echo_entries(prompt_ids: list[int], prompt_logprobs: list | None) -> list[dict[int, float] | int]:
    """The prompt's part of an echoed completion's logprobs: the first token bare, then entries."""
    if not prompt_logprobs:
        return []
    return [prompt_ids[0], *prompt_logprobs[1:]]


def vllm_prompt_logprobs(tokenizer, entries: list | None, ranks: list | None) -> list | None:
    """vLLM's prompt_logprobs: [null, {"<token id>": {logprob, rank, decoded_token}}, ...]. The
    prompt token's rank is the engine's exact one; an alternative's is its place in the top-k."""
    if entries is None:
        return None
    out = [None]
    for e, rank in zip(entries[1:], (ranks or [])[1:]):
        chosen = next(iter(e))
        values = sorted(e.values(), reverse=True)
        out.append({str(t): {"logprob": _lp(v), "rank": rank if t == chosen else 1 + values.index(v),
                             "decoded_token": _text(tokenizer, t)} for t, v in e.items()})
    return out


def chat_logprobs(tokenizer, entries: list[dict[int, float]], top_n: int) -> dict:
    """{"content": [{token, logprob, bytes, top_logprobs: [the top_n best]}]}."""
    content = []
    for e in entries:
        tid, lp = next(iter(e.items()))
        best = sorted(e.items(), key=lambda kv: -kv[1])[:top_n]  # stable: the chosen token wins ties
        content.append({"token": _text(tokenizer, tid), "logprob": _lp(lp), "bytes": _bytes(tokenizer, tid),
                        "top_logprobs": [{"token": _text(tokenizer, t), "logprob": _lp(v),
                                          "bytes": _bytes(tokenizer, t)} for t, v in best]})
    return {"content": content}
