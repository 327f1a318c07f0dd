"""mHC post: expand a sub-layer output back to the streams and mix in the residual, one kernel.

out[k] = post[k] * f + sum_j comb[j, k] * res[j], fp32 math, stored in res's dtype. Replaces
the torch hc_post, mhc_post_ref below (a broadcast multiply, a batched matmul, an add and a cast).
Each program owns one token's D-chunk of all streams, so out may alias res (in place).

With `mix` = (fn_hi, fn_lo, eps) it also starts the next sub-layer's mHC projection (bf16_gemm's
mhc_mix: h_flat @ fn^T * rsqrt(mean(h_flat^2) + eps)) on the streams it has just written, while
they are in registers: each program (16 tokens x one D chunk) adds its chunk's share of the dots
and of the sum of squares into per-chunk partials (MixPartials), and mhc_pre sums them. That
removes the mix's own launch and its split-K tail (bench/RESULTS.md: ~14 us per call at M = 1,
for 1.5 MB of weights) from every sub-layer but the first.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.numerics import up
from .bf16_gemm import _dot, mhc_mix_ref
from .common import gdc_enter, pdl_args, round_to  # noqa: F401 (other kernels imported it from here)


@dataclass
class MixPartials:
    """The next mHC mix as partial sums per D chunk: parts [C, T, N + 1] fp32, where
    parts[c, t, :N] is chunk c's share of h_flat[t] @ fn^T and parts[c, t, N] its share of
    sum(h_flat[t]^2); K = hc * D. mix = sum_c parts[..., :N] * rsqrt(sum_c parts[..., N] / K + eps)."""
    parts: torch.Tensor
    K: int
    eps: float

    def mix(self) -> torch.Tensor:
        """-> the mix [T, N] fp32, in torch (the reference's reading; mhc_pre sums in its kernel)."""
        p = self.parts.sum(0)
        return p[:, :-1] * torch.rsqrt(p[:, -1:] / self.K + self.eps)


@triton.jit
def _mhc_post_mix_kernel(f_ptr, res_ptr, post_ptr, comb_ptr, out_ptr, hi_ptr, lo_ptr, part_ptr,
                         T, D, N, stride_ft, stride_rt, stride_rj, stride_ot, stride_oj, stride_fn, stride_pc,
                         HC: tl.constexpr, HAS_LO: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_N: tl.constexpr, USE_GDC: tl.constexpr = False):
    gdc_enter(USE_GDC)
    c = tl.program_id(1)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = c * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    tm, dm, nm = t < T, d < D, n < N
    m2 = tm[:, None] & dm[None, :]
    f = tl.load(f_ptr + t[:, None] * stride_ft + d[None, :], mask=m2, other=0.0).to(tl.float32)   # [BT,BD]
    dots = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    ss = tl.zeros([BLOCK_T], tl.float32)
    ty = out_ptr.dtype.element_ty
    for k in tl.static_range(HC):
        acc = tl.load(post_ptr + t * HC + k, mask=tm, other=0.0)[:, None] * f
        for j in tl.static_range(HC):
            cjk = tl.load(comb_ptr + t * HC * HC + j * HC + k, mask=tm, other=0.0)                 # [BT]
            rj = tl.load(res_ptr + t[:, None] * stride_rt + j * stride_rj + d[None, :], mask=m2, other=0.0)
            acc += cjk[:, None] * rj.to(tl.float32)
        acc = round_to(acc, ty)                                  # the stored stream, exactly
        tl.store(out_ptr + t[:, None] * stride_ot + k * stride_oj + d[None, :], acc.to(ty), mask=m2)
        # the mix reads stream k's chunk at flat columns k * D + d
        w = n[:, None] * stride_fn + k * D + d[None, :]                                           # [BN,BD]
        wm = nm[:, None] & dm[None, :]
        dots = _dot(acc.to(ty), tl.load(hi_ptr + w, mask=wm, other=0.0), dots)
        if HAS_LO:
            dots = _dot(acc.to(ty), tl.load(lo_ptr + w, mask=wm, other=0.0), dots)
        ss += tl.sum(acc * acc, axis=1)
    p = part_ptr + c * stride_pc + t * (N + 1)                                                   # [BT]
    tl.store(p[:, None] + n[None, :], dots, mask=tm[:, None] & nm[None, :])
    tl.store(p + N, ss, mask=tm)


@triton.jit
def _mhc_post_kernel(f_ptr, res_ptr, post_ptr, comb_ptr, out_ptr, D,
                     stride_ft, stride_rt, stride_rj, stride_ot, stride_oj,
                     HC: tl.constexpr, BLOCK_D: tl.constexpr, USE_GDC: tl.constexpr = False):
    gdc_enter(USE_GDC)
    t = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    k = tl.arange(0, HC)
    f = tl.load(f_ptr + t * stride_ft + d, mask=dm, other=0.0).to(tl.float32)               # [BD]
    post = tl.load(post_ptr + t * HC + k)                                                  # [HC]
    acc = post[:, None] * f[None, :]                                                       # [HC(k), BD]
    for j in tl.static_range(HC):
        # comb row j: the weights input stream j gives to each output stream k
        cj = tl.load(comb_ptr + t * HC * HC + j * HC + k)                                  # [HC(k)]
        rj = tl.load(res_ptr + t * stride_rt + j * stride_rj + d, mask=dm, other=0.0).to(tl.float32)
        acc += cj[:, None] * rj[None, :]
    o = out_ptr + t * stride_ot + k[:, None] * stride_oj + d[None, :]
    tl.store(o, round_to(acc, out_ptr.dtype.element_ty), mask=dm[None, :])


def mhc_post(f: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
             out: torch.Tensor | None = None, block_d: int = 512, mix=None):
    """f [...,D], res [...,hc,D], post [...,hc] fp32, comb [...,hc,hc] fp32 -> [...,hc,D] (res dtype).

    `out` (same shape and dtype as res, may be res itself) is written in place when given.
    mix = (fn_hi, fn_lo or None, eps) (Block.mix_weight of the next sub-layer, its eps): returns
    (streams, MixPartials of the next sub-layer's mix) instead; out may not alias res then."""
    if mix is not None:
        return _post_mix(f, res, post, comb, out, *mix)
    hc, D = res.shape[-2:]
    assert hc & (hc - 1) == 0, "hc must be a power of two (register tiles)"
    lead = res.shape[:-2]
    f2 = f.reshape(-1, D)
    r3 = res.reshape(-1, hc, D)
    assert f2.stride(-1) == 1 and r3.stride(-1) == 1
    T = r3.shape[0]
    p2 = post.reshape(T, hc).float().contiguous()
    c3 = comb.reshape(T, hc, hc).float().contiguous()
    o = torch.empty_like(r3) if out is None else out.view(T, hc, D)
    if T:
        block = min(block_d, triton.next_power_of_2(D))
        grid = (T, triton.cdiv(D, block))
        _mhc_post_kernel[grid](f2, r3, p2, c3, o, D, f2.stride(0), r3.stride(0), r3.stride(1),
                               o.stride(0), o.stride(1), HC=hc, BLOCK_D=block, num_warps=4, **pdl_args())
    return o.view(*lead, hc, D) if out is None else out


MIX_BLOCK_T, MIX_BLOCK_D, MIX_WARPS = 16, 128, 4   # tokens (the dots' M), columns and warps per program of the fused mix


def _post_mix(f, res, post, comb, out, fn_hi, fn_lo, eps):
    hc, D = res.shape[-2:]
    assert hc & (hc - 1) == 0, "hc must be a power of two (register tiles)"
    lead = res.shape[:-2]
    f2, r3 = f.reshape(-1, D), res.reshape(-1, hc, D)
    assert f2.stride(-1) == 1 and r3.stride(-1) == 1 and fn_hi.stride(-1) == 1
    T, N = r3.shape[0], fn_hi.shape[0]
    assert fn_hi.shape == (N, hc * D) and (fn_lo is None or fn_lo.stride() == fn_hi.stride())
    p2 = post.reshape(T, hc).float().contiguous()
    c3 = comb.reshape(T, hc, hc).float().contiguous()
    o = torch.empty_like(r3) if out is None else out.view(T, hc, D)
    assert o.data_ptr() != r3.data_ptr(), "the fused mix reads every stream after writing some: no aliasing"
    C = triton.cdiv(D, MIX_BLOCK_D)
    parts = torch.empty(C, T, N + 1, dtype=torch.float32, device=res.device)
    if T:
        grid = (triton.cdiv(T, MIX_BLOCK_T), C)
        _mhc_post_mix_kernel[grid](f2, r3, p2, c3, o, fn_hi, fn_lo if fn_lo is not None else fn_hi, parts,
                                   T, D, N, f2.stride(0), r3.stride(0), r3.stride(1), o.stride(0), o.stride(1),
                                   fn_hi.stride(0), parts.stride(0), HC=hc, HAS_LO=fn_lo is not None,
                                   BLOCK_T=MIX_BLOCK_T, BLOCK_D=MIX_BLOCK_D,
                                   BLOCK_N=max(16, triton.next_power_of_2(N)), num_warps=MIX_WARPS, **pdl_args())
    h = o.view(*lead, hc, D) if out is None else out
    return h, MixPartials(parts, hc * D, eps)


def mhc_post_ref(f, res, post, comb, out=None, block_d=None, mix=None):
    """Torch reference, and the model's hc_post (engine.model.mhc imports it):
    out[k] = post[k] * f + sum_j comb[j, k] * res[j]  ->  [...,hc,D] in res's dtype.
    mix = (fn_hi, fn_lo, eps): also the next sub-layer's mix of those streams (mhc_mix_ref),
    returned as (streams, mix [...,N])."""
    y = (post[..., None] * up(f)[..., None, :] + comb.transpose(-1, -2) @ up(res)).to(res.dtype)
    y = y if out is None else out.copy_(y)
    if mix is None:
        return y
    fn_hi, fn_lo, eps = mix
    return y, mhc_mix_ref(y, fn_hi, fn_lo, eps)
