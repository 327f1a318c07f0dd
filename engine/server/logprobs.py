"""Engine logprob entries ({token_id: logprob}, the chosen token first, then the top-k best
first) in the two OpenAI shapes: legacy completions and chat."""
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


def completion_logprobs(tokenizer, entries: list[dict[int, float]], offset: int = 0) -> tuple[dict, int]:
    """{tokens, token_logprobs, top_logprobs, text_offset} and the offset after the last token.

    top_logprobs holds the chosen token as well as the best `logprobs` ones (so up to
    logprobs + 1 entries), as OpenAI documents."""
    tokens, lps, tops, offsets = [], [], [], []
    for e in entries:
        tid, lp = next(iter(e.items()))
        s = _text(tokenizer, tid)
        tokens.append(s)
        lps.append(_lp(lp))
        tops.append({_text(tokenizer, t): _lp(v) for t, v in e.items()})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}, offset


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
