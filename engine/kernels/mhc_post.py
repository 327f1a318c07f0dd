"""mHC post: expand a sub-layer output back to the streams and mix in the residual, one kernel.

out[k] = post[k] * f + sum_j comb[j, k] * res[j], fp32 math, stored in res's dtype. f is taken in
res's dtype: a wider f (the MoE's fp32 sum after its all-reduce) is rounded to it in registers,
the cast the sub-layer's output gets in the reference, so that cast is no launch of its own.
Replaces the torch hc_post, mhc_post_ref below (a broadcast multiply, a batched matmul, an add
and a cast).
Each program owns one token's D-chunk of all streams, so out may alias res (in place).
"""
import torch
import triton
import triton.language as tl

from engine.numerics import up
from .common import gdc_enter, pdl_args, round_to



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
    f = round_to(f, out_ptr.dtype.element_ty)        # the sub-layer output's cast to the streams' dtype
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
             out: torch.Tensor | None = None, block_d: int = 512, after=None) -> torch.Tensor:
    """f [...,D] (res's dtype or wider: rounded to res's first), res [...,hc,D], post [...,hc] fp32,
    comb [...,hc,hc] fp32 -> [...,hc,D] (res dtype).

    `out` (same shape and dtype as res, may be res itself) is written in place when given. after:
    the stream mhc_pre wrote post and comb on (its `side`): this stream waits for it first."""
    if after is not None:
        torch.cuda.current_stream(res.device).wait_stream(after)
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


def mhc_post_ref(f, res, post, comb, out=None, block_d=None, after=None):
    """Torch reference, and the model's hc_post (engine.model.mhc imports it):
    out[k] = post[k] * f + sum_j comb[j, k] * res[j]  ->  [...,hc,D] in res's dtype (f cast to it first)."""
    y = (post[..., None] * up(f.to(res.dtype))[..., None, :] + comb.transpose(-1, -2) @ up(res)).to(res.dtype)
    return y if out is None else out.copy_(y)
