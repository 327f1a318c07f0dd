"""python -m engine.generate on a small JSONL with a malformed row, and the async loop."""
import asyncio
import json

import torch

from engine.async_engine import AsyncEngine
from engine.generate import main
from engine.sampler import SamplingParams


def test_generate_skips_bad_rows(tiny_ckpt, tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([
        json.dumps({"prompt": "Hello there", "max_tokens": 4, "temperature": 0}),
        "{not json",
        json.dumps({"prompt": "x", "temperature": -1}),
        json.dumps({"messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 3}),
        json.dumps({"nothing": 1}),
    ]) + "\n")
    dst = tmp_path / "out.jsonl"
    assert main(["--model", str(tiny_ckpt("tiny", 0)), "--input", str(src), "--output", str(dst),
                 "--device", "cpu"]) == 0
    err = capsys.readouterr()
    for line in (2, 3, 5):
        assert f"in.jsonl:{line}: skipped" in err.err
    rows = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [r["line"] for r in rows] == [1, 4]
    assert len(rows[0]["token_ids"]) == 4 and len(rows[1]["token_ids"]) <= 3
    assert "requests: 2 done, 3 skipped" in err.out


def test_async_engine_streams_and_aborts(tiny_ckpt):
    from engine import LLM

    llm = LLM(tiny_ckpt("tiny", 0), device="cpu", dtype=torch.float32, max_num_seqs=4, numerics="plain")
    want = llm.generate(["Hello world"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    eng = AsyncEngine(llm.engine)

    async def run():
        outs = [o async for o in eng.generate("Hello world", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))]
        assert outs[-1].finished and outs[-1].token_ids == want.token_ids
        assert len(outs) >= 2  # incremental outputs, not only the final one
        # a consumer that stops early aborts its request and frees its cache
        gen = eng.generate("Hello world", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        async for _ in gen:
            break
        await gen.aclose()
        for _ in range(100):
            await asyncio.sleep(0.02)
            if not llm.engine.has_unfinished():
                break
        assert not llm.engine.has_unfinished()
        # bad input fails only its own request
        try:
            async for _ in eng.generate([], SamplingParams()):
                pass
            raise AssertionError("expected an error")
        except ValueError:
            pass

    try:
        asyncio.run(run())
        try:  # the loop owns the core now: the sync API must not step it concurrently
            llm.generate(["Hello"], SamplingParams(max_tokens=2))
            raise AssertionError("expected an error")
        except RuntimeError as e:
            assert "AsyncEngine" in str(e)
    finally:
        eng.shutdown()
    assert len(llm.cache.free_slots) == 4
