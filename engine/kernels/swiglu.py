"""The shared expert's activation in one kernel: SwiGLU of its gate and up projections, rounded to the
model dtype and, in reference numerics, to e4m3 per 128 channels (the input rounding of its FP8
down projection), so w2's GEMM reads it as is.

In torch this is ~8 launches per layer (two casts, two clamps, silu, multiply, the cast back and
the act_sim round trip); here one program per token and block of channels reads g and u once
and writes the result once.
"""
import torch
import triton
import triton.language as tl

from engine.numerics import fp8_sim_ref
from .act_sim import fp8_round_trip
from .common import gdc_enter, pdl_args, round_to
from .fused_moe import swiglu

QBLOCK = 128


@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, y_ptr, I, stride_g, stride_u, stride_y, limit,
                   FP8: tl.constexpr, BLOCK: tl.constexpr, USE_GDC: tl.constexpr = False):
    gdc_enter(USE_GDC)
    t = tl.program_id(0)
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = d < I
    g = tl.minimum(tl.load(g_ptr + t * stride_g + d, mask=m, other=0.0).to(tl.float32), limit)
    u = tl.load(u_ptr + t * stride_u + d, mask=m, other=0.0).to(tl.float32)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    ty = y_ptr.dtype.element_ty
    y = round_to(g / (1.0 + tl.exp(-g)) * u, ty)                 # silu(g) * u, in the model dtype
    if FP8:
        y = round_to(fp8_round_trip(y, BLOCK, 128), ty)
    tl.store(y_ptr + t * stride_y + d, y.to(ty), mask=m)


def swiglu_act(g: torch.Tensor, u: torch.Tensor, limit: float, fp8: bool, out_dtype=None) -> torch.Tensor:
    """g, u [..., I] -> silu(min(g, limit)) * clamp(u, +-limit) in out_dtype (default g's), then
    its e4m3 round trip per 128 channels if fp8. limit 0: no clamp. fp8 needs I % 128 == 0 (else
    the reference runs)."""
    dtype = out_dtype or g.dtype
    I = g.shape[-1]
    if fp8 and I % QBLOCK:
        return swiglu_act_ref(g, u, limit, fp8, dtype)
    g2, u2 = g.reshape(-1, I), u.reshape(-1, I)
    if g2.stride(-1) != 1 or u2.stride(-1) != 1:
        g2, u2 = g2.contiguous(), u2.contiguous()
    y = torch.empty(g2.shape, dtype=dtype, device=g.device)
    if g2.shape[0]:
        block = min(1024, triton.next_power_of_2(max(I, QBLOCK)))
        _swiglu_kernel[(g2.shape[0], triton.cdiv(I, block))](
            g2, u2, y, I, g2.stride(0), u2.stride(0), y.stride(0), limit if limit > 0 else float("inf"),
            FP8=fp8, BLOCK=block, num_warps=4, **pdl_args())
    return y.view(*g.shape[:-1], I)


def swiglu_act_ref(g: torch.Tensor, u: torch.Tensor, limit: float, fp8: bool, out_dtype=None) -> torch.Tensor:
    """Torch reference: fused_moe.swiglu (the model's), cast, then fp8_sim when fp8."""
    y = swiglu(g, u, limit).to(out_dtype or g.dtype)
    return fp8_sim_ref(y, QBLOCK) if fp8 else y
