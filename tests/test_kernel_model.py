"""The whole tiny model through the Triton kernels == through the torch references (CPU, interpreter).

A child process (tests/interp.py) runs the engine on CPU on the same prompts three times: torch
in bf16, torch in fp32, and bf16 with every kernel that runs on CPU on (engine.kernels.
CPU_INTERPRETED: sparse attention, indexer, mHC mix/pre/post, RoPE + ring write, router, bf16
GEMM, act_sim, compressor, rms_norm, rope_q, and the fused MoE on experts packed as MXFP4 or,
for the nvfp4 preset, as the checkpoint's own NVFP4 codes), in plain and reference numerics.

Two discrete choices would make any comparison chaotic (a rounding-level difference picks
another expert or key and the logits jump), so they are held still: the later runs' expert
routing is pinned to the first run's (tests/routing_pin.py; a run's own choice is kept wherever
it agrees) and the indexer selects every entry (its top-k has its own kernel tests).

What "agree" means is measured, not assumed: the torch bf16 run against the torch fp32 run is
this random model's bf16 noise floor (~1.3e-2 of the logits' max-abs in plain numerics, ~0.15 in
reference numerics, where every FP8/FP4 rounding is a step that one ulp can cross). The kernels
must agree with torch bf16 within max(1e-2, 1.5 x that floor), and the greedy tokens must be
equal except at a near-tie (top-two margin within the same tolerance). A wrong kernel moves the
logits by O(1). The GPU twin is tests/test_gpu_model_kernels.py.
"""
import json
import sys
import tempfile

import pytest

from interp import finished, started

TOL = 1e-2
CASES = {"tiny-plain": (30, 11, 5), "tiny-reference": (30, 11, 5), "flash-plain": (44, 9), "nvfp4-plain": (20, 7)}


@pytest.fixture(scope="module")
def children():
    """One interpreter child per case, all started at once; awaited per test."""
    with started(__file__, CASES) as procs:
        yield procs


@pytest.mark.parametrize("case", list(CASES))
def test_kernels_match_torch(children, case):
    out = finished(children[case], timeout=1500)
    r = json.loads(out.strip().splitlines()[-1])
    print(case, {k: v for k, v in r.items() if k != "tokens"})
    assert r["mismatch"] is None and r["max_rel_err"] <= r["tol"], r


def greedy(llm, prompts, n):
    """-> greedy token ids per prompt, and {(prompt, step): fp64 logits}."""
    from engine import SamplingParams

    seen = {}

    def hook(seqs, logits):
        for s, row in zip(seqs, logits):
            seen[(prompts.index(s.prompt_ids), len(s.output_ids))] = row.double().clone()

    llm.engine.runner.logits_hook = hook
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    llm.engine.runner.logits_hook = None
    return [o.token_ids for o in outs], seen


def compare(want, want_logits, got, got_logits, tol=TOL):
    """-> (max rel err over the compared steps, first clear-margin token mismatch or None).
    A request is compared up to its first differing token; that difference must be a near-tie."""
    worst, mismatch = 0.0, None
    for i, (a, b) in enumerate(zip(want, got)):
        for step in range(len(a)):
            ref, out = want_logits[(i, step)], got_logits[(i, step)]
            worst = max(worst, ((out - ref).abs().max() / ref.abs().max()).item())
            if a[step] != b[step]:
                top2 = ref.topk(2).values
                if (top2[0] - top2[1]).item() > tol * ref.abs().max().item() and mismatch is None:
                    mismatch = (i, step)
                break
    return worst, mismatch


def kernels_vs_torch(make_llm, prompts, n=6, kernels="all", prepare=None):
    """Torch bf16 (routing recorded), torch fp32 and `kernels` on in bf16 (routing pinned) ->
    {max_rel_err, floor, tol, mismatch, pinned, tokens} (see the module docstring).
    prepare(llm): what the kernel run does to the loaded model first (CPU: pack the experts)."""
    import torch
    import engine.kernels as K
    import routing_pin

    runs, pins, counts = [], None, []
    for which, dtype in (("none", torch.bfloat16), ("none", torch.float32), (kernels, torch.bfloat16)):
        K.set_kernels(which)
        llm = make_llm(dtype)
        if prepare is not None and which != "none":
            prepare(llm)
        for layer in llm.model.layers:
            if layer.attn.indexer is not None:
                layer.attn.indexer.topk = 1 << 20
        with (routing_pin.record() if pins is None else routing_pin.replay(pins)) as p:
            runs.append(greedy(llm, prompts, n))
        if pins is None:
            pins = p
        else:
            counts.append(f"{p.pinned}/{p.calls}")
        del llm
    floor, _ = compare(*runs[1], *runs[0], tol=float("inf"))
    tol = max(TOL, 1.5 * floor)
    worst, mismatch = compare(*runs[0], *runs[2], tol=tol)
    return dict(max_rel_err=worst, floor=floor, tol=tol, mismatch=mismatch, pinned=counts[1],
                tokens=[runs[0][0], runs[2][0]])


def pack_experts(llm):
    from engine.model.moe import Experts

    for m in llm.model.modules():
        if isinstance(m, Experts):
            assert m.pack(), "experts did not pack"


def _child(case: str):
    """Run one case under the interpreter; its result is the last line printed (JSON)."""
    from interp import patch_interpreter
    patch_interpreter()
    import torch
    import engine.kernels as K
    from engine import LLM
    from weights.make_tiny import make_tiny

    K.CPU_INTERPRETED = True
    preset, numerics = case.split("-")
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny(f"{tmp}/{case}", preset=preset, seed=0)
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(2, 129280, (m,), generator=g).tolist() for m in CASES[case]]
        # the fused MoE's packed experts (prepare_kernels packs them when the kernel runs: checked)
        out = kernels_vs_torch(lambda dtype: LLM(path, device="cpu", dtype=dtype, numerics=numerics,
                                                 max_model_len=512, skip_tokenizer_init=True), prompts,
                               n=4 if preset != "nvfp4" else 3, prepare=pack_experts)
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1]))
