"""Async scheduling on the GPU (pytest -m gpu): with CUDA graphs, pinned copies and events, the
lagged engine gives the synchronous engine's tokens (tests/test_overlap.py runs the same lag on
the CPU)."""
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from engine import LLM, SamplingParams  # noqa: E402
from test_overlap import _drain, _ids, _run, _same  # noqa: E402

GPU_CACHE = 2 << 30


def test_overlap_on_gpu_gives_the_synchronous_tokens(tiny_ckpt):
    """fp32: the lag changes which rows share a step (a finishing sequence rides one step more),
    and bf16 GEMMs of another batch bucket round differently, which can flip the random tiny
    model's greedy choice whatever the scheduling (as tests/test_gpu_graphs.py notes)."""
    llm = LLM(tiny_ckpt("tiny", 0), device="cuda", dtype=torch.float32, max_num_seqs=8, numerics="plain", max_model_len=512,
              skip_tokenizer_init=True, kv_cache_memory=GPU_CACHE)
    assert llm.engine.async_scheduling, "on by default on CUDA"
    V = llm.model.cfg.vocab_size
    prompts = [_ids(V, n, 200 + n) for n in (5, 40, 17, 70, 9, 33, 3, 21, 12, 50, 8)]
    base = _run(llm, prompts[5:6], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), overlap=False)
    stop_id = base[0][0][6]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (30, 12, 25, 7, 40)] + [
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_id], ignore_eos=True),
        SamplingParams(temperature=0.9, seed=1, max_tokens=24, presence_penalty=0.5, repetition_penalty=1.2),
        SamplingParams(temperature=0.8, seed=2, max_tokens=18, top_p=0.9, logprobs=3, min_tokens=5),
        SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=16, top_k=40),
        SamplingParams(temperature=0, max_tokens=3),
        SamplingParams(temperature=0.7, seed=4, max_tokens=22, frequency_penalty=0.6, ignore_eos=True)]
    sync = _run(llm, prompts, params, overlap=False)
    lagged = _run(llm, prompts, params, overlap=True)
    assert len(sync[5][0]) == base[0][0].index(stop_id) + 1 and sync[5][2] == "stop"
    for a, b in zip(sync, lagged):
        _same(a, b)
    _drain(llm)


def test_decode_launch_never_syncs(tiny_ckpt):
    """Planning and launching a decode step (inputs, graph replay, sampler, the tokens' copy
    back) makes no host sync: the host is free to read the previous step meanwhile."""
    llm = LLM(tiny_ckpt("tiny", 0), device="cuda", max_num_seqs=8, numerics="plain", max_model_len=512,
              skip_tokenizer_init=True, kv_cache_memory=GPU_CACHE, async_scheduling=True)
    eng = llm.engine
    V = llm.model.cfg.vocab_size
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, max_tokens=40, top_p=0.9, presence_penalty=0.3, logprobs=2)]
    for i in range(6):
        eng.add_request(_ids(V, 10 + i, 300 + i), params[i % 2])
    while eng.scheduler.waiting or not all(s.in_decode for s in eng.scheduler.running):
        eng.step()
    for _ in range(3):
        eng.step()
    torch.cuda.synchronize()
    touched = set()
    plan = eng.scheduler.schedule()
    assert len(plan.decode) == 6 and not plan.prefill
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():               # as EngineCore.step runs it
            launched = eng._launch(plan, touched)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    done, eng.inflight = eng.inflight, launched    # the rest of EngineCore.step
    with torch.inference_mode():
        eng._read(done, touched)
    while eng.has_unfinished():
        eng.step()
    _drain(llm)
