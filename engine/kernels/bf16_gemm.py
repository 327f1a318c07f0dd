"""bf16 tensor-core GEMMs for what the reference computes in fp32 on inputs that are bf16 already.

- mhc_mix: the mHC projection (spec §3.2 step 2, mhc_mix_ref, the model's _mix) for hc_pre and hc_head:
  h [M, hc*D = 16384] bf16 @ fn^T [16384, 24 (or 4)] -> fp32 [M, 24], times rsqrt(mean(h^2) + eps).
  The sum of squares is taken from the same h tiles in the same K loop, so h is read once. Skinny N
  and long K leave one output tile: split-K spreads K over the SMs (fp8_gemm's workspace and tickets).
  fn is fp32 in the checkpoint; split once into fn_hi + fn_lo (two bf16, split_bf16) the two dots
  reproduce the fp32 projection to ~2^-17, on tensor cores, for twice fn's bf16 bytes (= its fp32
  bytes). fn_hi alone is the plain bf16 GEMM (~2^-9 per weight).
- mhc_mix_parts: the same projection left as per-split partials (MixPartials) for mhc_pre to sum:
  no tickets and no serial tail (its one consumer reads a few floats per split instead).
- bf16_gemm: generic y[b] = a[b] @ b[b]^T (F.linear layout), fp32 accumulate, batched or shared b,
  split-K for small M*N. For the indexer's batched matmul or any other bf16 x bf16 product.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.numerics import up
from .common import gdc_enter, pdl_args, scratch, SplitPlan, get_workspace, num_sms, plan_split, round_to, splitk_arrive, splitk_reset, splitk_total


@triton.jit
def _dot(a, b, acc):
    """acc + a @ b^T; fp32 operands (tests) take the exact path, the GPU default would be tf32."""
    if a.dtype == tl.float32:
        return tl.dot(a, tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(a, tl.trans(b.to(a.dtype)), acc)


@triton.jit
def _bf16_gemm_kernel(a_ptr, b_ptr, lo_ptr, y_ptr, part_ptr, ticket_ptr,
                      M, N, K, kb_per_split, n_split, eps,
                      stride_ab, stride_am, stride_bb, stride_bn, stride_yb, stride_ym,
                      HAS_LO: tl.constexpr, SUMSQ: tl.constexpr, SPLIT: tl.constexpr, PARTS: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      USE_GDC: tl.constexpr = False):
    gdc_enter(USE_GDC)
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    bat, pid_s = tl.program_id(2) // n_split, tl.program_id(2) % n_split
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    rm, cm = rows < M, cols < N
    a_row = a_ptr + bat * stride_ab + rows[:, None] * stride_am                       # [BM, 1]
    b_row = bat * stride_bb + cols[:, None] * stride_bn                              # [BN, 1] offsets
    kb0 = pid_s * kb_per_split
    kb1 = tl.minimum(kb0 + kb_per_split, tl.cdiv(K, BLOCK_K))
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    ss = tl.zeros([BLOCK_M], tl.float32)
    for kb in range(kb0, kb1):
        k = kb * BLOCK_K + kk
        km = k[None, :] < K
        a = tl.load(a_row + k[None, :], mask=rm[:, None] & km, other=0.0)               # [BM, BK]
        b = tl.load(b_ptr + b_row + k[None, :], mask=cm[:, None] & km, other=0.0)       # [BN, BK]
        acc = _dot(a, b, acc)
        if HAS_LO:
            acc = _dot(a, tl.load(lo_ptr + b_row + k[None, :], mask=cm[:, None] & km, other=0.0), acc)
        if SUMSQ:
            af = a.to(tl.float32)
            ss += tl.sum(af * af, axis=1)
    mask = rm[:, None] & cm[None, :]
    if PARTS:   # MixPartials [n_split, M, N + 1]: this split's dots, then (last column) its sum of squares
        p_slot = part_ptr + pid_s * M * (N + 1) + rows * (N + 1)
        tl.store(p_slot[:, None] + cols[None, :], acc, mask=mask)
        if SUMSQ:
            tl.store(p_slot + N, ss, mask=rm & (pid_n == 0))
    elif SPLIT:
        tile = (bat * tl.num_programs(1) + pid_n) * tl.num_programs(0) + pid_m
        p_offs = rows[:, None] * N + cols[None, :]
        p_slot = part_ptr + bat * n_split * M * N
        # sum-of-squares partials after all acc partials: [n_split, n_tiles_n, M] (never batched)
        ss_part = part_ptr + n_split * M * N + pid_n * M
        ss_slot = tl.num_programs(1) * M
        if SUMSQ:
            tl.store(ss_part + pid_s * ss_slot + rows, ss, mask=rm)
        if splitk_arrive(acc, p_slot + pid_s * M * N, p_offs, mask, ticket_ptr + tile, n_split):
            acc = splitk_total(p_slot, p_offs, mask, M * N, n_split)
            if SUMSQ:
                ss = splitk_total(ss_part, rows, rm, ss_slot, n_split)
            splitk_reset(ticket_ptr + tile)
            _store(acc, ss, y_ptr + bat * stride_yb, rows, cols, stride_ym, mask, K, eps, SUMSQ)
    else:
        _store(acc, ss, y_ptr + bat * stride_yb, rows, cols, stride_ym, mask, K, eps, SUMSQ)


@triton.jit
def _store(acc, ss, y_ptr, rows, cols, stride_ym, mask, K, eps, SUMSQ: tl.constexpr):
    if SUMSQ:
        acc = acc * tl.math.rsqrt(ss / K + eps)[:, None]       # the row's 1/rms, applied after the dot
    out_ty = y_ptr.dtype.element_ty
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], round_to(acc, out_ty).to(out_ty), mask=mask)


# ----------------------------------------------------------------------------- host

@dataclass(frozen=True)
class Bf16Plan:
    block_m: int
    block_n: int
    block_k: int
    split: SplitPlan
    grid: tuple
    num_warps: int
    num_stages: int


def bf16_gemm_plan(M, N, K, batch=1, device=None, split_k=None, block_m=None,
                   block_n=None, block_k=None, num_warps=None, num_stages=None) -> Bf16Plan:
    bm = block_m or min(128, max(16, triton.next_power_of_2(M)))
    bn = block_n or min(128, max(16, triton.next_power_of_2(N)))
    bk = block_k or (128 if bn <= 32 else 64)                 # skinny N: longer K steps per load
    n_m, n_n = triton.cdiv(M, bm), triton.cdiv(N, bn)
    sp = plan_split(n_m * n_n * batch, triton.cdiv(K, bk), num_sms(device), split_k)
    warps = num_warps or (8 if bm * bn >= 128 * 128 else 4)
    return Bf16Plan(bm, bn, bk, sp, (n_m, n_n, batch * sp.split), warps, num_stages or 3)


def bf16_gemm_need(M, N, K, batch=1, device=None, sumsq=False, **plan_kw):
    """(partial_numel, n_tickets) a SplitKWorkspace must hold for this GEMM."""
    p = bf16_gemm_plan(M, N, K, batch, device, **plan_kw)
    s = p.split.split
    if s == 1:
        return 0, 0
    return s * M * (batch * N + (p.grid[1] if sumsq else 0)), p.grid[0] * p.grid[1] * batch


def _launch(a3, b3, lo, y3, eps, sumsq, workspace, plan_kw, parts=None):
    """a3 [B, M, K], b3 [B or 1, N, K], y3 [B, M, N] -> y3; or with `parts`, a [n_split, M, N + 1]
    fp32 buffer the plan's splits fill (B = 1, mhc_mix_parts) -> parts."""
    B, M, K = a3.shape
    N = b3.shape[1]
    assert a3.stride(-1) == 1 and b3.stride(-1) == 1 and y3.stride(-1) == 1
    p = bf16_gemm_plan(M, N, K, B, a3.device, **plan_kw)
    split = p.split.split > 1 and parts is None
    ws = get_workspace(workspace, *bf16_gemm_need(M, N, K, B, a3.device, sumsq, **plan_kw), a3.device) if split else None
    if parts is not None:
        assert B == 1 and parts.shape == (p.split.split, M, N + 1) and parts.is_contiguous()
    part_buf = parts if parts is not None else ws.partials if split else y3
    _bf16_gemm_kernel[p.grid](
        a3, b3, lo if lo is not None else b3, y3, part_buf, ws.tickets if split else y3,
        M, N, K, p.split.kb_per_split, p.split.split, eps,
        a3.stride(0), a3.stride(1), b3.stride(0) if b3.shape[0] > 1 else 0, b3.stride(1),
        y3.stride(0), y3.stride(1),
        HAS_LO=lo is not None, SUMSQ=sumsq, SPLIT=split, PARTS=parts is not None, BLOCK_M=p.block_m, BLOCK_N=p.block_n,
        BLOCK_K=p.block_k, num_warps=p.num_warps, num_stages=p.num_stages, **pdl_args())
    return parts if parts is not None else y3


# ----------------------------------------------------------------------------- mHC projection

@dataclass
class MixPartials:
    """The mHC mix as partial sums over K splits: parts [C, T, N + 1] fp32, where parts[c, t, :N] is
    split c's share of h_flat[t] @ fn^T and parts[c, t, N] its share of sum(h_flat[t]^2); K = hc * D.
    mix = sum_c parts[..., :N] * rsqrt(sum_c parts[..., N] / K + eps), summed in mhc_pre's kernel."""
    parts: torch.Tensor
    K: int
    eps: float

    @staticmethod
    def buffer(device, C: int, T: int, N: int) -> torch.Tensor:
        """-> parts [C, T, N + 1] fp32 in the one scratch buffer every mix's partials share (one
        consumer each, the next mhc_pre, in stream order): the mix GEMM's and mhc_post's."""
        n = C * T * (N + 1)
        return scratch("mhc.parts", device, n, torch.float32)[:n].view(C, T, N + 1)


def mhc_mix_parts(h, fn_hi, fn_lo=None, norm_eps=1e-6, **plan_kw) -> MixPartials:
    """h [..., hc, D] bf16, fn_hi/fn_lo [N, hc*D] -> MixPartials of the mix of the T = prod(...) rows,
    in a scratch buffer the next mhc_pre reads (one consumer, stream order: reused by every layer)."""
    K = h.shape[-2] * h.shape[-1]
    a = h.reshape(-1, K)
    a = a if a.stride(-1) == 1 else a.contiguous()
    M, N = a.shape[0], fn_hi.shape[0]
    p = bf16_gemm_plan(max(M, 1), N, K, 1, h.device, **plan_kw)
    assert p.grid[1] == 1, "mhc_mix_parts: N must fit one tile"
    parts = MixPartials.buffer(h.device, p.split.split, M, N)
    if M:
        _launch(a[None], fn_hi[None], fn_lo, a[None], norm_eps, True, None, plan_kw, parts=parts)
    return MixPartials(parts, K, norm_eps)


def split_bf16(w: torch.Tensor):
    """fp32 w -> (hi, lo) bf16 with hi + lo == w to ~2^-17 relative (done once, at load)."""
    hi = w.to(torch.bfloat16)
    return hi, (w.float() - hi.float()).to(torch.bfloat16)


def mhc_mix(h, fn_hi, fn_lo=None, norm_eps=1e-6, out=None, workspace=None, **plan_kw):
    """h [..., hc, D] (bf16), fn_hi/fn_lo [N, hc*D] bf16 (split_bf16 of the fp32 fn; fn_lo optional)
    -> mix [..., N] fp32 = (h_flat @ fn^T) * rsqrt(mean(h_flat^2) + norm_eps), as _mix computes."""
    lead, K = h.shape[:-2], h.shape[-2] * h.shape[-1]
    a = h.reshape(-1, K)
    if a.stride(-1) != 1:
        a = a.contiguous()
    N = fn_hi.shape[0]
    assert fn_hi.shape == (N, K) and (fn_lo is None or fn_lo.shape == fn_hi.shape)
    y = out if out is not None else torch.empty(*lead, N, dtype=torch.float32, device=h.device)
    if a.shape[0]:
        _launch(a[None], fn_hi[None], fn_lo, y.view(1, -1, N), norm_eps, True, workspace, plan_kw)
    return y


def mhc_mix_need(M, N, K, device=None, **plan_kw):
    return bf16_gemm_need(M, N, K, 1, device, sumsq=True, **plan_kw)


def mhc_mix_ref(h, fn_hi, fn_lo=None, norm_eps=1e-6, out=None, **_):
    """Torch reference, and the model's mHC mix (engine.model.mhc imports it): fn applied to the
    unweighted-RMS-normalised flat streams, fp32 (fp64 in an fp64 model): [B,S,hc,D] -> [B,S,mix].
    fn = fn_hi (+ fn_lo, when given the kernel's bf16 split)."""
    fn = fn_hi if fn_lo is None else fn_hi.float() + fn_lo.float()
    xf = up(h.flatten(-2))
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps) @ fn.to(xf.dtype).t()
    return out.copy_(y) if out is not None else y


# ----------------------------------------------------------------------------- generic

def bf16_gemm(a, b, out=None, out_dtype=torch.float32, workspace=None, **plan_kw):
    """a [M, K] or [B, M, K], b [N, K] or [B, N, K] (shared across the batch when 2-D)
    -> a @ b^T [.., M, N] in out_dtype (fp32 accumulate)."""
    a3 = a if a.dim() == 3 else a[None]
    b3 = b if b.dim() == 3 else b[None]
    B, M, K = a3.shape
    N = b3.shape[1]
    assert b3.shape[2] == K and b3.shape[0] in (1, B), (tuple(a.shape), tuple(b.shape))
    a3 = a3 if a3.stride(-1) == 1 else a3.contiguous()
    b3 = b3 if b3.stride(-1) == 1 else b3.contiguous()
    y = out if out is not None else torch.empty(*a.shape[:-1], N, dtype=out_dtype, device=a.device)
    if B and M and N:
        _launch(a3, b3, None, y.view(B, M, N), 0.0, False, workspace, plan_kw)
    return y


def bf16_gemm_ref(a, b, out=None, out_dtype=torch.float32, **_):
    """Torch reference: fp32 matmul of the same inputs, cast (fp64 inputs: fp64 throughout, for the
    fp64 exactness tests of the whole model)."""
    wide = torch.float64 if a.dtype == torch.float64 else torch.float32
    y = (up(a).to(wide) @ up(b).to(wide).transpose(-1, -2))
    y = y.to(out.dtype if out is not None else wide if wide == torch.float64 else out_dtype)
    return out.copy_(y) if out is not None else y
