"""Async scheduling (engine.core): each step is launched before the previous step's tokens are
read. On the CPU nothing overlaps, but the one-step lag is the same code path as on a GPU, so
every test here runs it forced on against the synchronous path on the same engine."""
import asyncio

import pytest
import torch

from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine


def _ids(vocab, n, seed):
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(tiny_ckpt("tiny", 0), device="cpu", dtype=torch.float32, max_num_seqs=6, numerics="plain",
               async_scheduling=False)


def _run(llm, prompts, params, overlap: bool):
    llm.engine.async_scheduling = overlap
    try:
        outs = llm.generate(prompts, params)
    finally:
        llm.engine.async_scheduling = False
    _drain(llm)
    return [(o.token_ids, o.text, o.finish_reason, o.outputs[0].logprobs) for o in outs]


def _drain(llm):
    """Read the step still in flight (its rows all dropped) and check nothing is held."""
    eng = llm.engine
    while eng.has_unfinished():
        assert eng.step() == []
    assert not eng.scheduler.running and not eng.scheduler.waiting
    assert eng.cache.can_allocate(eng.cache.num_blocks - 1), "blocks leaked"
    assert len(eng.cache.free_slots) == eng.scheduler.max_num_seqs, "slots leaked"


def _mixed_params(sync_greedy):
    """Greedy rows cut by max_tokens, a stop id and a stop string taken from the synchronous
    run's own tokens (so they fire mid-run), and seeded rows with penalties, min_tokens, logprobs."""
    (t0, _, _, _), (t1, text1, _, _) = sync_greedy[0], sync_greedy[1]
    stop = text1[len(text1) // 2:len(text1) // 2 + 2]
    assert stop.strip()
    return [
        SamplingParams(temperature=0, max_tokens=14, stop_token_ids=[t0[5]], ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=14, stop=[stop], ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=3),
        SamplingParams(temperature=0.9, seed=11, max_tokens=12, presence_penalty=0.7, frequency_penalty=0.4),
        SamplingParams(temperature=0.8, seed=12, max_tokens=9, repetition_penalty=1.3, top_k=50, logprobs=3),
        SamplingParams(temperature=1.0, seed=13, max_tokens=10, min_tokens=4, top_p=0.9, stop_token_ids=[t0[2]]),
        SamplingParams(n=2, temperature=1.0, seed=14, max_tokens=7, logprobs=0),
        SamplingParams(temperature=0, max_tokens=11, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.7, seed=15, max_tokens=13, min_p=0.05, ignore_eos=True),
    ]


def test_overlap_gives_the_synchronous_tokens(llm):
    """Ten requests (eleven sequences, six slots: some queue and join mid-run) with different
    max_tokens, stop ids, stop strings, seeds and penalties: the same tokens, text, finish
    reasons and logprobs with the lag as without."""
    prompts = ["The quick brown fox", "Once upon a time"] + [_ids(llm.model.cfg.vocab_size, n, n) for n in
                                                            (3, 17, 9, 30, 5, 12, 22, 8)]
    greedy = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    base = _run(llm, prompts[:2], greedy, overlap=False)
    params = _mixed_params(base)
    sync = _run(llm, prompts, params, overlap=False)
    lagged = _run(llm, prompts, params, overlap=True)
    assert sync[0][2] == "stop" and len(sync[0][0]) == 6 and sync[1][2] == "stop"
    for a, b in zip(sync, lagged):
        _same(a, b)


def _same(a, b):
    """Tokens, text and finish reason equal; logprobs equal up to the fp32 ulps of a different
    batch (the lag changes which rows share a step)."""
    assert a[:3] == b[:3]
    assert (a[3] is None) == (b[3] is None)
    for x, y in zip(a[3] or [], b[3] or []):
        assert list(x) == list(y) and all(abs(x[k] - y[k]) < 1e-4 for k in x)


def test_finished_sequence_drops_its_in_flight_token(llm):
    """A stop id ends the sequence at step N; step N+1 was already launched for it: its row is
    sampled but never emitted, counted or streamed, and the cache comes back."""
    prompt = _ids(llm.model.cfg.vocab_size, 10, 3)
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].token_ids
    _drain(llm)
    params = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[free[3]], ignore_eos=True)
    sampled = []
    sample = llm.engine.runner.sample
    llm.engine.runner.sample = lambda seqs, *a: (sampled.append(len(seqs)), sample(seqs, *a))[1]
    before = llm.engine.stats["generation_tokens"]
    eng = llm.engine
    eng.async_scheduling = True
    try:
        rid = eng.add_request(prompt, params)
        seen = []
        while eng.has_unfinished():
            for o in eng.step():
                seen.append(list(o.token_ids))
    finally:
        eng.async_scheduling = False
        llm.engine.runner.sample = sample
    stop_at = free.index(free[3]) + 1
    assert seen[-1] == free[:stop_at] and all(s == free[:len(s)] for s in seen)
    assert sum(sampled) == stop_at + 1, "the lag launches exactly one step past the stop"
    assert eng.stats["generation_tokens"] - before == stop_at
    assert rid not in eng.requests
    _drain(llm)


def test_max_tokens_is_known_ahead(llm):
    """A sequence whose unread token reaches max_tokens gets no further step (nothing to drop)."""
    sampled = []
    sample = llm.engine.runner.sample
    llm.engine.runner.sample = lambda seqs, *a: (sampled.append(len(seqs)), sample(seqs, *a))[1]
    try:
        out = _run(llm, [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), overlap=True)
    finally:
        llm.engine.runner.sample = sample
    assert len(out[0][0]) == 6 and sum(sampled) == 6


def test_abort_mid_stream(llm):
    """Abort a running request while its next step is in flight: the others' tokens are the
    synchronous ones, the aborted one emits nothing more, and its cache comes back."""
    V = llm.model.cfg.vocab_size
    prompts = [_ids(V, n, 50 + n) for n in (7, 19, 4)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    sync = _run(llm, prompts, params, overlap=False)
    eng = llm.engine
    eng.async_scheduling = True
    try:
        rids = [eng.add_request(p, params) for p in prompts]
        final, steps = {}, 0
        while eng.has_unfinished():
            steps += 1
            if steps == 4:
                assert eng.inflight is not None and eng.abort(rids[1])
            for o in eng.step():
                assert o.request_id != rids[1] or steps < 4, "an aborted request emitted"
                final[o.request_id] = o
    finally:
        eng.async_scheduling = False
    assert rids[1] not in final or not final[rids[1]].finished
    assert final[rids[0]].token_ids == sync[0][0] and final[rids[2]].token_ids == sync[2][0]
    _drain(llm)


def test_preemption_and_a_small_pool(tiny_ckpt):
    """A pool too small for every sequence: preemption (of sequences with a token in flight)
    recomputes the same tokens, waiting requests queue, nothing leaks."""
    ckpt = tiny_ckpt("tiny", 0)
    probe = LLM(ckpt, device="cpu", dtype=torch.float32, max_num_seqs=3, numerics="plain")
    budget = probe.cache.slot_bytes() * probe.cache.max_num_seqs + probe.cache.block_bytes() * 5
    small = LLM(ckpt, device="cpu", dtype=torch.float32, max_num_seqs=3, kv_cache_memory=budget, numerics="plain",
                async_scheduling=False)
    V = small.model.cfg.vocab_size
    prompts = [_ids(V, 40, 60 + i) for i in range(4)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (30, 26, 5)] + [
        SamplingParams(temperature=0.9, seed=3, max_tokens=28, ignore_eos=True, frequency_penalty=0.5)]
    preempted = []
    orig = small.engine.scheduler.preempt
    small.engine.scheduler.preempt = lambda s: (preempted.append((s.request_id, s.pending)), orig(s))
    sync = _run(small, prompts, params, overlap=False)
    n_sync, preempted[:] = len(preempted), []
    lagged = _run(small, prompts, params, overlap=True)
    assert n_sync and preempted, "the pool never ran out: the test does not exercise preemption"
    assert any(p for _, p in preempted), "no sequence was preempted with a token in flight"
    for a, b in zip(sync, lagged):
        _same(a, b)


def test_logits_hook_sees_the_synchronous_rows(llm):
    """The hook (tests' window on sampling) gets the rows keyed as the synchronous path keys them."""
    def record(into):
        def hook(seqs, logits):
            for s, row in zip(seqs, logits):
                into[(len(s.prompt_ids), s.index, len(s.output_ids))] = row.clone()
        return hook

    V = llm.model.cfg.vocab_size
    prompts = [_ids(V, n, 70 + n) for n in (6, 15)]
    params = [SamplingParams(temperature=0, max_tokens=5, stop_token_ids=[], ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)]
    got = []
    for overlap in (False, True):
        seen = {}
        llm.engine.runner.logits_hook = record(seen)
        try:
            _run(llm, prompts, params, overlap)
        finally:
            llm.engine.runner.logits_hook = None
        got.append(seen)
    assert len(got[0]) == 14 and sorted(got[0]) == sorted(got[1])
    assert all(torch.equal(got[0][k], got[1][k]) for k in got[0])


def test_async_engine_streams_with_overlap(llm):
    """The server's loop: streamed outputs grow by prefixes and end as the synchronous run."""
    V = llm.model.cfg.vocab_size
    prompts = [_ids(V, n, 90 + n) for n in (5, 11, 26)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (4, 9, 6)]
    sync = _run(llm, prompts, params, overlap=False)
    llm.engine.async_scheduling = True
    engine = AsyncEngine(llm.engine)

    async def one(p, sp):
        outs = [o async for o in engine.generate(p, sp)]
        for a, b in zip(outs, outs[1:]):
            assert b.token_ids[:len(a.token_ids)] == a.token_ids
        return outs[-1]

    async def all_of():
        return await asyncio.gather(*(one(p, sp) for p, sp in zip(prompts, params)))

    try:
        finals = asyncio.run(all_of())
    finally:
        engine.shutdown()
        llm.engine.async_scheduling = False
    assert [f.token_ids for f in finals] == [s[0] for s in sync]
    assert all(f.finished for f in finals)
    _drain(llm)


def test_serve_flag():
    from engine.serve import parse_args

    assert parse_args([]).async_scheduling is None
    assert parse_args(["--async-scheduling"]).async_scheduling is True
    assert parse_args(["--no-async-scheduling"]).async_scheduling is False


def test_bench_host_overlap_smoke(tiny_ckpt, tmp_path):
    """bench/host_overlap.py (a GPU bench) parses and runs its CPU smoke mode end to end."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / "host_overlap.py"
    spec = importlib.util.spec_from_file_location("host_overlap", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "r.json"
    assert bench.main(["--device", "cpu", "--model", str(tiny_ckpt("tiny", 0)), "--batches", "1,2", "--steps", "2",
                       "--warmup", "1", "--input-len", "4", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["overlap"]) for r in rows] == [(1, False), (1, True), (2, False), (2, True)]
    assert all(r["step_ms"] > 0 and r["device_ms"] > 0 for r in rows)


def test_switching_overlap_off_reads_the_step_in_flight(llm):
    """Turning async scheduling off with a step in flight reads that step first: no token lost."""
    prompt = [9, 8, 7, 6]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = _run(llm, [prompt], params, overlap=False)[0][0]
    eng = llm.engine
    eng.async_scheduling = True
    rid = eng.add_request(prompt, params)
    for _ in range(3):
        eng.step()
    assert eng.inflight is not None
    eng.async_scheduling = False
    final = None
    while eng.has_unfinished():
        for o in eng.step():
            final = o if o.request_id == rid else final
    assert final.finished and final.token_ids == want
    _drain(llm)
