"""mHC pre, from the streams to the sub-layer's normed input: the mix projection, then one kernel.

mhc_mix_parts (bf16_gemm.py) leaves the mix h_flat @ fn^T and the sum of squares as partials per K
split; the kernel sums them per token (no split-K tail kernel: bench/RESULTS.md), derives
pre/post/comb (Sinkhorn in registers), collapses the streams x = sum_j pre_j h_j, rounds x to h's
dtype (hc_pre hands it over in that dtype) and applies the weighted RMSNorm (attn_norm /
ffn_norm); optionally it also writes x's e4m3 round trip for the FP8 projections that read it
(act_out), and that rounding as e4m3 codes and per-128 scales (act_q) for the projections'
FP8 tensor-core dots. Small steps give each token two programs, the collapse and Sinkhorn side by side;
given a side stream (the step's ops.side), the two are launches on two streams, so that Sinkhorn's
post and comb, which only the sub-layer's mhc_post reads, are off the step's critical path.
Replaces engine.model.mhc.hc_pre (the mix, about 20 Sinkhorn rounds of small torch ops, the
collapse and a cast) plus RMSNorm (and an act_sim launch).
"""
import contextlib

import torch
import triton
import triton.language as tl

from engine.numerics import fp8_codes_ref, fp8_sim_ref, up
from .bf16_gemm import mhc_mix_parts, mhc_mix_ref
from .act_sim import fp8_quant
from .common import gdc_enter, pdl_args, round_to
from .rms_norm import rms_norm_ref as rms_norm
from .sinkhorn import sinkhorn_ref as sinkhorn, sinkhorn_tile

# Tokens up to which each token takes two programs (ROLES = 2). A scratch bench (H200, 2026-12-04,
# mix + pre, graph replay, 8 layers' weights): 1.2-1.3 us faster per call at 1-64 tokens, 1.5-2.6 us
# slower at 256 (twice the programs, half of them Sinkhorn's few floats).
ROLES_MAX_T = 64
# The model's head (mhc_head) through the kernel; False: its torch math, the step's lever
HEAD_KERNEL = True


@triton.jit
def _ld(p, mask, CG: tl.constexpr):
    """tl.load(p, mask, other=0); CG: at L2 (".cg"), where other SMs' programs of the same launch
    wrote it, never a stale L1 line."""
    if CG:
        return tl.load(p, mask=mask, other=0.0, cache_modifier=".cg")
    else:
        return tl.load(p, mask=mask, other=0.0)


@triton.jit
def _mix_at(m, offs, C, stride_c, BLOCK_C: tl.constexpr, TWO_D: tl.constexpr, CG: tl.constexpr = False):
    """The mix dots at offs ([HC] or, TWO_D, [HC,HC]) of one token's partials row m, summed over
    the C splits (the row's rsqrt norm not yet applied). CG: read at L2 (_ld)."""
    cc = tl.arange(0, BLOCK_C)
    if TWO_D:
        v = _ld(m + cc[:, None, None] * stride_c + offs[None, :, :], (cc < C)[:, None, None], CG)
    else:
        v = _ld(m + cc[:, None] * stride_c + offs[None, :], (cc < C)[:, None], CG)
    return tl.sum(v, axis=0)


@triton.jit
def _load_post_comb(m, C, stride_c, scale_ptr, base_ptr, HC: tl.constexpr, N: tl.constexpr, BLOCK_C: tl.constexpr):
    """What post and comb of one token are made of: the sum of squares, the mix dots (summed over
    the C splits of its partials row m), the scales and bases."""
    cc = tl.arange(0, BLOCK_C)
    k = tl.arange(0, HC)
    jk = k[:, None] * HC + k[None, :]                                                     # [HC,HC]
    ss = tl.sum(tl.load(m + cc * stride_c + N, mask=cc < C, other=0.0), axis=0)
    mix_post = _mix_at(m, HC + k, C, stride_c, BLOCK_C, False)
    mix_comb = _mix_at(m, 2 * HC + jk, C, stride_c, BLOCK_C, True)
    return (ss, mix_post, mix_comb, tl.load(scale_ptr + 1), tl.load(scale_ptr + 2), tl.load(base_ptr + HC + k),
            tl.load(base_ptr + 2 * HC + jk))


@triton.jit
def _post_comb(ss, mix_post, mix_comb, s1, s2, b_post, b_comb, K, mix_eps, post_ptr, comb_ptr, t, hc_eps,
               HC: tl.constexpr, ITERS: tl.constexpr):
    """post = 2 sigmoid(.), comb = Sinkhorn(.) of token t, stored."""
    k = tl.arange(0, HC)
    jk = k[:, None] * HC + k[None, :]
    rnorm = tl.math.rsqrt(ss / K + mix_eps)     # mhc_mix's order: the dots, then the norm
    tl.store(post_ptr + t * HC + k, 2 * tl.sigmoid(mix_post * rnorm * s1 + b_post))
    tl.store(comb_ptr + t * HC * HC + jk, sinkhorn_tile(mix_comb * rnorm * s2 + b_comb, hc_eps, ITERS))


@triton.jit
def _load_collapse(m, C, stride_c, scale_ptr, base_ptr, h_ptr, w_ptr, D, stride_ht, stride_hj, t,
                   HC: tl.constexpr, N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
                   CG: tl.constexpr = False):
    """What y of one token is made of: the sum of squares, the pre dots, its streams h [HC,D], the
    norm weight, scale and bases. CG: the partials and h read at L2 (_ld: other SMs' programs of
    the same launch wrote them, mhc_post_pre's last program)."""
    cc = tl.arange(0, BLOCK_C)
    k = tl.arange(0, HC)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    ss = tl.sum(_ld(m + cc * stride_c + N, cc < C, CG), axis=0)
    mix_pre = _mix_at(m, k, C, stride_c, BLOCK_C, False, CG)
    h = _ld(h_ptr + t * stride_ht + k[:, None] * stride_hj + d[None, :], dm[None, :], CG)   # [HC,D]
    w = tl.load(w_ptr + d, mask=dm, other=0.0).to(tl.float32)
    return ss, mix_pre, h, w, tl.load(scale_ptr), tl.load(base_ptr + k)


@triton.jit
def _collapse(ss, mix_pre, h, w, s0, b_pre, K, mix_eps, y_ptr, xa_ptr, xq_ptr, xs_ptr, D, stride_yt, t, hc_eps,
              norm_eps, HC: tl.constexpr, BLOCK_D: tl.constexpr, ACT: tl.constexpr, CODES: tl.constexpr):
    """y = RMSNorm(sum_j pre_j h_j) of token t, pre = sigmoid(.) + eps, stored in h's dtype; ACT:
    also y's e4m3 round trip per 128 channels (fp8_sim(y, 128)) into xa; CODES: and its e4m3
    codes into xq, the scales into xs [D/128]."""
    k = tl.arange(0, HC)
    d = tl.arange(0, BLOCK_D)
    rnorm = tl.math.rsqrt(ss / K + mix_eps)
    pre = tl.sigmoid(mix_pre * rnorm * s0 + b_pre) + hc_eps
    hp = pre[:, None] * h.to(tl.float32)                                                  # [HC,D]
    x = tl.zeros([BLOCK_D], tl.float32)
    for j in tl.static_range(HC):
        # streams summed in order j = 0..hc-1, as torch's sum over the stream axis does (one term per sum)
        x += tl.sum(tl.where(k[:, None] == j, hp, 0.0), axis=0)
    x = round_to(x, h.dtype)
    r = tl.math.rsqrt(tl.sum(x * x, axis=0) / D + norm_eps)
    y = round_to(w * (x * r), y_ptr.dtype.element_ty)
    tl.store(y_ptr + t * stride_yt + d, y, mask=d < D)
    if ACT:     # the FP8 GEMMs' input, rounded here once rather than by every tile of the projections
        e, sc = fp8_quant(y, BLOCK_D, 128)                                                # [BD/128,128], [BD/128]
        tl.store(xa_ptr + t * stride_yt + d, round_to(tl.reshape(e * sc[:, None], (BLOCK_D,)),
                                                      y_ptr.dtype.element_ty), mask=d < D)
        if CODES:
            tl.store(xq_ptr + t * D + d, tl.reshape(e, (BLOCK_D,)).to(tl.float8e4nv), mask=d < D)
            b = tl.arange(0, BLOCK_D // 128)
            tl.store(xs_ptr + t * (D // 128) + b, sc, mask=b < D // 128)


@triton.jit
def _mhc_pre_kernel(part_ptr, scale_ptr, base_ptr, h_ptr, w_ptr, y_ptr, xa_ptr, xq_ptr, xs_ptr, post_ptr, comb_ptr,
                    D, stride_ht, stride_hj, stride_yt, hc_eps, norm_eps, C, K, mix_eps,
                    HC: tl.constexpr, ITERS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
                    ROLES: tl.constexpr, ACT: tl.constexpr, CODES: tl.constexpr, ROLE: tl.constexpr = -1,
                    NMIX: tl.constexpr = 0, USE_GDC: tl.constexpr = False):
    # ROLES = 2, two programs per token: (t, 0) collapses the streams and norms them, (t, 1) derives
    # post and comb, so Sinkhorn's 20 rounds of dependent reductions run beside the collapse, not
    # before it (small steps, where the kernel's latency is the cost); ROLE = 0 or 1: this launch
    # is only that role (mhc_pre's `side`: the two launched on two streams). ROLES = 1: one program
    # does both, every load first: the stores may alias them as far as the compiler knows, so a
    # load placed after a store waits for it. NMIX: the mix's width when not (2 + HC) * HC (the
    # head's collapse, mhc_head: HC pre weights only, ROLE = 0)
    gdc_enter(USE_GDC)
    t = tl.program_id(0)
    N: tl.constexpr = NMIX if NMIX > 0 else (2 + HC) * HC
    stride_c = tl.num_programs(0) * (N + 1)
    m = part_ptr + t * (N + 1)                  # partials row: pre [HC], post [HC], comb [HC*HC], sum of squares
    if ROLES == 1:
        ss, mix_pre, h, w, s0, b_pre = _load_collapse(m, C, stride_c, scale_ptr, base_ptr, h_ptr, w_ptr, D,
                                                      stride_ht, stride_hj, t, HC, N, BLOCK_D, BLOCK_C)
        ss2, mix_post, mix_comb, s1, s2, b_post, b_comb = _load_post_comb(m, C, stride_c, scale_ptr, base_ptr,
                                                                          HC, N, BLOCK_C)
        _post_comb(ss2, mix_post, mix_comb, s1, s2, b_post, b_comb, K, mix_eps, post_ptr, comb_ptr, t, hc_eps,
                   HC, ITERS)
        _collapse(ss, mix_pre, h, w, s0, b_pre, K, mix_eps, y_ptr, xa_ptr, xq_ptr, xs_ptr, D, stride_yt, t, hc_eps,
                  norm_eps, HC, BLOCK_D, ACT, CODES)
    elif (tl.program_id(1) if ROLE < 0 else ROLE) == 0:
        ss, mix_pre, h, w, s0, b_pre = _load_collapse(m, C, stride_c, scale_ptr, base_ptr, h_ptr, w_ptr, D,
                                                      stride_ht, stride_hj, t, HC, N, BLOCK_D, BLOCK_C)
        _collapse(ss, mix_pre, h, w, s0, b_pre, K, mix_eps, y_ptr, xa_ptr, xq_ptr, xs_ptr, D, stride_yt, t, hc_eps,
                  norm_eps, HC, BLOCK_D, ACT, CODES)
    else:
        ss2, mix_post, mix_comb, s1, s2, b_post, b_comb = _load_post_comb(m, C, stride_c, scale_ptr, base_ptr,
                                                                          HC, N, BLOCK_C)
        _post_comb(ss2, mix_post, mix_comb, s1, s2, b_post, b_comb, K, mix_eps, post_ptr, comb_ptr, t, hc_eps,
                   HC, ITERS)


def mhc_pre(h: torch.Tensor, fn_hi: torch.Tensor, fn_lo: torch.Tensor | None, scale: torch.Tensor,
            base: torch.Tensor, norm_weight: torch.Tensor, iters: int, hc_eps: float, norm_eps: float,
            out=None, act_out=None, act_q=None, side=None, roles=None, mix=None, collapsed=False, **mix_plan):
    """h [...,hc,D], the mix weight fn_hi (+ fn_lo) [(2+hc)*hc, hc*D] bf16 (split_bf16 of the fp32
    fn), scale [3], base [(2+hc)*hc], norm_weight [D]
    -> y = RMSNorm(sum_j pre_j h_j) [...,D] (h dtype), post [...,hc] fp32, comb [...,hc,hc] fp32.

    norm_eps is both the mix's and the RMSNorm's (the block's norm_eps). `out` = (y, post, comb)
    preallocated (contiguous) to write into, e.g. inside a CUDA graph. `act_out` [...,D] (h dtype,
    contiguous; D a multiple of 128): also written with fp8_sim(y, 128), the e4m3 round trip the
    FP8 projections of y take in reference numerics (proj_gemm's xa, the fused MoE's input), so
    no projection tile rounds y again. act_q = (codes [...,D] float8_e4m3fn, scales [...,D/128] fp32),
    contiguous, with act_out: that rounding as e4m3 codes and power-of-two scales (codes * scales
    == act_out), which proj_gemm's FP8 rows dot on the FP8 tensor cores.

    side: a CUDA stream for post and comb. They are needed only by the sub-layer's mhc_post, and
    Sinkhorn's 20 dependent rounds are the longer half of this kernel in small steps
    (bench/RESULTS.md): launched on `side` as soon as the mix is done, they run beside the collapse
    and the sub-layer instead of before it. The caller's stream must wait on `side` before anything
    reads post or comb (mhc_post's `after`; every call uses `side`, so that wait is always on work
    of the same CUDA graph capture). roles: 1 or 2 programs per token, or "split" (the two
    launches of `side`, on one stream: tests); mix: h's mix as MixPartials already (made by the
    mhc_post that wrote h: no mix GEMM here); collapsed: y (and act_out, act_q) are made already
    (mhc_post_pre's launch, with mix): only post and comb are launched; mix_plan: the mix GEMM's
    plan (split_k, ...: tests and tuning)."""
    hc, D = h.shape[-2:]
    N = (2 + hc) * hc
    assert hc & (hc - 1) == 0 and fn_hi.shape[0] == N
    lead = h.shape[:-2]
    h3 = h.reshape(-1, hc, D)
    T = h3.shape[0]
    assert h3.stride(-1) == 1
    if out is None:
        y = torch.empty(T, D, dtype=h.dtype, device=h.device)
        post = torch.empty(T, hc, dtype=torch.float32, device=h.device)
        comb = torch.empty(T, hc, hc, dtype=torch.float32, device=h.device)
    else:
        y, post, comb = out
        assert y.is_contiguous() and post.is_contiguous() and comb.is_contiguous()
    check_act(T, D, h.dtype, act_out, act_q)
    if T:
        assert not collapsed or mix is not None, "collapsed: the partials the collapse was made from"
        if mix is None:
            mix = mhc_mix_parts(h3, fn_hi, fn_lo, norm_eps, **mix_plan)             # [C, T, N+1]
        assert mix.parts.shape[1:] == (T, N + 1) and mix.K == hc * D
        C = mix.parts.shape[0]
        block = triton.next_power_of_2(D)
        split = roles == "split" or side is not None or collapsed
        roles = 2 if split else roles or (2 if T <= ROLES_MAX_T else 1)
        xa = act_out if act_out is not None else y
        xq, xs = act_q if act_q is not None else (y, y)
        sc, bs = scale.float().contiguous(), base.float().contiguous()
        args = (mix.parts, sc, bs, h3, norm_weight.contiguous(), y, xa, xq, xs, post, comb, D, h3.stride(0),
                h3.stride(1), D, hc_eps, norm_eps, C, mix.K, norm_eps)
        kw = dict(HC=hc, ITERS=iters, BLOCK_D=block, BLOCK_C=triton.next_power_of_2(C), ROLES=roles,
                  ACT=act_out is not None, CODES=act_q is not None)
        # the same warps in every layout: the reductions' order follows them (the same bits)
        kw["num_warps"] = min(16, max(1, block // 512))
        if not split:
            _mhc_pre_kernel[(T, roles)](*args, **kw, **pdl_args())
        else:
            if side is not None:      # post and comb wait for the mix only, not for the collapse
                side.wait_stream(torch.cuda.current_stream(h.device))
            if not collapsed:
                _mhc_pre_kernel[(T, 1)](*args, **kw, ROLE=0, **pdl_args())
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                # a plain launch: its stream's previous kernel is no dependency of it (no PDL edge)
                _mhc_pre_kernel[(T, 1)](*args, **kw, ROLE=1)
            for t, given in ((sc, scale), (bs, base)):
                if side is not None and t is not given:
                    t.record_stream(side)     # a temporary (scale or base was not fp32): live until it ran
    if out is not None:
        return out
    return y.view(*lead, D), post.view(*lead, hc), comb.view(*lead, hc, hc)


def check_act(T: int, D: int, dtype, act_out, act_q):
    """act_out and act_q (mhc_pre's) are what the kernel writes for T tokens of width D."""
    assert act_out is None or (act_out.is_contiguous() and act_out.numel() == T * D and act_out.dtype == dtype
                               and D % 128 == 0)
    assert act_q is None or (act_out is not None and act_q[0].dtype == torch.float8_e4m3fn and act_q[0].numel() == T * D
                             and act_q[1].dtype == torch.float32 and act_q[1].numel() == T * D // 128
                             and act_q[0].is_contiguous() and act_q[1].is_contiguous())


def mhc_head(h: torch.Tensor, fn_hi: torch.Tensor, fn_lo: torch.Tensor | None, scale: torch.Tensor,
             base: torch.Tensor, norm_weight: torch.Tensor, hc_eps: float, norm_eps: float, mix=None) -> torch.Tensor:
    """The model's head before its logits GEMM: h [...,hc,D], the head's mix weight fn_hi (+ fn_lo)
    [hc, hc*D] bf16, scale [1], base [hc] -> RMSNorm(sum_j pre_j h_j) [...,D] in h's dtype, pre =
    sigmoid(mix * scale + base) + hc_eps (hc_head, then the final norm): the collapse of mhc_pre's
    kernel with a mix of hc pre weights only. mix: its MixPartials (the last mhc_post made them),
    else the mix GEMM here. HEAD_KERNEL False: mhc_head_ref (the step's lever)."""
    if not HEAD_KERNEL:
        return mhc_head_ref(h, fn_hi, fn_lo, scale, base, norm_weight, hc_eps, norm_eps)
    hc, D = h.shape[-2:]
    assert hc & (hc - 1) == 0 and fn_hi.shape == (hc, hc * D)
    lead = h.shape[:-2]
    h3 = h.reshape(-1, hc, D)
    T = h3.shape[0]
    assert h3.stride(-1) == 1
    y = torch.empty(T, D, dtype=h.dtype, device=h.device)
    if T:
        if mix is None:
            mix = mhc_mix_parts(h3, fn_hi, fn_lo, norm_eps)                         # [C, T, hc+1]
        assert mix.parts.shape[1:] == (T, hc + 1) and mix.K == hc * D
        C = mix.parts.shape[0]
        block = triton.next_power_of_2(D)
        _mhc_pre_kernel[(T, 1)](mix.parts, scale.float().contiguous(), base.float().contiguous(), h3,
                                norm_weight.contiguous(), y, y, y, y, y, y, D, h3.stride(0), h3.stride(1), D, hc_eps,
                                norm_eps, C, mix.K, norm_eps, HC=hc, ITERS=0, BLOCK_D=block,
                                BLOCK_C=triton.next_power_of_2(C), ROLES=2, ACT=False, CODES=False, ROLE=0, NMIX=hc,
                                num_warps=min(16, max(1, block // 512)), **pdl_args())
    return y.view(*lead, D)


def mhc_head_ref(h, fn_hi, fn_lo, scale, base, norm_weight, hc_eps, norm_eps, mix=None):
    """Torch reference: engine.model.mhc.hc_head's lines (its mix, mhc_mix_ref), then the final
    rms_norm, as the model's logits() runs them."""
    pre = torch.sigmoid(mhc_mix_ref(h, fn_hi, fn_lo, norm_eps) * scale + base) + hc_eps
    return rms_norm((pre[..., None] * up(h)).sum(-2).to(h.dtype), norm_weight, norm_eps)


def mhc_pre_ref(h, fn_hi, fn_lo, scale, base, norm_weight, iters, hc_eps, norm_eps, out=None, act_out=None,
                act_q=None, **_):
    """Torch reference: engine.model.mhc.hc_pre's lines (its mix, mhc_mix_ref), then rms_norm;
    act_out gets fp8_sim_ref of the result, act_q its fp8_codes_ref."""
    hc = h.shape[-2]
    mix = mhc_mix_ref(h, fn_hi, fn_lo, norm_eps)
    pre = torch.sigmoid(mix[..., :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(mix[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = (mix[..., 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc))
    comb = sinkhorn(comb, iters, hc_eps)
    x = (pre[..., None] * up(h)).sum(-2).to(h.dtype)
    res = rms_norm(x, norm_weight, norm_eps), post, comb
    if act_out is not None:
        act_out.copy_(fp8_sim_ref(res[0], 128).reshape(act_out.shape))
    if act_q is not None:
        for o, r in zip(act_q, fp8_codes_ref(res[0], 128)):
            o.copy_(r.reshape(o.shape))
    if out is None:
        return res
    for o, r in zip(out, res):
        o.copy_(r.reshape(o.shape))
    return out
