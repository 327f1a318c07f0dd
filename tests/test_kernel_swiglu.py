"""The shared expert's SwiGLU + rounding kernel (engine.kernels.swiglu) against its reference.

CPU: the interpreter in a child process (tests/interp.py). The kernel and the reference round
the same fp32 value to bf16 (then to the e4m3 grid), so they agree except where silu's exp
differs in the last fp32 bit and a rounding flips: then by one step of the output grid (bf16
2^-8, e4m3 2^-3 relative), on at most 1% of the elements; fp32 outputs <= 1e-6. GPU (`pytest -m gpu`): the real width.
"""
import os
import sys

import pytest
import torch

from interp import patch_interpreter, run_child
from engine.kernels import swiglu as sw


def inputs(T, I, dtype, device="cpu", seed=0):
    g = torch.Generator(device).manual_seed(seed)
    gate = torch.randn(T, I, generator=g, device=device) * 4          # reaches both clamps at limit 10
    up_ = torch.randn(T, I, generator=g, device=device) * 4
    return gate.to(dtype), up_.to(dtype)


def check(T, I, dtype, limit, fp8, device="cpu"):
    g, u = inputs(T, I, dtype, device, seed=T + I)
    y = sw.swiglu_act(g, u, limit, fp8, dtype)
    ref = sw.swiglu_act_ref(g, u, limit, fp8, dtype)
    assert y.shape == ref.shape and y.dtype == ref.dtype == dtype
    rel = (y.float() - ref.float()).abs() / ref.float().abs().clamp(min=1e-3)
    step = 2 ** -3 if fp8 else 2 ** -8 if dtype == torch.bfloat16 else 1e-6   # one e4m3 / bf16 step
    assert rel.max().item() <= step, (T, I, dtype, limit, fp8, rel.max().item())
    # a last-bit difference of exp may flip a rounding; anything more than a few is a bug
    assert (rel > 1e-6).float().mean().item() <= 1e-2, (T, I, dtype, limit, fp8)
    if fp8:   # on the grid w2's rounding expects: rounding again changes nothing
        from engine.numerics import fp8_sim_ref
        assert torch.equal(fp8_sim_ref(y, 128), y)


def interp_swiglu():
    for T, I, dtype, limit, fp8 in [(1, 256, torch.bfloat16, 10.0, True), (5, 128, torch.bfloat16, 10.0, False),
                                    (3, 384, torch.float32, 0.0, True), (2, 64, torch.float32, 0.5, False)]:
        check(T, I, dtype, limit, fp8)


def test_interpreter():
    run_child(__file__, "interp_swiglu")


def test_ref_is_the_models_math():
    """The reference is the step's former torch path: swiglu, cast, fp8_sim."""
    from engine.kernels.fused_moe import swiglu
    from engine.numerics import fp8_sim_ref
    g, u = inputs(4, 256, torch.bfloat16)
    assert torch.equal(sw.swiglu_act_ref(g, u, 10.0, True), fp8_sim_ref(swiglu(g, u, 10.0).to(torch.bfloat16), 128))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 64, 512])
def test_gpu_real_width(T):
    for fp8 in (True, False):
        check(T, 256, torch.bfloat16, 10.0, fp8, "cuda")      # one TP=8 rank of the 2048-wide shared expert
        check(T, 2048, torch.bfloat16, 10.0, fp8, "cuda")


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    patch_interpreter()
    globals()[sys.argv[1]]()
