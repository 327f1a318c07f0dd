"""RMSNorm, one kernel: y = w * x * rsqrt(mean(x^2) + eps) in fp32, stored in x's dtype.

Replaces rms_norm_ref below (the model's rms_norm; up-cast, square, mean, add, rsqrt, two multiplies, cast:
eight kernels) where a standalone norm remains after the fusions (the q LoRA norm, the final
norm); the sub-layer norms live inside mhc_pre and the compressor's inside its kernel.
"""
import torch
import triton
import triton.language as tl

from engine.numerics import up
from .common import gdc_enter, pdl_args, round_to


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, D, stride_x, stride_y, eps, HAS_W: tl.constexpr, BLOCK: tl.constexpr,
                     USE_GDC: tl.constexpr = False):
    gdc_enter(USE_GDC)
    t = tl.program_id(0)
    d = tl.arange(0, BLOCK)
    m = d < D
    x = tl.load(x_ptr + t * stride_x + d, mask=m, other=0.0).to(tl.float32)
    y = x * tl.math.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    if HAS_W:
        y = tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32) * y
    tl.store(y_ptr + t * stride_y + d, round_to(y, y_ptr.dtype.element_ty), mask=m)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., D] (bf16 or fp32), weight [D] or None -> [..., D] in x's dtype."""
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device) if out is None else out.view(-1, D)
    if x2.shape[0]:
        block = triton.next_power_of_2(D)
        _rms_norm_kernel[(x2.shape[0],)](x2, weight if weight is not None else x2, y, D, x2.stride(0), y.stride(0),
                                         eps, HAS_W=weight is not None, BLOCK=block,
                                         num_warps=min(16, max(1, block // 256)), **pdl_args())
    return y.view(x.shape) if out is None else out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Torch reference, and the model's rms_norm: DeepSeek's order (normalise and weight in fp32,
    then cast to x's dtype)."""
    xf = up(x)
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = up(weight) * y
    return y.to(x.dtype)
