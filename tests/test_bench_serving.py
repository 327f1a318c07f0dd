"""bench/serving.py: the metric definitions on synthetic timestamps (vLLM's benchmark_serving's, pinned
here so the numbers stay comparable), then the whole bench against a served tiny checkpoint on CPU."""
import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

ROOT = Path(__file__).resolve().parent.parent
# appended, not prepended: bench/kernels.py must never shadow an installed `kernels` package
# (transformers >= 5.25 imports HF's `kernels` when it is installed)
sys.path.append(str(ROOT / "bench"))

from serving_metrics import RequestResult, make_row, percentile, read_stream  # noqa: E402


def test_percentile_is_numpys_linear():
    np = pytest.importorskip("numpy")
    for xs in ([3.0], [1.0, 2.0], [5.0, 1.0, 4.0, 2.0, 3.0], [0.1 * i * i for i in range(37)]):
        for p in (0, 1, 50, 90, 99, 100):
            assert percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)), rel=1e-12, abs=1e-15)


def _chunk(text=None, tokens=None):
    """A completion chunk as the openai client yields it: choices, or the usage-only tail."""
    return NS(choices=[] if text is None else [NS(text=text)],
              usage=None if tokens is None else NS(completion_tokens=tokens))


async def _aiter(items):
    for x in items:
        yield x


def _read(chunks, times, start=10.0):
    clock = iter(times).__next__  # read only when a chunk carries choices
    return asyncio.run(read_stream(_aiter(chunks), start, clock))


def test_stream_times_first_and_last_choice_chunks_and_counts_usage():
    r = _read([_chunk("a"), _chunk("b"), _chunk("cd"), _chunk("e"), _chunk(tokens=5)], [10.5, 10.6, 10.8, 11.0])
    assert r.ok and r.chunks == 4 and r.output_tokens == 5 and r.counted_by == "usage"
    assert r.ttft == pytest.approx(0.5)
    assert r.itl == pytest.approx([0.1, 0.2, 0.2])   # one gap per chunk, a two-token chunk included
    assert r.latency == pytest.approx(1.0)           # the last choice chunk, not the usage chunk


def test_stream_without_usage_counts_chunks_and_one_without_choices_fails():
    r = _read([_chunk("a"), _chunk("b")], [10.2, 10.3])
    assert r.ok and r.output_tokens == 2 and r.counted_by == "chunks"
    r = _read([_chunk(tokens=0)], [])
    assert not r.ok and r.error


def test_row_follows_vllm_definitions():
    a = RequestResult(ok=True, ttft=0.1, latency=1.1, itl=[0.1] * 10, output_tokens=11, chunks=11)
    b = RequestResult(ok=True, ttft=0.3, latency=0.3, itl=[], output_tokens=1, chunks=1)  # no TPOT
    c = RequestResult(error="boom")
    row = make_row([a, b, c], 2.0, concurrency=2, input_len=16, output_len=11)
    assert (row["num_prompts"], row["completed"], row["failed"]) == (3, 2, 1)
    assert row["total_output_tokens"] == 12 and row["total_input_tokens"] == 32
    assert row["output_tok_s"] == pytest.approx(6.0) and row["request_s"] == pytest.approx(1.0)
    assert row["ttft_ms"] == pytest.approx({"mean": 200.0, "p50": 200.0, "p99": 298.0})
    assert row["tpot_ms"] == pytest.approx({"mean": 100.0, "p50": 100.0, "p99": 100.0})  # (1.1-0.1)/10, b left out
    assert row["itl_ms"] == pytest.approx({"mean": 100.0, "p50": 100.0, "p99": 100.0})
    assert row["e2e_ms"] == pytest.approx({"mean": 700.0, "p50": 700.0, "p99": 1092.0})
    empty = make_row([c], 1.0, concurrency=1, input_len=16, output_len=11)
    assert empty["completed"] == 0 and empty["ttft_ms"]["p50"] is None and empty["output_tok_s"] == 0


def _bench(*args, timeout=240):
    for dep in ("openai", "fastapi", "uvicorn"):
        pytest.importorskip(dep)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(ROOT / "bench" / "serving.py"), "--device", "cpu", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_bench_end_to_end_on_cpu(tiny_ckpt, tmp_path):
    out = tmp_path / "serving.json"
    p = _bench("--model", str(tiny_ckpt("tiny", 0)), "--input-len", "16", "--output-len", "8",
               "--concurrency", "1,4", "--num-prompts", "4", "--warmup", "1", "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(out.read_text())
    assert res["run"]["device"] == "cpu" and res["run"]["max_model_len"] >= 24
    assert [r["concurrency"] for r in res["rows"]] == [1, 4]
    for r in res["rows"]:
        assert (r["num_prompts"], r["completed"], r["failed"]) == (4, 4, 0)
        # ignore_eos: every request makes exactly output_len tokens, counted from the server's usage
        assert r["tokens_counted_by"] == "usage" and r["output_tokens_min"] == r["output_tokens_max"] == 8
        assert r["total_output_tokens"] == 32 and r["total_input_tokens"] == 64
        assert r["output_tok_s"] > 0 and r["request_s"] > 0
        assert r["output_tok_s"] == pytest.approx(32 / r["duration_s"])
        for q in ("mean", "p50", "p99"):
            assert 0 < r["ttft_ms"][q] <= r["e2e_ms"][q]
            assert r["tpot_ms"][q] > 0 and r["itl_ms"][q] > 0
        assert r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"]
    assert "TTFT" in p.stdout


def test_bench_shows_the_log_of_a_server_that_dies(tmp_path):
    log = tmp_path / "server.log"
    p = _bench("--model", str(tmp_path / "nothing"), "--server-log", str(log), timeout=120)
    assert p.returncode != 0
    assert "exited" in p.stderr and "cannot start" in p.stderr  # the server's own words, from its log
    assert log.exists()                                         # kept: the run failed
