"""Fused projections: every GEMM that reads one input, in one launch, for the decode's weight stream.

At decode M is 1..64 tokens, so a projection costs the bytes of its weight plus a launch; the
attention reads its normed x through seven small projections (wq_a, wkv, the indexer's
weights_proj, the two compressors' wkv and wgate), the FFN through three (the shared expert's w1
and w3, the router gate). `pack_proj` concatenates such a group's weights once, at load, and
`proj_gemm` computes the group as one GEMM: y[:, n] = x @ W[n]^T, exactly each projection's math.

The concatenated rows come in three regions, each a prefix of the next:
- [0, n8): FP8 e4m3 rows with one E8M0 scale per 128x128 block (the checkpoint's own bytes: half
  the bf16 a dequantised copy reads); widened to x's dtype in registers, scaled after each
  128-deep dot (exact: e4m3 * 2^k is a bf16), or, at M tiles of up to 16 rows, dotted as e4m3
  codes against e4m3 codes on the FP8 tensor cores: x's codes and scales as its producer made
  them (`xq`, mhc_pre's act_q), else rounded by the tile itself (_fp8_dot).
- [0, n_act): columns whose input DeepSeek rounds to e4m3 per 128 channels (its FP8 GEMMs'
  activations, reference numerics): x is rounded on the fly, per K block, as fp8_sim does.
- [0, n_lo): columns stored in x's dtype (a Linear's output) into `lo`; the rest are stored fp32
  into `hi` (the compressor and router projections, which the reference keeps in fp32).
Every projection starts on a multiple of ROW_ALIGN (pack_proj pads with zero rows), so an N tile
lies in one projection and one region: each program takes one of three K loops, and stores into
that projection's own contiguous [M, out] output (a per-tile table says where), so the consumers
get plain tensors, not strided slices of one wide output.

Small M leaves most SMs idle with one program per output tile, so K is split over programs
(kernels/common.py's deterministic split-K: fixed partials, tickets, the last split sums in order).
Any M works: M tiles of up to 64 rows. Prefill sizes (UNFUSED_M tokens on) are compute-bound,
not weight-bound, and there one cuBLAS GEMM per projection is faster (proj_unfused).
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine.numerics import fp8_block_dequant, fp8_sim_ref, up
from .common import gdc_enter, pdl_args, get_workspace, interpreting, num_sms, plan_split, round_to, splitk_arrive, splitk_reset, splitk_total
from .act_sim import fp8_sim
from .bf16_gemm import _dot, bf16_gemm
from .fp8_gemm import load_block_scale, quant_e4m3_rows
from .rms_norm import rms_norm, rms_norm_ref
from .swiglu import swiglu_act, swiglu_act_ref

QBLOCK = 128          # FP8 scale block and the activation rounding block
ROW_ALIGN = 64        # region boundaries: a multiple of every BLOCK_N the plans take
_QB = tl.constexpr(QBLOCK)


@dataclass
class Proj:
    """A packed group: the weights, the region boundaries, and where each projection lands."""
    w8: torch.Tensor | None      # [n8, K] float8_e4m3fn
    s8: torch.Tensor | None      # [ceil(n8/128), K/128] uint8 (E8M0)
    wd: torch.Tensor | None      # [N - n8, K] in the model's dtype
    n8: int
    n_act: int
    n_lo: int
    N: int                       # rows, padding included
    K: int
    outs: dict                   # name -> (first row, offset in its output buffer / M, width, lo)
    meta: torch.Tensor           # [N / ROW_ALIGN, 3] int32: each row chunk's (first row, offset, width)
    lo_width: int                # sum of the lo projections' widths
    hi_width: int
    dense: dict | None = None    # name -> weight [out, K] in the model's dtype (prefill's cuBLAS path)


def pack_proj(segments, K: int, dtype, device) -> Proj:
    """segments: [(name, weight [out, K] (model dtype, dequantised), fp8 (e4m3, E8M0 scales) or None,
    act: round the input to e4m3, lo: output in x's dtype)], in region order: FP8 first (all with
    one act flag, whole 128-row scale blocks), then act, then lo. fp8 is given only where its
    dequantisation is exactly `weight` (the caller checks)."""
    keys = [(s[2] is not None, s[3], s[4]) for s in segments]
    assert keys == sorted(keys, reverse=True) and len({k[1] for k in keys if k[0]}) <= 1, \
        f"segments out of region order: {[(s[0],) + k for s, k in zip(segments, keys)]}"
    assert all(s[2] is None or s[1].shape[0] % QBLOCK == 0 for s in segments)
    outs, n, width = {}, 0, {True: 0, False: 0}
    bounds = {}
    for (name, w, fp8, act, lo), key in zip(segments, keys):
        for region, inside in zip(("n8", "n_act", "n_lo"), key):
            if not inside:
                bounds.setdefault(region, n)
        outs[name] = (n, width[lo], w.shape[0], lo)
        width[lo] += w.shape[0]
        n += w.shape[0] + (-w.shape[0] % ROW_ALIGN)
    n8, n_act, n_lo = (bounds.get(r, n) for r in ("n8", "n_act", "n_lo"))
    w8 = torch.zeros(n8, K, dtype=torch.float8_e4m3fn, device=device) if n8 else None
    s8 = torch.full((triton.cdiv(n8, QBLOCK), K // QBLOCK), 127, dtype=torch.uint8, device=device) if n8 else None
    wd = torch.zeros(n - n8, K, dtype=dtype, device=device) if n > n8 else None
    meta = torch.zeros(n // ROW_ALIGN, 3, dtype=torch.int32)
    for name, w, fp8, _, _ in segments:
        r, off, out, _ = outs[name]
        meta[r // ROW_ALIGN:(r + out + ROW_ALIGN - 1) // ROW_ALIGN] = torch.tensor([r, off, out], dtype=torch.int32)
        if fp8 is not None:
            w8[r:r + out] = fp8[0]
            s8[r // QBLOCK:r // QBLOCK + fp8[1].shape[0]] = fp8[1].view(torch.uint8)
        else:
            wd[r - n8:r - n8 + out] = w
    # prefill's per-projection GEMMs read dense weights: the caller's (an FP8 Linear keeps its
    # dequantised weight: no copy) and views of wd for the dense rows
    dense = {name: w if fp8 is not None else wd[outs[name][0] - n8:outs[name][0] - n8 + w.shape[0]]
             for name, w, fp8, _, _ in segments}
    return Proj(w8, s8, wd, n8, n_act, n_lo, n, K, outs, meta.to(device), width[True], width[False], dense)


def split_outputs(p: Proj, lo: torch.Tensor, hi: torch.Tensor, lead) -> dict:
    """The flat output buffers -> {name: [*lead, out]} (contiguous views)."""
    M = lo.numel() // max(p.lo_width, 1) if p.lo_width else hi.numel() // max(p.hi_width, 1)
    res = {}
    for name, (_, off, out, is_lo) in p.outs.items():
        buf = lo if is_lo else hi
        res[name] = buf[off * M:(off + out) * M].view(*lead, out)
    return res


# ----------------------------------------------------------------------------- kernel

@triton.jit
def _rstd(x_row, rm, K, eps, BLOCK_M: tl.constexpr):
    """1 / RMS of each row of x [BM, K] (fp32), as the rms_norm kernel computes it."""
    kk = tl.arange(0, _QB)
    ss = tl.zeros([BLOCK_M], tl.float32)
    for kb in range(0, K // _QB):
        k = kb * _QB + kk
        x = tl.load(x_row + k[None, :], mask=rm[:, None], other=0.0).to(tl.float32)
        ss += tl.sum(x * x, axis=1)
    return tl.math.rsqrt(ss / K + eps)


@triton.jit
def _xload(x_row, k, rm, ACT: tl.constexpr, SW_ROUND: tl.constexpr, NORM: tl.constexpr, nw_ptr, rstd):
    """x [BM, 128] at K offsets k; NORM: RMS-normed (w * x * rstd in fp32, rounded to x's dtype, as
    the rms_norm kernel stores it); ACT: then rounded to e4m3 with a power-of-two scale per row (fp8_sim)."""
    x = tl.load(x_row + k[None, :], mask=rm[:, None], other=0.0)
    if NORM:
        y = tl.load(nw_ptr + k).to(tl.float32)[None, :] * (x.to(tl.float32) * rstd[:, None])
        x = round_to(y, x.dtype).to(x.dtype)
    if ACT:
        q, sa = quant_e4m3_rows(x.to(tl.float32), SW_ROUND)
        x = (q.to(tl.float32) * sa[:, None]).to(x.dtype)        # exact: 4 significant bits
    return x


@triton.jit
def _fp8_dot(x_row, k, rm, w, SW_ROUND: tl.constexpr, NORM: tl.constexpr, nw_ptr, rstd):
    """x [BM, 128] at K offsets k (NORM: normed) rounded to e4m3 codes with a power-of-two scale per
    row (fp8_sim's rounding), dotted with the e4m3 W block [BN, 128] on the FP8 tensor cores ->
    [BM, BN] fp32 with the row scales applied. The products of two e4m3 values are exact in fp32,
    so this is the widened dot's sum without widening either operand (H200: ~2x faster per byte
    at decode sizes, bench/RESULTS.md). M tiles of up to 16 rows only: there the dot is mma.sync
    (bit-identical to the widened one); 64-row tiles take wgmma, whose FP8 accumulation inside a
    128-deep dot is not full fp32, so they keep the widened dot."""
    x = _xload(x_row, k, rm, False, SW_ROUND, NORM, nw_ptr, rstd)
    q, sa = quant_e4m3_rows(x.to(tl.float32), SW_ROUND)
    return tl.dot(q, tl.trans(w)) * sa[:, None]


@triton.jit
def _k_loop_codes(xq_row, xs_row, w_row, s_row, s_ptr, rm, cm, kb0, kb1, acc):
    """FP8 rows against x given as e4m3 codes xq [BM, K] and power-of-two scales xs [BM, K/128]:
    per 128-deep block, the e4m3 x e4m3 dot on the FP8 tensor cores, times the row and block
    scales: _fp8_dot's sum (the same bits) without rounding x again in every tile."""
    kk = tl.arange(0, _QB)
    for kb in range(kb0, kb1):
        k = kb * _QB + kk
        w = tl.load(w_row + k[None, :], mask=cm[:, None], other=0.0)                 # [BN, 128]
        sb = load_block_scale(s_ptr, s_row + kb, cm, True)
        q = tl.load(xq_row + k[None, :], mask=rm[:, None], other=0.0)                # [BM, 128] e4m3
        sa = tl.load(xs_row + kb, mask=rm, other=0.0)                                 # [BM]
        acc += tl.dot(q, tl.trans(w)) * sa[:, None] * sb[None, :]
    return acc


@triton.jit
def _k_loop_swiglu(g_row, u_row, w_row, s_row, s_ptr, rm, cm, kb0, kb1, acc, limit,
                   ACT: tl.constexpr, SW_ROUND: tl.constexpr, FP8_DOT: tl.constexpr):
    """FP8 rows against silu(min(g, limit)) * clamp(u, +-limit), made per 128-deep block from g and
    u [BM, K] (the shared expert's w1 and w3 outputs) and rounded to their dtype as
    kernels/swiglu.py's kernel does; ACT: then to e4m3 per 128 channels (fp8_sim's rounding), and
    at M tiles of up to 16 rows dotted as codes on the FP8 tensor cores (as _fp8_dot). The
    shared expert's w2 in one launch, without the activation's own kernel and round trip."""
    kk = tl.arange(0, _QB)
    ty = g_row.dtype.element_ty
    for kb in range(kb0, kb1):
        k = kb * _QB + kk
        w = tl.load(w_row + k[None, :], mask=cm[:, None], other=0.0)                 # [BN, 128]
        sb = load_block_scale(s_ptr, s_row + kb, cm, True)
        g = tl.minimum(tl.load(g_row + k[None, :], mask=rm[:, None], other=0.0).to(tl.float32), limit)
        u = tl.load(u_row + k[None, :], mask=rm[:, None], other=0.0).to(tl.float32)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        h = round_to(g / (1.0 + tl.exp(-g)) * u, ty)                               # [BM, 128], x's values
        if ACT and FP8_DOT:
            q, sa = quant_e4m3_rows(h, SW_ROUND)
            acc += tl.dot(q, tl.trans(w)) * sa[:, None] * sb[None, :]
        else:
            if ACT:
                q, sa = quant_e4m3_rows(h, SW_ROUND)
                h = q.to(tl.float32) * sa[:, None]                                   # exact in x's dtype
            acc += _dot(h.to(ty), w, tl.zeros_like(acc)) * sb[None, :]
    return acc


@triton.jit
def _k_loop(x_row, w_row, s_row, s_ptr, rm, cm, kb0, kb1, acc,
            FP8: tl.constexpr, ACT: tl.constexpr, SW_ROUND: tl.constexpr, NORM: tl.constexpr, nw_ptr, rstd,
            FP8_DOT: tl.constexpr = False):
    kk = tl.arange(0, _QB)
    for kb in range(kb0, kb1):
        k = kb * _QB + kk
        w = tl.load(w_row + k[None, :], mask=cm[:, None], other=0.0)                 # [BN, 128]
        if FP8:     # a fresh dot per scale block, scaled into the fp32 accumulator
            sb = load_block_scale(s_ptr, s_row + kb, cm, True)
            if ACT and FP8_DOT:     # x rounded here: its e4m3 codes against W's
                acc += _fp8_dot(x_row, k, rm, w, SW_ROUND, NORM, nw_ptr, rstd) * sb[None, :]
            else:
                x = _xload(x_row, k, rm, ACT, SW_ROUND, NORM, nw_ptr, rstd)            # [BM, 128]
                acc += _dot(x, w, tl.zeros_like(acc)) * sb[None, :]
        else:
            acc = _dot(_xload(x_row, k, rm, ACT, SW_ROUND, NORM, nw_ptr, rstd), w, acc)
    return acc


@triton.jit
def _proj_kernel(x_ptr, xa_ptr, xq_ptr, xs_ptr, w8_ptr, s8_ptr, wd_ptr, meta_ptr, lo_ptr, hi_ptr, part_ptr,
                 ticket_ptr, nw_ptr, u_ptr, M, N, K, n8, n_act, n_lo, kb_per_split, n_split,
                 stride_xm, stride_um, stride_s8, eps, limit,
                 ACT8: tl.constexpr, SW_ROUND: tl.constexpr, SPLIT: tl.constexpr, NORM: tl.constexpr,
                 PRE_ACT: tl.constexpr, PRE_Q: tl.constexpr, SWIGLU: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, ALIGN: tl.constexpr, USE_GDC: tl.constexpr = False):
    gdc_enter(USE_GDC)
    pid_n, pid_m, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n0 = pid_n * BLOCK_N
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = n0 + tl.arange(0, BLOCK_N)
    rm, cm = rows < M, cols < N
    x_row = x_ptr + rows[:, None] * stride_xm                                        # [BM, 1]
    kb0 = pid_s * kb_per_split
    kb1 = tl.minimum(kb0 + kb_per_split, K // _QB)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # NORM: x is an RMSNorm's input; every program (each K split too) takes the rows' full norm first
    rstd = tl.full([BLOCK_M], 1.0, tl.float32)
    if NORM:
        rstd = _rstd(x_row, rm, K, eps, BLOCK_M)
    # PRE_ACT (large M, or x's producer rounded it): the act regions read xa, x rounded to e4m3
    # once, rather than every N tile rounding its own copy of the x tile again
    xa_row = xa_ptr + rows[:, None] * stride_xm
    if SWIGLU:      # x is g, u_ptr u: every row FP8 (pack_proj of one FP8 projection)
        acc = _k_loop_swiglu(x_row, u_ptr + rows[:, None] * stride_um, w8_ptr + cols.to(tl.int64)[:, None] * K,
                             (cols // _QB) * stride_s8, s8_ptr, rm, cm, kb0, kb1, acc, limit, ACT8, SW_ROUND,
                             BLOCK_M <= 16)
    elif n0 < n8:
        if PRE_Q and ACT8 and BLOCK_M <= 16:   # x's e4m3 codes and scales, made by its producer
            acc = _k_loop_codes(xq_ptr + rows[:, None] * K, xs_ptr + rows * (K // _QB),
                                w8_ptr + cols.to(tl.int64)[:, None] * K, (cols // _QB) * stride_s8, s8_ptr,
                                rm, cm, kb0, kb1, acc)
        elif PRE_ACT and ACT8:
            acc = _k_loop(xa_row, w8_ptr + cols.to(tl.int64)[:, None] * K, (cols // _QB) * stride_s8, s8_ptr,
                          rm, cm, kb0, kb1, acc, True, False, SW_ROUND, False, nw_ptr, rstd)
        else:
            acc = _k_loop(x_row, w8_ptr + cols.to(tl.int64)[:, None] * K, (cols // _QB) * stride_s8, s8_ptr,
                          rm, cm, kb0, kb1, acc, True, ACT8, SW_ROUND, NORM, nw_ptr, rstd, BLOCK_M <= 16)
    elif n0 < n_act:
        if PRE_ACT:
            acc = _k_loop(xa_row, wd_ptr + (cols - n8).to(tl.int64)[:, None] * K, cols, s8_ptr, rm, cm, kb0, kb1,
                          acc, False, False, SW_ROUND, False, nw_ptr, rstd)
        else:
            acc = _k_loop(x_row, wd_ptr + (cols - n8).to(tl.int64)[:, None] * K, cols, s8_ptr, rm, cm, kb0, kb1,
                          acc, False, True, SW_ROUND, NORM, nw_ptr, rstd)
    else:
        acc = _k_loop(x_row, wd_ptr + (cols - n8).to(tl.int64)[:, None] * K, cols, s8_ptr, rm, cm, kb0, kb1, acc,
                      False, False, SW_ROUND, NORM, nw_ptr, rstd)
    mask = rm[:, None] & cm[None, :]
    if SPLIT:
        p_offs = rows[:, None] * N + cols[None, :]
        tp = ticket_ptr + pid_m * tl.num_programs(0) + pid_n
        if splitk_arrive(acc, part_ptr + pid_s * M * N, p_offs, mask, tp, n_split):
            acc = splitk_total(part_ptr, p_offs, mask, M * N, n_split)
            splitk_reset(tp)
            _store(acc, meta_ptr, lo_ptr, hi_ptr, rows, cols, rm, n0, n_lo, M, ALIGN)
    else:
        _store(acc, meta_ptr, lo_ptr, hi_ptr, rows, cols, rm, n0, n_lo, M, ALIGN)


@triton.jit
def _store(acc, meta_ptr, lo_ptr, hi_ptr, rows, cols, rm, n0, n_lo, M, ALIGN: tl.constexpr):
    """Into the tile's projection: its own [M, width] block of the lo or hi buffer (padding rows dropped)."""
    meta = meta_ptr + (n0 // ALIGN) * 3
    first, off, width = tl.load(meta), tl.load(meta + 1), tl.load(meta + 2)
    c = cols - first
    mask = rm[:, None] & (c < width)[None, :]
    offs = off * M + rows[:, None] * width + c[None, :]
    if n0 < n_lo:
        ty = lo_ptr.dtype.element_ty
        tl.store(lo_ptr + offs, round_to(acc, ty).to(ty), mask=mask)
    else:
        tl.store(hi_ptr + offs, acc, mask=mask)


# ----------------------------------------------------------------------------- host

@dataclass(frozen=True)
class ProjPlan:
    block_m: int
    block_n: int
    split: int
    kb_per_split: int
    grid: tuple
    num_warps: int
    num_stages: int
    pre_act: bool = False


LARGE_M = 256        # tokens from which the kernel takes its larger-M plan
UNFUSED_M = 1024     # tokens from which the group runs as one cuBLAS GEMM per projection


def proj_plan(M, N, K, device=None, block_m=None, block_n=None, split_k=None, num_warps=None, num_stages=None,
              pre_act=None) -> ProjPlan:
    """Tiles for y [M, N]. Decode sizes stream the weights: M tiles of up to 64 rows; N tiles of
    32, or 64 for wide groups past M = 16; K split for ~2 programs per SM; 4 stages, 3 past M = 16
    (two 64x128 tiles a stage fill the shared memory). From M = LARGE_M: 128 x 64 tiles, 8 warps,
    2 stages, and x rounded to e4m3 once beforehand (pre_act) rather than again by every N tile.
    From bench/proj.py --sweep on the H200 (bench/RESULTS.md). The overrides are for tuning."""
    large = M >= LARGE_M
    bm = block_m or (128 if large else min(64, max(16, triton.next_power_of_2(M))))
    bn = block_n or (64 if M > 16 and N >= 2048 or large else 32)
    assert ROW_ALIGN % bn == 0
    n_m, n_n = triton.cdiv(M, bm), triton.cdiv(N, bn)
    sp = plan_split(n_m * n_n, K // QBLOCK, num_sms(device), split_k)
    return ProjPlan(bm, bn, sp.split, sp.kb_per_split, (n_n, n_m, sp.split), num_warps or (8 if large else 4),
                    num_stages or (4 if M <= 16 else 2 if large else 3), large if pre_act is None else pre_act)


def proj_gemm(x: torch.Tensor, p: Proj, norm=None, workspace=None, unfused=None, xa=None, xq=None, swiglu=None,
              rows=None, names=None, **plan_kw) -> dict:
    """x [..., K] -> {name: [..., out]}: each projection of the group, in x's dtype (lo) or fp32
    (hi). norm = (weight [K], eps): the group reads rms_norm(x, weight, eps), normed in the
    kernel. xa: fp8_sim(x, 128), when x's producer made it (mhc_pre's act_out): the act rows read
    it instead of rounding x per tile (no norm then). xq = (e4m3 codes [..., K], fp32 scales
    [..., K/128], contiguous) of xa (mhc_pre's act_q): the FP8 rows dot them on the FP8 tensor
    cores, at M tiles of up to 16 rows (else ignored). K must be a multiple of 128 (else the
    reference runs). From UNFUSED_M tokens (prefill; unfused=True/False forces it) each
    projection is its own cuBLAS GEMM instead (proj_unfused). swiglu = (u [..., K], limit): the
    group reads swiglu_act(x, u, limit) in x's dtype instead of x (the shared expert's w2 on its
    w1 and w3 outputs), made in the kernel's K loop; a group of FP8 rows only (else, or with norm /
    xa, or from UNFUSED_M tokens, the activation kernel runs first). workspace: a SplitKWorkspace,
    or a name for a shared one of its own (a GEMM beside the step's stream: common.get_workspace).
    rows = {name: row ids [n]}: those projections on those rows of their weight only, [..., n]
    (sequence-parallel prefill's share of the compressors' channels; the per-projection path).
    names: only those projections (the per-projection path)."""
    if swiglu is not None:
        assert swiglu[0].shape == x.shape, (tuple(swiglu[0].shape), tuple(x.shape))
        if norm is not None or xa is not None or p.n8 != p.N or p.K % QBLOCK:
            x, swiglu = swiglu_act(x, swiglu[0], swiglu[1], False, x.dtype), None
    if p.K % QBLOCK or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return proj_gemm_ref(x, p, norm, rows=rows, names=names)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, p.K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    assert xa is None or norm is None, "xa is x's rounding: a normed group rounds its own input"
    xa2 = xa.reshape(-1, p.K) if xa is not None else None
    if xa2 is not None and xa2.stride() != x2.stride():     # the kernel reads both with x's row stride
        x2, xa2 = x2.contiguous(), xa2.contiguous()
    if swiglu is not None:
        u2 = swiglu[0].reshape(-1, p.K)
        if u2.stride(-1) != 1:
            u2 = u2.contiguous()
        xq = None
    if (M >= UNFUSED_M if unfused is None else unfused) and p.dense is not None or rows or names:
        if swiglu is not None:
            x2 = swiglu_act(x2, u2, swiglu[1], False, x2.dtype)
        return proj_unfused(x2, p, norm, lead, xa2, rows, names)
    lo = torch.empty(M * p.lo_width, dtype=x.dtype, device=x.device)
    hi = torch.empty(M * p.hi_width, dtype=torch.float32, device=x.device)
    if M:
        pl = proj_plan(M, p.N, p.K, x.device, **plan_kw)
        split = pl.split > 1
        ws = get_workspace(workspace, pl.split * M * p.N, pl.grid[0] * pl.grid[1], x.device) if split else None
        pre = (pl.pre_act or xa2 is not None) and p.n_act > 0 and norm is None and swiglu is None
        xa = (xa2 if xa2 is not None else fp8_sim(x2, QBLOCK)) if pre else x2   # the act rows' input, rounded once
        pre_q = xq is not None and pre and pl.block_m <= 16
        if pre_q:
            assert xq[0].dtype == torch.float8_e4m3fn and xq[0].numel() == M * p.K and xq[0].is_contiguous()
            assert xq[1].dtype == torch.float32 and xq[1].numel() == M * p.K // QBLOCK and xq[1].is_contiguous()
        _proj_kernel[pl.grid](
            x2, xa, xq[0] if pre_q else x2, xq[1] if pre_q else x2,
            p.w8 if p.w8 is not None else x2, p.s8 if p.s8 is not None else x2,
            p.wd if p.wd is not None else x2, p.meta, lo, hi, ws.partials if split else hi,
            ws.tickets if split else hi, norm[0] if norm is not None else x2, u2 if swiglu is not None else x2,
            M, p.N, p.K, p.n8, p.n_act, p.n_lo, pl.kb_per_split, pl.split,
            x2.stride(0), u2.stride(0) if swiglu is not None else 0, p.s8.stride(0) if p.s8 is not None else 0,
            norm[1] if norm is not None else 0.0, _limit(swiglu[1]) if swiglu is not None else 0.0,
            ACT8=p.n_act >= p.n8 > 0, SW_ROUND=interpreting(), SPLIT=split, NORM=norm is not None,
            PRE_ACT=pre, PRE_Q=pre_q, SWIGLU=swiglu is not None, BLOCK_M=pl.block_m, BLOCK_N=pl.block_n, ALIGN=ROW_ALIGN, num_warps=pl.num_warps,
            num_stages=pl.num_stages, **pdl_args())
    return split_outputs(p, lo, hi, lead)


def _limit(limit: float) -> float:
    return limit if limit > 0 else float("inf")      # SwiGLU's clamp; 0: none (swiglu.py's convention)


def proj_unfused(x2: torch.Tensor, p: Proj, norm, lead, xa=None, rows=None, names=None) -> dict:
    """The group as one GEMM per projection, for large M where the GEMMs are compute-bound: x
    rounded to e4m3 once for the act rows, cuBLAS (F.linear) for the x-dtype outputs, the bf16
    GEMM kernel for the fp32 ones. bench/proj.py: 2.4-3x faster than the packed kernel at M = 8192,
    whose small-M tiles and per-block scaling do not reach the tensor cores' rate."""
    if norm is not None:
        x2 = rms_norm(x2, *norm)
    outs = {k: v for k, v in p.outs.items() if names is None or k in names}
    if xa is None and any(r < p.n_act for r, *_ in outs.values()):
        xa = fp8_sim(x2, QBLOCK)
    res = {}
    for name, (r, _, out, lo) in outs.items():
        xi = xa if r < p.n_act else x2
        w = p.dense[name] if not rows or name not in rows else p.dense[name][rows[name]]
        y = F.linear(xi, w) if lo else bf16_gemm(xi, w)
        res[name] = y.view(*lead, w.shape[0])
    return res


def proj_gemm_ref(x: torch.Tensor, p: Proj, norm=None, swiglu=None, rows=None, names=None, **_) -> dict:
    """Torch reference: swiglu_act_ref(x, *swiglu) in x's dtype when given, rms_norm(x) when
    normed, then each projection's math (those of `names`) on its dequantised rows (those of `rows`, as proj_gemm),
    fp32 accumulate (fp64 for an fp64 model); lo outputs cast to x's dtype."""
    if swiglu is not None:
        x = swiglu_act_ref(x, swiglu[0], swiglu[1], False, x.dtype)
    if norm is not None:
        x = rms_norm_ref(x, *norm)
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    xs = {False: up(x).to(wide)}
    res = {}
    for name, (r, _, out, lo) in p.outs.items():
        if names is not None and name not in names:
            continue
        if r < p.n8:
            w = fp8_block_dequant(p.w8[r:r + out], p.s8[r // QBLOCK:(r + out + QBLOCK - 1) // QBLOCK]
                                  .view(torch.float8_e8m0fnu))
        else:
            w = p.wd[r - p.n8:r - p.n8 + out]
        if rows and name in rows:
            w = w[rows[name]]
        act = r < p.n_act
        if act not in xs:
            xs[act] = up(fp8_sim_ref(x, QBLOCK)).to(wide)
        y = xs[act] @ w.to(wide).T
        res[name] = y.to(x.dtype) if lo else y.to(wide if wide == torch.float64 else torch.float32)
    return res
