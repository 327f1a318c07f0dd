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

mhc_post_pre goes one launch further on small steps: each token's last program to arrive (a
ticket) also sums those partials and makes the next sub-layer's normed input (mhc_pre's collapse,
its code), so a sub-layer boundary is one launch on the step's stream and Sinkhorn's on the side.
"""
import torch
import triton
import triton.language as tl

from engine.numerics import up
from .bf16_gemm import MixPartials
from .common import gdc_enter, pdl_args, round_to, scratch
from .mhc_pre import _collapse, _load_collapse, check_act, mhc_pre, mhc_pre_ref

# Tokens up to which mhc_post also makes the next mix (above: mhc_pre's mix GEMM, on tensor cores,
# reads fn once for every 64-128 tokens where this reads it once per TB tokens), and the fused
# launch's plan. bench/post_mix.py (H200, 2026-12-04, post + pre per sub-layer, graph replay):
# T = 1 12.8 us as three launches -> 9.0 fused (1 token / 128 channels a program; 10.3 at 64
# channels); T = 16 16.5 -> 11.6 (1 / 128; 8 tokens a program 16.4); T = 64 17.0 -> 20.5 at best.
POST_MIX_MAX_T = 16
POST_MIX_TOKENS, POST_MIX_BLOCK_D = 1, 128
# Tokens up to which mhc_post_pre is one launch (above: mhc_post with the mix, then mhc_pre). Off
# (0): measured slower, bench/decode.py --ab post_pre (H100, 2026-12-06): +0.117 ms a step at
# C = 1, +0.294 at C = 16 for 85 launches fewer (18.1 a layer); bench/RESULTS.md
POST_PRE_MAX_T = 0
# its programs' channels and warps: 128 channels / 4 warps compile to 128 registers (4 programs an
# SM: 16 tokens' 512 programs in one wave); with 8 warps, mhc_pre's for D = 4096, the collapse has
# mhc_pre's bits, but 167 registers (1 an SM) at 128 channels, 128 (2) at 256 (bench/regs.py's
# compiler, sm_90)
POST_PRE_BLOCK_D, POST_PRE_WARPS = 128, 4


@triton.jit
def _load_fn(fn_ptr, lo_ptr, d, dm, D, HC: tl.constexpr, N: tl.constexpr, BLOCK_N: tl.constexpr,
             HAS_LO: tl.constexpr):
    """fn's columns d of every stream, hi + lo in fp32: [BN, HC, BD]. Read before gdc_enter's wait,
    the one read of this project's kernels that is: fn is a weight no kernel writes, so under PDL
    its ~25 KB a program stream in during the previous kernel's tail instead of in front of the
    post (what made the fourth session's fused post + mix slower than the two launches:
    bench/RESULTS.md)."""
    n = tl.arange(0, BLOCK_N)
    k = tl.arange(0, HC)
    w_at = n[:, None, None] * (HC * D) + k[None, :, None] * D + d[None, None, :]
    w_m = (n < N)[:, None, None] & dm[None, None, :]
    fn = tl.load(fn_ptr + w_at, mask=w_m, other=0.0).to(tl.float32)
    if HAS_LO:
        fn += tl.load(lo_ptr + w_at, mask=w_m, other=0.0).to(tl.float32)
    return fn


@triton.jit
def _post_token(f_ptr, res_ptr, post_ptr, comb_ptr, out_ptr, part_ptr, fn, t, tm, c, d, dm, T,
                stride_ft, stride_rt, stride_rj, stride_ot, stride_oj,
                HC: tl.constexpr, MIX: tl.constexpr, N: tl.constexpr, BLOCK_N: tl.constexpr):
    """Token t's streams at channels d (the program's chunk c) written to out; MIX: also chunk
    c's share of their next mix (fn: _load_fn's columns) into the partials."""
    k = tl.arange(0, HC)
    f = tl.load(f_ptr + t * stride_ft + d, mask=dm & tm, other=0.0).to(tl.float32)         # [BD]
    f = round_to(f, out_ptr.dtype.element_ty)    # the sub-layer output's cast to the streams' dtype
    post = tl.load(post_ptr + t * HC + k, mask=tm, other=0.0)                              # [HC]
    acc = post[:, None] * f[None, :]                                                       # [HC(k), BD]
    for j in tl.static_range(HC):
        # comb row j: the weights input stream j gives to each output stream k
        cj = tl.load(comb_ptr + t * HC * HC + j * HC + k, mask=tm, other=0.0)              # [HC(k)]
        rj = tl.load(res_ptr + t * stride_rt + j * stride_rj + d, mask=dm & tm, other=0.0).to(tl.float32)
        acc += cj[:, None] * rj[None, :]
    o = round_to(acc, out_ptr.dtype.element_ty)                                            # [HC, BD]
    tl.store(out_ptr + t * stride_ot + k[:, None] * stride_oj + d[None, :], o, mask=dm[None, :] & tm)
    if MIX:     # split c's share of the next mix: h_flat[t] @ fn^T and sum(h_flat[t]^2), as stored
        n = tl.arange(0, BLOCK_N)
        dots = tl.sum(tl.sum(fn * o[None, :, :], axis=2), axis=1)                          # [BN]
        row = part_ptr + (c * T + t) * (N + 1)
        tl.store(row + n, dots, mask=(n < N) & tm)
        tl.store(row + N, tl.sum(tl.sum(o * o, axis=1), axis=0), mask=tm)


@triton.jit
def _mhc_post_kernel(f_ptr, res_ptr, post_ptr, comb_ptr, out_ptr, fn_ptr, lo_ptr, part_ptr, T, D,
                     stride_ft, stride_rt, stride_rj, stride_ot, stride_oj,
                     HC: tl.constexpr, BLOCK_D: tl.constexpr, TB: tl.constexpr = 1, MIX: tl.constexpr = False,
                     HAS_LO: tl.constexpr = False, N: tl.constexpr = 1, BLOCK_N: tl.constexpr = 1,
                     USE_GDC: tl.constexpr = False):
    c = tl.program_id(1)                # the D-chunk: the split of the mix partials too
    d = c * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    if MIX:     # read once for TB tokens
        fn = _load_fn(fn_ptr, lo_ptr, d, dm, D, HC, N, BLOCK_N, HAS_LO)
    else:
        fn = 0.0
    gdc_enter(USE_GDC)
    for i in tl.static_range(TB):
        t = tl.program_id(0) * TB + i
        _post_token(f_ptr, res_ptr, post_ptr, comb_ptr, out_ptr, part_ptr, fn, t, t < T, c, d, dm, T,
                    stride_ft, stride_rt, stride_rj, stride_ot, stride_oj, HC, MIX, N, BLOCK_N)


@triton.jit
def _mhc_post_pre_kernel(f_ptr, res_ptr, post_ptr, comb_ptr, out_ptr, fn_ptr, lo_ptr, part_ptr, tick_ptr,
                         scale_ptr, base_ptr, w_ptr, y_ptr, xa_ptr, xq_ptr, xs_ptr, T, D,
                         stride_ft, stride_rt, stride_rj, stride_ot, stride_oj, stride_yt, hc_eps, norm_eps,
                         HC: tl.constexpr, BLOCK_D: tl.constexpr, HAS_LO: tl.constexpr, N: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_DF: tl.constexpr, BLOCK_C: tl.constexpr,
                         ACT: tl.constexpr, CODES: tl.constexpr, USE_GDC: tl.constexpr = False):
    # program (t, c): token t's streams at chunk c and that chunk's share of the next mix, as
    # _mhc_post_kernel's; the token's last program to arrive (a ticket per token) then makes the
    # next sub-layer's input from all of them: mhc_pre's collapse and norm, its very code
    t = tl.program_id(0)
    c = tl.program_id(1)
    d = c * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    fn = _load_fn(fn_ptr, lo_ptr, d, dm, D, HC, N, BLOCK_N, HAS_LO)
    gdc_enter(USE_GDC)
    _post_token(f_ptr, res_ptr, post_ptr, comb_ptr, out_ptr, part_ptr, fn, t, t < T, c, d, dm, T,
                stride_ft, stride_rt, stride_rj, stride_ot, stride_oj, HC, True, N, BLOCK_N)
    tl.debug_barrier()                  # every thread's streams and partials are out before the release
    C = tl.num_programs(1)
    if tl.atomic_add(tick_ptr + t, 1, sem="acq_rel", scope="gpu") == C - 1:
        tl.debug_barrier()
        ss, mix_pre, h, w, s0, b_pre = _load_collapse(part_ptr + t * (N + 1), C, T * (N + 1), scale_ptr, base_ptr,
                                                      out_ptr, w_ptr, D, stride_ot, stride_oj, t, HC, N, BLOCK_DF,
                                                      BLOCK_C, True)
        _collapse(ss, mix_pre, h, w, s0, b_pre, HC * D, norm_eps, y_ptr, xa_ptr, xq_ptr, xs_ptr, D, stride_yt, t,
                  hc_eps, norm_eps, HC, BLOCK_DF, ACT, CODES)
        tl.store(tick_ptr + t, 0)       # at rest for the next launch (or graph replay)


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


def mhc_post_pre(f: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fn_hi: torch.Tensor,
                 fn_lo: torch.Tensor | None, scale: torch.Tensor, base: torch.Tensor, norm_weight: torch.Tensor,
                 iters: int, hc_eps: float, norm_eps: float, after=None, act_out=None, act_q=None, side=None,
                 block_d: int | None = None, warps: int | None = None):
    """mhc_post of a sub-layer's output f into the streams res, then the next sub-layer's mhc_pre
    on them -> (h [...,hc,D], (y [...,D], post' [...,hc], comb' [...,hc,hc])): mhc_post's first
    four arguments and `after`, then mhc_pre's (fn_hi ... norm_eps, act_out, act_q, side).

    Up to POST_PRE_MAX_T tokens one launch makes the streams, their mix partials and, in each
    token's last program, the collapse and norm (y, act_out, act_q), with mhc_pre's code: mhc_pre's
    bits given these streams and partials where the launch has mhc_pre's warps (min(16, D / 512)).
    Sinkhorn's post' and comb' follow on `side` (mhc_pre's second role, from the partials). Above:
    mhc_post (with the mix up to POST_MIX_MAX_T), then mhc_pre. block_d, warps: the fused launch's
    channels a program and warps (tests, tuning)."""
    hc, D = res.shape[-2:]
    T = res.numel() // (hc * D)
    mix = (fn_hi, fn_lo, norm_eps)
    pre = (fn_hi, fn_lo, scale, base, norm_weight, iters, hc_eps, norm_eps)
    if not 0 < T <= POST_PRE_MAX_T:
        h, parts = mhc_post(f, res, post, comb, after=after, mix=mix)
        return h, mhc_pre(h, *pre, act_out=act_out, act_q=act_q, side=side, mix=parts)
    if after is not None:
        torch.cuda.current_stream(res.device).wait_stream(after)
    assert hc & (hc - 1) == 0, "hc must be a power of two (register tiles)"
    lead = res.shape[:-2]
    f2, r3 = f.reshape(-1, D), res.reshape(-1, hc, D)
    assert f2.stride(-1) == 1 and r3.stride(-1) == 1
    N = fn_hi.shape[0]
    assert N == (2 + hc) * hc and fn_hi.shape == (N, hc * D) and fn_hi.is_contiguous()
    assert fn_lo is None or fn_lo.is_contiguous()
    check_act(T, D, res.dtype, act_out, act_q)
    p2, c3 = post.reshape(T, hc).float().contiguous(), comb.reshape(T, hc, hc).float().contiguous()
    o = torch.empty_like(r3)
    y = torch.empty(T, D, dtype=res.dtype, device=res.device)
    out = (y, torch.empty(T, hc, dtype=torch.float32, device=res.device),
           torch.empty(T, hc, hc, dtype=torch.float32, device=res.device))
    block = min(block_d or POST_PRE_BLOCK_D, triton.next_power_of_2(D))
    C = triton.cdiv(D, block)
    parts = MixPartials.buffer(res.device, C, T, N)
    tick = scratch("mhc.post_pre.tickets", res.device, T, torch.int32, zero=True)
    xa = act_out if act_out is not None else y
    xq, xs = act_q if act_q is not None else (y, y)
    sc, bs = scale.float().contiguous(), base.float().contiguous()
    full = triton.next_power_of_2(D)
    _mhc_post_pre_kernel[(T, C)](
        f2, r3, p2, c3, o, fn_hi, fn_lo if fn_lo is not None else fn_hi, parts, tick, sc, bs, norm_weight.contiguous(),
        y, xa, xq, xs, T, D, f2.stride(0), r3.stride(0), r3.stride(1), o.stride(0), o.stride(1), D, hc_eps, norm_eps,
        HC=hc, BLOCK_D=block, HAS_LO=fn_lo is not None, N=N, BLOCK_N=triton.next_power_of_2(N), BLOCK_DF=full,
        BLOCK_C=triton.next_power_of_2(C), ACT=act_out is not None, CODES=act_q is not None,
        num_warps=warps or POST_PRE_WARPS, **pdl_args())
    h = o.view(*lead, hc, D)
    # post' and comb' (Sinkhorn, on side): mhc_pre's second role, from the partials just made
    mhc_pre(h, *pre, out=out, act_out=act_out, act_q=act_q, side=side, mix=MixPartials(parts, hc * D, norm_eps),
            collapsed=True)
    return h, (y.view(*lead, D), out[1].view(*lead, hc), out[2].view(*lead, hc, hc))


def mhc_post_pre_ref(f, res, post, comb, fn_hi, fn_lo, scale, base, norm_weight, iters, hc_eps, norm_eps,
                     after=None, act_out=None, act_q=None, side=None, **_):
    """Torch reference: mhc_post_ref, then mhc_pre_ref on its streams."""
    h = mhc_post_ref(f, res, post, comb)
    return h, mhc_pre_ref(h, fn_hi, fn_lo, scale, base, norm_weight, iters, hc_eps, norm_eps, act_out=act_out,
                          act_q=act_q)
