"""DeepSeek's quantise-dequantise round trips (engine.numerics) in one kernel each.

fp8_sim: e4m3 per `block` channels (before every FP8/FP4 GEMM in reference numerics, and the
KV cache's non-rope dims). fp4_sim: e2m1 per 32 channels (the indexer's queries and keys).
hadamard_rows: the rotation the indexer applies before its FP4 rounding (used in-kernel).
The torch versions take ~20 (fp8) and ~30 (fp4) elementwise kernels per call; these read x
once and write it once. Scales are powers of two taken from the float's bits, so the kernel
and the reference agree exactly (the round trip is exact in fp32; the reference's fp64 only
matters when the model itself runs in fp64).
"""
import torch
import triton
import triton.language as tl

from engine.numerics import fp4_sim_ref, fp8_sim_ref  # noqa: F401 (the references)
from .common import gdc_enter, pdl_args, round_to


@triton.jit
def _rint(v):
    return (v + 12582912.0) - 12582912.0                    # 1.5 * 2^23: |v| < 2^22 -> rint, ties even


@triton.jit
def _e4m3(y):
    """Round fp32 |y| <= 448 to e4m3 (nearest, ties even), exactly, from the float's bits."""
    e = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6)                                    # e4m3 subnormals: step 2^-9
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((3 - e + 127) << 23).to(tl.float32, bitcast=True)
    return _rint(y * inv) * step                             # |y * inv| < 16: exact (power of two)


@triton.jit
def _e2m1(y):
    """Round fp32 |y| <= 6 to e2m1 {0, .5, 1, 1.5, 2, 3, 4, 6} (nearest, ties to the even code)."""
    a = tl.abs(y)
    step = tl.where(a < 2.0, 0.5, tl.where(a < 4.0, 1.0, 2.0))
    r = _rint(a / step) * step                               # a / step: exact (power of two)
    return tl.where(y < 0, -r, r)


@triton.jit
def _pow2_at_least(amax, QB: tl.constexpr, QM: tl.constexpr):
    """Smallest 2^k with amax <= qmax * 2^k, qmax = 1.QM * 2^QB given as the mantissa bits QM
    (448 = 1.75 * 2^8: QM = 0x600000; 6 = 1.5 * 2^2: QM = 0x400000) -> (2^k, 2^-k)."""
    bits = amax.to(tl.int32, bitcast=True)
    k = ((bits >> 23) & 0xFF) - 127 - QB + ((bits & 0x7FFFFF) > QM).to(tl.int32)
    return ((k + 127) << 23).to(tl.float32, bitcast=True), ((127 - k) << 23).to(tl.float32, bitcast=True)


@triton.jit
def fp8_quant(y, N: tl.constexpr, FB: tl.constexpr):
    """y [N] fp32 -> (its e4m3 values [N/FB, FB] as fp32, scales [N/FB]) per FB channels, scale
    2^ceil(log2(amax / 448)): the codes the FP8 tensor cores take (numerics.fp8_codes_ref)."""
    b = tl.reshape(y, (N // FB, FB))
    s, inv = _pow2_at_least(tl.maximum(tl.max(tl.abs(b), axis=1), 1e-4), 8, 0x600000)
    q = tl.minimum(tl.maximum(b * inv[:, None], -448.0), 448.0)
    return _e4m3(q), s


@triton.jit
def fp8_round_trip(y, N: tl.constexpr, FB: tl.constexpr):
    """y [N] fp32 -> e4m3 round trip per FB channels, scale 2^ceil(log2(amax / 448))."""
    e, s = fp8_quant(y, N, FB)
    return tl.reshape(e * s[:, None], (N,))


@triton.jit
def fp4_round_trip(y, N: tl.constexpr, FB: tl.constexpr):
    """y [N] fp32 -> e2m1 round trip per FB channels, scale 2^ceil(log2(amax / 6))."""
    b = tl.reshape(y, (N // FB, FB))
    s, inv = _pow2_at_least(tl.maximum(tl.max(tl.abs(b), axis=1), 6.0 * 2.0 ** -126), 2, 0x400000)
    q = tl.minimum(tl.maximum(b * inv[:, None], -6.0), 6.0)
    return tl.reshape(_e2m1(q) * s[:, None], (N,))


@triton.jit
def hadamard_rows(y, scale, M: tl.constexpr, N: tl.constexpr, LOG_N: tl.constexpr):
    """Walsh-Hadamard (Sylvester order) of each row of y [M, N] fp32, times scale = N^-1/2: the
    butterfly of numerics.hadamard, adding and subtracting in its order (bit-exact in fp32)."""
    for i in tl.static_range(LOG_N):                       # stage i pairs channels 2^i apart
        t = tl.permute(tl.reshape(y, (M, N >> (i + 1), 2, 1 << i)), (0, 1, 3, 2))   # [M, N/2h, h, 2]
        a, b = tl.split(t)
        y = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (M, N))
    return y * scale


@triton.jit
def _sim_kernel(x_ptr, y_ptr, D, stride_xt, stride_yt,
                FP4: tl.constexpr, FB: tl.constexpr, BLOCK: tl.constexpr, USE_GDC: tl.constexpr = False):
    gdc_enter(USE_GDC)
    t = tl.program_id(0)
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = d < D                                                # D % FB == 0: whole blocks only
    x = tl.load(x_ptr + t * stride_xt + d, mask=m, other=0.0).to(tl.float32)
    if FP4:
        y = fp4_round_trip(x, BLOCK, FB)
    else:
        y = fp8_round_trip(x, BLOCK, FB)
    tl.store(y_ptr + t * stride_yt + d, round_to(y, y_ptr.dtype.element_ty), mask=m)


def _launch(x, block, fp4, out):
    D = x.shape[-1]
    assert D % block == 0 and block & (block - 1) == 0, (D, block)
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device) if out is None else out.view(-1, D)
    if x2.shape[0]:
        bl = min(max(block, 1024), triton.next_power_of_2(D))
        _sim_kernel[(x2.shape[0], triton.cdiv(D, bl))](x2, y, D, x2.stride(0), y.stride(0),
                                                       FP4=fp4, FB=block, BLOCK=bl, num_warps=4, **pdl_args())
    return y.view(x.shape) if out is None else out


def fp8_sim(x: torch.Tensor, block: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., D] (fp32 or bf16) -> its e4m3 round trip per `block` channels, same shape and dtype."""
    return _launch(x, block, False, out)


def fp4_sim(x: torch.Tensor, block: int = 32, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., D] -> its e2m1 round trip per `block` channels, same shape and dtype."""
    return _launch(x, block, True, out)
