"""RoPE on per-head rows, one kernel: the attention output's inverse rotation, and the
indexer's queries (rotation, then in reference numerics Hadamard and the FP4 round trip).

x [T, H, D] (bf16 or fp32), rotated on its last R dims (interleaved pairs) by the token's
cos/sin table [T, R/2], rounded to x's dtype as common.apply_rope rounds; with
`fp4`, each head row is then Hadamard-rotated (rounded) and e2m1-rounded per 32 channels,
as engine.model.indexer.Indexer.queries does. Replaces ~10 torch ops (apply_rope) or ~35
(apply_rope + hadamard + fp4_sim) per call. Grid (T, head blocks).
"""
import torch
import triton
import triton.language as tl

from engine.numerics import fp4_sim_ref, hadamard
from .act_sim import fp4_round_trip, hadamard_rows
from .common import gdc_enter, hold, pdl_args, apply_rope, round_to
from .rope_kv import _rope


@triton.jit
def _rope_q_kernel(args, K: tl.constexpr, USE_GDC: tl.constexpr = False):
    gdc_enter(USE_GDC)
    rope_q_program(tl.program_id(0), tl.program_id(1), args, K)


@triton.jit
def rope_q_program(t, hb, args, K: tl.constexpr):
    """Program (token t, head block hb) of the grid (T, head blocks): args and K as rope_q_launch
    makes them (kv_prep.py runs these programs in its launch too)."""
    x_ptr, y_ptr, cos_ptr, sin_ptr, H, stride_xt, stride_xh, stride_cs, hscale = args
    D: tl.constexpr = K[0]
    R: tl.constexpr = K[1]
    BLOCK_H: tl.constexpr = K[2]
    INVERSE: tl.constexpr = K[3]
    FP4: tl.constexpr = K[4]
    LOG_D: tl.constexpr = K[5]
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = (h < H)[:, None]
    d = tl.arange(0, D)
    p = tl.arange(0, D // 2) - (D - R) // 2
    pm = p >= 0
    cos = tl.load(cos_ptr + t * stride_cs + p, mask=pm, other=1.0)
    sin = tl.load(sin_ptr + t * stride_cs + p, mask=pm, other=0.0)
    if INVERSE:
        sin = -sin
    x = tl.load(x_ptr + t * stride_xt + h[:, None] * stride_xh + d[None, :], mask=hm, other=0.0)
    out_ty = y_ptr.dtype.element_ty
    y = round_to(_rope(x.to(tl.float32), cos, sin, BLOCK_H, D, R), out_ty)
    if FP4:
        y = round_to(hadamard_rows(y, hscale, BLOCK_H, D, LOG_D), out_ty)
        y = round_to(tl.reshape(fp4_round_trip(tl.reshape(y, (BLOCK_H * D,)), BLOCK_H * D, 32), (BLOCK_H, D)), out_ty)
    tl.store(y_ptr + (t * H + h[:, None]) * D + d[None, :], y, mask=hm)


def rope_q(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False, fp4: bool = False,
           block_h: int = 4) -> torch.Tensor:
    """x [..., H, D], cos/sin [..., R/2] fp32 (one row per token) -> a new [..., H, D] in x's dtype."""
    H, D = x.shape[-2:]
    lead = x.shape[:-2]
    x3 = x.reshape(-1, H, D)
    y = torch.empty(x3.shape, dtype=x.dtype, device=x.device)
    if x3.shape[0]:
        grid, args, K = rope_q_launch(x3, cos, sin, inverse, fp4, block_h, y)
        if not hold(_rope_q_kernel, grid, args, K):
            _rope_q_kernel[grid](args, K=K, num_warps=4, **pdl_args())
    return y.view(*lead, H, D)


def rope_q_launch(x3, cos, sin, inverse, fp4, block_h, y):
    """rope_q's launch on x3 [T,H,D] (T >= 1) into y -> (grid, args, constexprs K) of
    rope_q_program (its kernel's, or kv_prep's share of a launch)."""
    T, H, D = x3.shape
    R = 2 * cos.shape[-1]
    assert D & (D - 1) == 0 and x3.stride(-1) == 1 and (not fp4 or D % 32 == 0)
    c2, s2 = cos.reshape(T, -1).float().contiguous(), sin.reshape(T, -1).float().contiguous()
    bh = min(block_h, triton.next_power_of_2(H))
    args = (x3, y, c2, s2, H, x3.stride(0), x3.stride(1), c2.stride(0), D ** -0.5)
    return (T, triton.cdiv(H, bh)), args, (D, R, bh, inverse, fp4, D.bit_length() - 1)


def rope_q_ref(x, cos, sin, inverse=False, fp4=False, block_h=None):
    """Torch reference: apply_rope over the heads, then (fp4) Indexer.queries' rounding."""
    y = apply_rope(x, cos[..., None, :], sin[..., None, :], inverse=inverse)
    return fp4_sim_ref(hadamard(y), 32) if fp4 else y
