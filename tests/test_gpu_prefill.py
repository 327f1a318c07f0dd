"""Batched varlen prefill through the kernels on the GPU (pytest -m gpu).

Many prompts of lengths around the window (128) and the compression boundaries (4, 128) are
prefilled together in steps of a small token budget, so one model call carries several
sequences' chunks, chunks that start mid-prompt, and decode rows beside them. The kernels'
logits equal torch bf16's within max(1e-2, 1.5 x the bf16 floor measured against torch fp32)
and the greedy tokens agree away from near-ties (tests/test_kernel_model.py's comparison)."""
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from conftest import GPU_CACHE  # noqa: E402
from test_kernel_model import kernels_vs_torch  # noqa: E402
from engine import LLM  # noqa: E402
from engine.kernels import set_kernels  # noqa: E402

LENS = (1, 3, 4, 5, 127, 128, 129, 131, 200, 255, 256, 257, 300, 383, 513, 600)


@pytest.mark.parametrize("numerics", ["plain", "reference"])
def test_batched_prefill_kernels_match_torch(tiny_ckpt, numerics):
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, 129280, (m,), generator=g).tolist() for m in LENS]
    calls = []

    def make(dtype):
        llm = LLM(tiny_ckpt("flash", 0), device="cuda", dtype=dtype, numerics=numerics, enforce_eager=True,
                  max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=384,
                  skip_tokenizer_init=True, kv_cache_memory=GPU_CACHE)
        runner, mine = llm.engine.runner, []
        execute = runner.execute
        runner.execute = lambda step, *a: (mine.append(step["starts"]), execute(step, *a))[1]
        calls.append(mine)
        return llm

    try:
        r = kernels_vs_torch(make, prompts, n=8)
    finally:
        set_kernels(None)
    print({k: v for k, v in r.items() if k != "tokens"})
    prefills = [s for s in calls[-1] if s is not None]
    # the kernel run's prefill steps carried several sequences' chunks at a time
    assert max(len(s) for s in prefills) >= 4 and len(prefills) < len(LENS), prefills
    assert r["mismatch"] is None and r["max_rel_err"] <= r["tol"], r


def forced_split_err(tiny_ckpt, monkeypatch, lens, max_model_len, channel_split):
    """-> (max |logit diff| of the sequence-parallel step forced at tp = 1 against the unsplit
    step, the unsplit step's own run-to-run spread), greedy prefill + 3 tokens of prompts `lens`."""
    from engine import SamplingParams
    from engine.parallel import sequence

    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(2, 129280, (m,), generator=g).tolist() for m in lens]

    def run():
        llm = LLM(tiny_ckpt("flash", 0), device="cuda", dtype=torch.bfloat16, numerics="reference",
                  enforce_eager=True, max_model_len=max_model_len, max_num_seqs=8, skip_tokenizer_init=True,
                  kv_cache_memory=GPU_CACHE)
        seen = []
        llm.engine.runner.logits_hook = lambda seqs, logits: seen.append(logits.float().cpu())
        try:
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        finally:
            llm.shutdown()
        return seen

    want, again = run(), run()
    floor = max((a - b).abs().max().item() for a, b in zip(want, again))
    monkeypatch.setattr(sequence, "split", lambda T: sequence.SeqSplit(T, 1, 0))
    monkeypatch.setattr(sequence, "CHANNEL_SPLIT", channel_split)
    gathers = []
    gather = sequence.gather
    monkeypatch.setattr(sequence, "gather", lambda *a: gathers.append(1) or gather(*a))
    channels = []
    if channel_split:
        cg = sequence.ChannelSplit.gather
        monkeypatch.setattr(sequence.ChannelSplit, "gather", lambda *a: channels.append(1) or cg(*a))
    got = run()
    assert gathers and len(got) == len(want) and bool(channels) == channel_split
    err = max((a - b).abs().max().item() for a, b in zip(got, want))
    print({"err": err, "floor": floor})
    return err, floor


def test_sequence_parallel_path_through_the_kernels(tiny_ckpt, monkeypatch):
    """The sequence-parallel prefill step (parallel/sequence.py) forced at tp = 1 (a split of one
    rank) on steps of every size through the kernels gives the unsplit step's logits: the gathered
    x rounded to FP8 by ops.fp8_sim where mhc_pre would have, the indexer's rows sliced and gathered
    back. Exact up to the run-to-run spread of the unsplit step itself (measured here: two unsplit
    runs). The compressors' channel split off: see the next test."""
    err, floor = forced_split_err(tiny_ckpt, monkeypatch, (600, 257, 131, 5), 1024, False)
    assert err <= 2 * floor, (err, floor)


def test_channel_split_through_the_kernels(tiny_ckpt, monkeypatch):
    """The same with the compressors' projections split by channel (sequence.ChannelSplit), on
    steps the engine splits (>= proj_gemm.UNFUSED_M tokens): there the unsplit step takes the
    per-projection GEMMs too, as proj_gemm's rows do. (At fewer tokens the unsplit step takes the
    packed kernel, whose sums come in another order: on the H100, 2026-12-07, that gave logits up
    to 16 away in reference numerics, where FP8 / FP4 roundings amplify a last-bit difference.)"""
    from engine.kernels import proj_gemm
    assert 1100 + 257 >= proj_gemm.UNFUSED_M
    err, floor = forced_split_err(tiny_ckpt, monkeypatch, (1100, 257), 2048, True)
    assert err <= 2 * floor, (err, floor)
