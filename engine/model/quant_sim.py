"""DeepSeek's quantisation-aware numerics, simulated (quantise then dequantise in place).

Used only in `reference` numerics: the official inference code rounds the KV cache's
non-rope channels through FP8, the indexer's queries and keys through a Hadamard
rotation and FP4, and every FP8/FP4 GEMM's activations through FP8 per 128 channels.
All scales are powers of two (UE8M0).
"""
import torch

from ..kernels import runs_kernel
from .precision import up

FP8_MAX = 448.0
FP4_MAX = 6.0


def _pow2_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """2^ceil(log2(amax/qmax)), exactly: from frexp, as DeepSeek's kernels take it from the
    float's bits (log2 rounds to the power of two within an ulp above one)."""
    mant, e = torch.frexp(amax / qmax)
    return torch.exp2(torch.where(mant == 0.5, e - 1, e).to(amax.dtype))


def _to_e4m3(y: torch.Tensor) -> torch.Tensor:
    """Round to e4m3 (nearest, ties to even). torch casts fp64 through fp32, which rounds
    twice; rounding to odd in fp32 first makes the second rounding the correct one."""
    if y.dtype == torch.float64:
        f = y.float()
        inexact = f.double() != y
        f = torch.where(inexact & (f.double().abs() > y.abs()), torch.nextafter(f, torch.zeros_like(f)), f)
        y = torch.where(inexact, (f.view(torch.int32) | 1).view(torch.float32), f)
    return y.to(torch.float8_e4m3fn)


def fp8_sim(x: torch.Tensor, block: int) -> torch.Tensor:
    """e4m3 round trip per `block` channels of the last dim (one kernel where it runs)."""
    if runs_kernel("act_sim", x) and x.shape[-1] % block == 0:
        from ..kernels.act_sim import fp8_sim as kernel

        return kernel(x, block)
    return fp8_sim_ref(x, block)


def fp8_sim_ref(x: torch.Tensor, block: int) -> torch.Tensor:
    """Torch reference of fp8_sim."""
    xb = up(x).unflatten(-1, (-1, block))
    s = _pow2_scale(xb.abs().amax(-1, keepdim=True).clamp(min=1e-4), FP8_MAX)
    q = up(_to_e4m3((xb / s).clamp(-FP8_MAX, FP8_MAX))).to(xb.dtype)
    return (q * s).flatten(-2).to(x.dtype)


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e2m1 value (0, .5, 1, 1.5, 2, 3, 4, 6), ties to the even code."""
    a = x.abs()
    y = torch.where(a <= 0.25, 0.0,
        torch.where(a < 0.75, 0.5,
        torch.where(a <= 1.25, 1.0,
        torch.where(a < 1.75, 1.5,
        torch.where(a <= 2.5, 2.0,
        torch.where(a < 3.5, 3.0,
        torch.where(a <= 5.0, 4.0, 6.0)))))))
    return torch.copysign(y, x)


def fp4_sim(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """e2m1 round trip per `block` channels of the last dim (one kernel where it runs)."""
    if runs_kernel("act_sim", x) and x.shape[-1] % block == 0:
        from ..kernels.act_sim import fp4_sim as kernel

        return kernel(x, block)
    return fp4_sim_ref(x, block)


def fp4_sim_ref(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Torch reference of fp4_sim."""
    xb = up(x).unflatten(-1, (-1, block))
    s = _pow2_scale(xb.abs().amax(-1, keepdim=True).clamp(min=FP4_MAX * 2.0 ** -126), FP4_MAX)
    q = round_e2m1((xb / s).clamp(-FP4_MAX, FP4_MAX))
    return (q * s).flatten(-2).to(x.dtype)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Walsh-Hadamard transform (Sylvester order) over the last dim, scaled by n^-1/2."""
    n = x.shape[-1]
    assert n & (n - 1) == 0, "Hadamard size must be a power of two"
    shape, y, h = x.shape, up(x), 1
    while h < n:
        y = y.reshape(*shape[:-1], n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2)
        h *= 2
    return (y.reshape(shape) * n ** -0.5).to(x.dtype)
