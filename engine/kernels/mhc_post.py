"""mHC post: expand a sub-layer output back to the streams and mix in the residual, one kernel.

out[k] = post[k] * f + sum_j comb[j, k] * res[j], fp32 math, stored in res's dtype. f is taken in
res's dtype: a wider f (the MoE's fp32 sum after its all-reduce) is rounded to it in registers,
the cast the sub-layer's output gets in the reference, so that cast is no launch of its own.
Replaces the torch hc_post, mhc_post_ref below (a broadcast multiply, a batched matmul, an add
and a cast).
Each program owns one token's D-chunk of all streams, so out may alias res (in place).

Given the next mhc_pre's mix weight (`mix`), the kernel also leaves that mix as partials
(MixPartials, one split per D-chunk): each program dots the chunk of the streams it has just
written with the matching columns of fn (hi + lo, fp32) and sums their squares, so the next
sub-layer's mhc_pre needs no mix GEMM (one launch and one read of the streams fewer). Each
program takes TB tokens in turn, reading its fn columns once for all of them.
"""
import torch
import triton
import triton.language as tl

from engine.numerics import up
from .bf16_gemm import MixPartials
from .common import gdc_enter, pdl_args, round_to

# Tokens up to which mhc_post also makes the next mix (above: mhc_pre's mix GEMM, on tensor cores,
# reads fn once for every 64-128 tokens where this reads it once per TB tokens), and the fused
# launch's plan. bench/post_mix.py (H200, 2026-12-04, post + pre per sub-layer, graph replay):
# T = 1 12.8 us as three launches -> 9.0 fused (1 token / 128 channels a program; 10.3 at 64
# channels); T = 16 16.5 -> 11.6 (1 / 128; 8 tokens a program 16.4); T = 64 17.0 -> 20.5 at best.
POST_MIX_MAX_T = 16
POST_MIX_TOKENS, POST_MIX_BLOCK_D = 1, 128


@triton.jit
def _mhc_post_kernel(f_ptr, res_ptr, post_ptr, comb_ptr, out_ptr, fn_ptr, lo_ptr, part_ptr, T, D,
                     stride_ft, stride_rt, stride_rj, stride_ot, stride_oj,
                     HC: tl.constexpr, BLOCK_D: tl.constexpr, TB: tl.constexpr = 1, MIX: tl.constexpr = False,
                     HAS_LO: tl.constexpr = False, N: tl.constexpr = 1, BLOCK_N: tl.constexpr = 1,
                     USE_GDC: tl.constexpr = False):
    c = tl.program_id(1)                # the D-chunk: the split of the mix partials too
    d = c * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    k = tl.arange(0, HC)
    if MIX:     # fn's columns of this chunk, every stream: [BN, HC, BD], read once for TB tokens.
        # Read before gdc_enter's wait, the one read of this project's kernels that is: fn is a
        # weight no kernel writes, so under PDL its ~25 KB a program stream in during the previous
        # kernel's tail instead of in front of the post (what made the fourth session's fused
        # post + mix slower than the two launches: bench/RESULTS.md)
        n = tl.arange(0, BLOCK_N)
        w_at = n[:, None, None] * (HC * D) + k[None, :, None] * D + d[None, None, :]
        w_m = (n < N)[:, None, None] & dm[None, None, :]
        fn = tl.load(fn_ptr + w_at, mask=w_m, other=0.0).to(tl.float32)
        if HAS_LO:
            fn += tl.load(lo_ptr + w_at, mask=w_m, other=0.0).to(tl.float32)
    gdc_enter(USE_GDC)
    for i in tl.static_range(TB):
        t = tl.program_id(0) * TB + i
        tm = t < T
        f = tl.load(f_ptr + t * stride_ft + d, mask=dm & tm, other=0.0).to(tl.float32)     # [BD]
        f = round_to(f, out_ptr.dtype.element_ty)    # the sub-layer output's cast to the streams' dtype
        post = tl.load(post_ptr + t * HC + k, mask=tm, other=0.0)                          # [HC]
        acc = post[:, None] * f[None, :]                                                   # [HC(k), BD]
        for j in tl.static_range(HC):
            # comb row j: the weights input stream j gives to each output stream k
            cj = tl.load(comb_ptr + t * HC * HC + j * HC + k, mask=tm, other=0.0)          # [HC(k)]
            rj = tl.load(res_ptr + t * stride_rt + j * stride_rj + d, mask=dm & tm, other=0.0).to(tl.float32)
            acc += cj[:, None] * rj[None, :]
        o = round_to(acc, out_ptr.dtype.element_ty)                                        # [HC, BD]
        tl.store(out_ptr + t * stride_ot + k[:, None] * stride_oj + d[None, :], o, mask=dm[None, :] & tm)
        if MIX:     # split c's share of the next mix: h_flat[t] @ fn^T and sum(h_flat[t]^2), as stored
            dots = tl.sum(tl.sum(fn * o[None, :, :], axis=2), axis=1)                      # [BN]
            row = part_ptr + (c * T + t) * (N + 1)
            tl.store(row + n, dots, mask=(n < N) & tm)
            tl.store(row + N, tl.sum(tl.sum(o * o, axis=1), axis=0), mask=tm)


def mhc_post(f: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
             out: torch.Tensor | None = None, block_d: int = 512, after=None, mix=None,
             tokens_per_program: int | None = None, mix_block_d: int | None = None):
    """f [...,D] (res's dtype or wider: rounded to res's first), res [...,hc,D], post [...,hc] fp32,
    comb [...,hc,hc] fp32 -> [...,hc,D] (res dtype).

    `out` (same shape and dtype as res, may be res itself) is written in place when given. after:
    the stream mhc_pre wrote post and comb on (its `side`): this stream waits for it first.
    mix: (fn_hi, fn_lo or None, eps) of the mhc_pre that reads the result next -> (result,
    MixPartials of its mix, for that mhc_pre's `mix`; None above POST_MIX_MAX_T tokens, where
    mhc_pre mixes itself). The partials live in a scratch buffer the next mhc_pre must read
    before the next mhc_post (stream order). tokens_per_program, mix_block_d: the fused launch's
    plan (tests and tuning)."""
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
    parts = None
    if mix is not None and 0 < T <= POST_MIX_MAX_T:
        fn_hi, fn_lo, eps = mix
        N = fn_hi.shape[0]
        assert fn_hi.shape == (N, hc * D) and fn_hi.is_contiguous() and (fn_lo is None or fn_lo.is_contiguous())
        block = min(mix_block_d or POST_MIX_BLOCK_D, triton.next_power_of_2(D))
        tb = min(tokens_per_program or POST_MIX_TOKENS, T)
        C = triton.cdiv(D, block)
        parts = MixPartials.buffer(res.device, C, T, N)
        _mhc_post_kernel[(triton.cdiv(T, tb), C)](
            f2, r3, p2, c3, o, fn_hi, fn_lo if fn_lo is not None else fn_hi, parts, T, D, f2.stride(0), r3.stride(0),
            r3.stride(1), o.stride(0), o.stride(1), HC=hc, BLOCK_D=block, TB=tb, MIX=True, HAS_LO=fn_lo is not None,
            N=N, BLOCK_N=triton.next_power_of_2(N), num_warps=4, **pdl_args())
        parts = MixPartials(parts, hc * D, eps)
    elif T:
        block = min(block_d, triton.next_power_of_2(D))
        grid = (T, triton.cdiv(D, block))
        _mhc_post_kernel[grid](f2, r3, p2, c3, o, r3, r3, r3, T, D, f2.stride(0), r3.stride(0), r3.stride(1),
                               o.stride(0), o.stride(1), HC=hc, BLOCK_D=block, num_warps=4, **pdl_args())
    y = o.view(*lead, hc, D) if out is None else out
    return y if mix is None else (y, parts)


def mhc_post_ref(f, res, post, comb, out=None, block_d=None, after=None, mix=None, **_):
    """Torch reference, and the model's hc_post (engine.model.mhc imports it):
    out[k] = post[k] * f + sum_j comb[j, k] * res[j]  ->  [...,hc,D] in res's dtype (f cast to it first).
    mix given: (out, None), the next mhc_pre mixes itself."""
    y = (post[..., None] * up(f.to(res.dtype))[..., None, :] + comb.transpose(-1, -2) @ up(res)).to(res.dtype)
    y = y if out is None else out.copy_(y)
    return y if mix is None else (y, None)
