"""bench/serving.py's measurements, server-free: what one streamed request's timestamps mean and
how a run's requests become the reported numbers (JSON row, table line).

The definitions are vLLM's serving benchmark's (vllm/benchmarks/lib/endpoint_request_func.py,
async_request_openai_completions; vllm/benchmarks/serve.py, benchmark and calculate_metrics;
SGLang's python/sglang/bench_serving.py measures the same way), so the numbers compare:

  TTFT     send -> the first chunk that carries choices (a usage-only chunk does not count)
  ITL      every gap between successive chunks that carry choices, pooled over all requests;
           a chunk holding several tokens is one gap, as there
  E2E      send -> the last chunk that carries choices (not the usage chunk or [DONE])
  TPOT     per request, (E2E - TTFT) / (output tokens - 1); requests with one token are left out
  output tok/s  all successful requests' output tokens / the run's wall time (first send to
           last request done); request/s likewise with the number of successful requests
  p50, p99 linear interpolation between order statistics (numpy.percentile's default)

A request fails when it raises (HTTP error, error event mid-stream) or streams no choices; a
failed request counts only in `failed`.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0           # seconds
    latency: float = 0.0        # seconds, E2E
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    chunks: int = 0             # chunks that carried choices
    counted_by: str = "usage"   # "usage": the server's completion_tokens; "chunks": no usage came


async def read_stream(stream, start: float, clock=time.perf_counter) -> RequestResult:
    """Times one streamed completion whose request was sent at `start` (by `clock`). `stream` yields
    the openai client's chunks (anything with .choices and .usage)."""
    r = RequestResult()
    last = start
    usage_tokens = None
    async for chunk in stream:
        if chunk.choices:
            now = clock()
            if r.chunks == 0:
                r.ttft = now - start
            else:
                r.itl.append(now - last)
            last = now
            r.chunks += 1
        if chunk.usage is not None:
            usage_tokens = chunk.usage.completion_tokens
    if r.chunks == 0:
        r.error = "the stream carried no choices"
        return r
    r.ok, r.latency = True, last - start
    if usage_tokens is None:  # no include_usage: one token per chunk, a lower bound
        r.output_tokens, r.counted_by = r.chunks, "chunks"
    else:
        r.output_tokens = usage_tokens
    return r


def percentile(xs: list[float], p: float) -> float:
    """numpy.percentile(xs, p) with its default (linear) method."""
    s = sorted(xs)
    k = (len(s) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summary_ms(xs: list[float]) -> dict:
    """{mean, p50, p99} in ms of seconds `xs`; None for each where there is nothing to summarise
    (vLLM prints 0 there, which reads as a measurement)."""
    if not xs:
        return {"mean": None, "p50": None, "p99": None}
    return {"mean": 1e3 * sum(xs) / len(xs), "p50": 1e3 * percentile(xs, 50), "p99": 1e3 * percentile(xs, 99)}


def make_row(results: list[RequestResult], duration: float, *, concurrency: int, input_len: int,
             output_len: int) -> dict:
    """One concurrency level's requests and wall time (s) -> its JSON row."""
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    return {"concurrency": concurrency, "num_prompts": len(results), "input_len": input_len,
            "output_len": output_len, "duration_s": duration, "completed": len(done),
            "failed": len(results) - len(done),
            "total_input_tokens": input_len * len(done), "total_output_tokens": out_tokens,
            "output_tokens_min": min((r.output_tokens for r in done), default=None),
            "output_tokens_max": max((r.output_tokens for r in done), default=None),
            "tokens_per_chunk": out_tokens / max(1, sum(r.chunks for r in done)),
            "tokens_counted_by": "chunks" if any(r.counted_by == "chunks" for r in done) else "usage",
            "output_tok_s": out_tokens / duration, "request_s": len(done) / duration,
            "ttft_ms": summary_ms([r.ttft for r in done]), "tpot_ms": summary_ms(tpots),
            "itl_ms": summary_ms([g for r in done for g in r.itl]),
            "e2e_ms": summary_ms([r.latency for r in done])}


_STATS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")

HEADER = (f"{'conc':>5} {'n':>5} {'ok':>5} {'fail':>4} {'dur s':>7} {'req/s':>7} {'out tok/s':>9}  "
          + "  ".join(f"{k[:-3].upper() + ' ms mean/p50/p99':>24}" for k in _STATS))


def _ms(v) -> str:
    return "-" if v is None else f"{v:.1f}" if v < 1000 else f"{v:.0f}"


def format_row(row: dict) -> str:
    stats = "  ".join(f"{'/'.join(_ms(row[k][q]) for q in ('mean', 'p50', 'p99')):>24}" for k in _STATS)
    return (f"{row['concurrency']:>5} {row['num_prompts']:>5} {row['completed']:>5} {row['failed']:>4} "
            f"{row['duration_s']:>7.2f} {row['request_s']:>7.2f} {row['output_tok_s']:>9.1f}  {stats}")
