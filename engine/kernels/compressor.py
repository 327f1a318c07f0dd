"""The KV compressor's decode step after its two projections, one kernel per step.

The tail of the compressor's decode step (compress_decode_ref below, about 45 small torch ops):
per sequence row, in d / 64 programs, each owning a slice of the channels (one program a row
above SPLIT_MAX_ROWS rows),
  1. add the slot's positional bias ape[pos % r] to the gate scores, write the token's kv and
     score into the running state (row off + pos % r; off = r for the overlapping ratio 4);
  2. if this token completes a window: softmax-pool the window per channel (ratio 4: the A
     half of the previous window's rows with the B half of this one's, 2r rows; else the r
     rows of this window), an online softmax over chunks of rows; ratio 4: the finished
     window's rows become the previous window's (each program its own channels);
  3. each program leaves its pooled channels, rounded to the model dtype, in the entry's pool
     row (block table lookup in the kernel); the row's last program to arrive (a ticket) reads
     the row back and does what needs every channel: RMSNorm, RoPE at the entry's position
     (cos/sin table), the reference-numerics rounding (FP8 on the non-rope dims, or for indexer
     keys Hadamard then FP4), and stores the entry.
Rows that complete no window write only their state row (the reference writes its unused
pooled value to block 0, which nothing reads).
"""
import functools

import torch
import triton
import triton.language as tl

from engine.numerics import fp4_sim_ref, fp8_sim_ref, hadamard
from .act_sim import fp4_round_trip, fp8_round_trip, hadamard_rows
from .common import gdc_enter, hold, pdl_args, apply_rope, entry_loc, round_to, scratch
from .rms_norm import rms_norm_ref
from .rope_kv import _rope

SIM_NONE, SIM_FP8, SIM_FP4 = 0, 1, 2
SIM_CODE = {None: SIM_NONE, "fp8": SIM_FP8, "fp4": SIM_FP4}    # Compressor.sim_of's names


@triton.jit
def _compress_kernel(args, K: tl.constexpr, USE_GDC: tl.constexpr = False):
    gdc_enter(USE_GDC)
    compress_program(tl.program_id(0), tl.program_id(1), args, K)


@triton.jit
def compress_program(b, j, args, K: tl.constexpr):
    """Program (b, j) of the grid (B, D / DC): row b's channels j*DC.. (+ D.. for ratio 4's B half)
    of the state and of the pool; args and K as compress_launch makes them (kv_prep.py runs these
    programs in its launch too)."""
    (kv_ptr, sc_ptr, ape_ptr, kst_ptr, sst_ptr, store_ptr, slot_ptr, pos_ptr, table_ptr, w_ptr, cos_ptr, sin_ptr,
     tick_ptr, stride_kv, stride_sc, stride_pos, stride_tab, n_blocks, per_block, eps, hscale) = args
    D: tl.constexpr = K[0]
    C: tl.constexpr = K[1]
    R: tl.constexpr = K[2]
    RATIO: tl.constexpr = K[3]
    OFF: tl.constexpr = K[4]
    ROWS: tl.constexpr = K[5]
    OVERLAP: tl.constexpr = K[6]
    SIM: tl.constexpr = K[7]
    ROWS_BLOCK: tl.constexpr = K[8]
    LOG_D: tl.constexpr = K[9]
    DC: tl.constexpr = K[10]
    NC: tl.constexpr = D // DC
    slot = tl.load(slot_ptr + b)
    p = tl.load(pos_ptr + b * stride_pos)
    cur = OFF + p % RATIO
    cc = tl.arange(0, DC * (C // D))                       # this program's channels of the state
    cc = (cc // DC) * D + j * DC + cc % DC
    kv_new = tl.load(kv_ptr + b * stride_kv + cc).to(tl.float32)
    sc_new = tl.load(sc_ptr + b * stride_sc + cc) + tl.load(ape_ptr + (p % RATIO) * C + cc)
    kst = kst_ptr + slot * (ROWS * C)
    sst = sst_ptr + slot * (ROWS * C)
    tl.store(kst + cur * C + cc, kv_new)
    tl.store(sst + cur * C + cc, sc_new)
    if (p + 1) % RATIO == 0:
        d = j * DC + tl.arange(0, DC)
        # this token's values as the pooled rows see them: ratio 4 rows >= r read the B half
        kv_cur = tl.load(kv_ptr + b * stride_kv + OFF // RATIO * D + d).to(tl.float32)
        sc_cur = tl.load(sc_ptr + b * stride_sc + OFF // RATIO * D + d) + \
            tl.load(ape_ptr + (p % RATIO) * C + OFF // RATIO * D + d)
        m = tl.full([DC], float("-inf"), tl.float32)
        den = tl.zeros([DC], tl.float32)
        acc = tl.zeros([DC], tl.float32)
        for r0 in tl.static_range(0, ROWS, ROWS_BLOCK):
            s = r0 + tl.arange(0, ROWS_BLOCK)                                           # state rows
            ch = (s >= RATIO).to(tl.int32) * D                  # rows >= r exist only for ratio 4
            offs = s[:, None] * C + ch[:, None] + d[None, :]
            k = tl.load(kst + offs)
            g = tl.load(sst + offs)
            mine = (s == cur)[:, None]
            k = tl.where(mine, kv_cur[None, :], k)
            g = tl.where(mine, sc_cur[None, :], g)
            m_new = tl.maximum(m, tl.max(g, axis=0))
            base = tl.where(m_new == float("-inf"), 0.0, m_new)
            e = tl.exp(g - base[None, :])
            keep = tl.exp(m - base)
            den = den * keep + tl.sum(e, axis=0)
            acc = acc * keep + tl.sum(k * e, axis=0)
            m = m_new
        out_ty = store_ptr.dtype.element_ty
        entry = p // RATIO
        blk = tl.minimum(entry // per_block, n_blocks - 1)
        row = store_ptr + (tl.load(table_ptr + b * stride_tab + blk) * per_block + entry % per_block) * D
        c = round_to(tl.math.div_rn(acc, den), out_ty)          # exact in the pool's dtype
        if OVERLAP:
            # the finished window (rows r..2r-1, this program's channels) becomes the previous one
            # (rows 0..r-1): only this program reads these channels, and once every warp has read
            # them (the barrier: the pooling's row reductions may be warp-local, so nothing else
            # orders another warp's store of a row after this warp's load of it)
            tl.debug_barrier()
            rr = tl.arange(0, RATIO)
            src = (RATIO + rr)[:, None] * C + cc[None, :]
            mine = (RATIO + rr == cur)[:, None]
            tl.store(kst + rr[:, None] * C + cc[None, :], tl.where(mine, kv_new[None, :], tl.load(kst + src)))
            tl.store(sst + rr[:, None] * C + cc[None, :], tl.where(mine, sc_new[None, :], tl.load(sst + src)))
        last = True
        if NC > 1:      # the norm needs every channel: each program leaves its pooled share in the
            # entry's row, the last to arrive (a ticket per row) finishes the row
            tl.store(row + d, c)
            tl.debug_barrier()
            last = tl.atomic_add(tick_ptr + b, 1, sem="acq_rel", scope="gpu") == NC - 1
        if last:
            if NC > 1:
                tl.debug_barrier()
                o = tl.load(row + tl.arange(0, D), cache_modifier=".cg").to(tl.float32)   # at L2: the other SMs' shares
                tl.store(tick_ptr + b, 0)                                      # at rest for the next launch
            else:
                o = c
            finish_entry(o, row, w_ptr, cos_ptr + b * (R // 2), sin_ptr + b * (R // 2), eps, hscale, D, R, SIM, LOG_D)


@triton.jit
def finish_entry(o, row, w_ptr, cos_ptr, sin_ptr, eps, hscale, D: tl.constexpr, R: tl.constexpr, SIM: tl.constexpr,
                 LOG_D: tl.constexpr):
    """A pooled entry o [D] fp32 (already in row's dtype) -> RMSNorm (weight w), RoPE on the last R
    channels at cos / sin [R/2], the reference-numerics rounding (SIM: FP8 on the non-rope dims, or
    Hadamard then FP4), stored at row [D]: what needs every channel of the entry."""
    out_ty = row.dtype.element_ty
    dd = tl.arange(0, D)
    o = o * tl.math.rsqrt(tl.sum(o * o, axis=0) / D + eps)
    o = round_to(tl.load(w_ptr + dd).to(tl.float32) * o, out_ty)
    half = tl.arange(0, D // 2) - (D - R) // 2
    hm = half >= 0
    cos = tl.load(cos_ptr + half, mask=hm, other=1.0)
    sin = tl.load(sin_ptr + half, mask=hm, other=0.0)
    o = round_to(tl.reshape(_rope(tl.reshape(o, (1, D)), cos, sin, 1, D, R), (D,)), out_ty)
    if SIM == 1:
        o = tl.where(dd < D - R, round_to(fp8_round_trip(o, D, 64), out_ty), o)
    if SIM == 2:
        o = round_to(fp4_round_trip(round_to(tl.reshape(hadamard_rows(tl.reshape(o, (1, D)), hscale, 1, D, LOG_D), (D,)), out_ty), D, 32), out_ty)
    tl.store(row + dd, o)


# Channels per program (the pooling splits over channels; the last program of a row norms it):
# a 128-row HCA window of 512 channels was one program's 16 steps of 8 rows (16 us on the H200,
# bench/RESULTS.md), now 8 programs of 2 steps. Up to SPLIT_MAX_ROWS rows: bench/decode.py --ab
# (H200, 2026-12-04, 43 layers, 8k, at a position where every window completes) -0.37 ms a step
# at 1 row, -0.20 at 16, -0.18 at 64; at 256 rows the split with the other two levers of that run
# cost +0.45 ms (2,048 programs and their tickets), so larger steps keep one program a row.
CHANNELS_PER_PROGRAM = 64
SPLIT_MAX_ROWS = 64


def compress_decode(kv, score, ape, kv_state, score_state, store, slots, positions, block_table, block_tokens,
                    norm_weight, cos, sin, eps, ratio, sim=SIM_NONE, channels=None):
    """One decode token per row: kv, score [B, coff*d] fp32 (the wkv / wgate GEMMs, no ape),
    ape [ratio, coff*d] fp32, kv_state / score_state [slots, coff*ratio, coff*d] fp32 (updated),
    store [rows, d] (the flat entry pool, written where a window completes), slots [B],
    positions [B, 1], block_table [B, max_blocks], norm_weight [d], cos / sin [B, R/2] fp32 at
    the entry positions (pos // ratio * ratio). sim: SIM_NONE, SIM_FP8 (KV) or SIM_FP4 (indexer).
    channels: per program (tests; default CHANNELS_PER_PROGRAM up to SPLIT_MAX_ROWS rows, else all d)."""
    if kv.shape[0]:
        grid, args, K = compress_launch(kv, score, ape, kv_state, score_state, store, slots, positions, block_table,
                                        block_tokens, norm_weight, cos, sin, eps, ratio, sim, channels)
        if not hold(_compress_kernel, grid, args, K):
            _compress_kernel[grid](args, K=K, num_warps=4, **pdl_args())


def compress_launch(kv, score, ape, kv_state, score_state, store, slots, positions, block_table, block_tokens,
                    norm_weight, cos, sin, eps, ratio, sim=SIM_NONE, channels=None):
    """compress_decode's launch (same arguments; B >= 1 rows) -> (grid, args, constexprs K) of
    compress_program (its kernel's, or kv_prep's share of a launch)."""
    B, C = kv.shape
    D = store.shape[-1]
    overlap = C == 2 * D
    assert overlap == (ratio == 4) and (overlap or C == D), (C, D, ratio)
    rows = kv_state.shape[1]
    assert kv_state.shape == score_state.shape == (kv_state.shape[0], rows, C) and rows == (2 if overlap else 1) * ratio
    assert kv_state.is_contiguous() and score_state.is_contiguous() and store.is_contiguous()
    assert kv.stride(-1) == 1 and score.stride(-1) == 1 and score.dtype == torch.float32
    assert D & (D - 1) == 0 and ratio & (ratio - 1) == 0
    R = 2 * cos.shape[-1]
    dc = min(D, channels or (CHANNELS_PER_PROGRAM if B <= SPLIT_MAX_ROWS else D))
    # a row's tickets, at zero between launches; per state tensor, since the indexer's compressor
    # runs beside the attention's (step.beside, or kv_prep's one launch) and each must count its own programs
    tick = scratch(f"compressor.tickets.{kv_state.data_ptr()}", kv.device, max(B, 1), torch.int32, zero=True)
    args = (kv, score, ape.contiguous(), kv_state, score_state, store, slots.contiguous(), positions, block_table,
            norm_weight.contiguous(), cos.reshape(B, -1).contiguous(), sin.reshape(B, -1).contiguous(), tick,
            kv.stride(0), score.stride(0), positions.stride(0), block_table.stride(0), block_table.shape[1],
            block_tokens // ratio, eps, D ** -0.5)
    K = (D, C, R, ratio, ratio if overlap else 0, rows, overlap, sim, min(rows, max(1, 4096 // dc)),
         D.bit_length() - 1, dc)
    return (B, D // dc), args, K


def compress_decode_ref(kv, score, ape, kv_state, score_state, store, slots, positions, block_table, block_tokens,
                        norm_weight, cos, sin, eps, ratio, sim=SIM_NONE):
    """Torch reference of compress_decode (same contract), the compressor's pooling written out:
    the pooled entry is always computed, and written to its block when the window completes,
    else to the never-read block 0 (no data-dependent branch)."""
    B, C = kv.shape
    r, d = ratio, store.shape[-1]
    overlap = C == 2 * d
    pos = positions.reshape(B)
    off = r if overlap else 0
    kv_state[slots, off + pos % r] = kv
    score_state[slots, off + pos % r] = score + ape[pos % r]
    st_kv, st_sc = kv_state[slots], score_state[slots]                          # [B, coff*r, C]
    if overlap:   # the previous window's A half, then this window's B half: 2r rows
        k = torch.cat((st_kv[:, :r, :d], st_kv[:, r:, d:]), dim=1)
        s = torch.cat((st_sc[:, :r, :d], st_sc[:, r:, d:]), dim=1)
    else:
        k, s = st_kv, st_sc
    pooled = (k * s.softmax(dim=1)).sum(dim=1)                                   # [B,d] fp32
    c = apply_rope(rms_norm_ref(pooled.to(store.dtype), norm_weight, eps), cos.reshape(B, -1), sin.reshape(B, -1))
    if sim == SIM_FP4:
        c = fp4_sim_ref(hadamard(c), 32)
    elif sim == SIM_FP8:
        nope = d - 2 * cos.shape[-1]
        c = torch.cat((fp8_sim_ref(c[..., :nope], 64), c[..., nope:]), dim=-1)
    emit = (pos + 1) % r == 0
    loc = torch.where(emit, entry_loc(block_table, block_tokens, (pos // r)[:, None], r)[:, 0], 0)
    store.index_copy_(0, loc, c.to(store.dtype))
    if overlap:   # a finished window becomes the previous one
        e = emit[:, None, None]
        kv_state[slots, :r] = torch.where(e, st_kv[:, r:], st_kv[:, :r])
        score_state[slots, :r] = torch.where(e, st_sc[:, r:], st_sc[:, :r])


# ---- a prefill step's entries: the pooled windows of every chunk, finished in one launch ----
# (the torch finish is ~15-30 launches a compressor: norm, RoPE, Hadamard, FP8 / FP4 rounding, the
# store's index_put; a prefill step launches from Python and at 8k tokens its ~5,700 launches
# could take longer than the GPU's work, bench/RESULTS.md 2026-12-07). bench/levers.py: finish_kernel
FINISH_KERNEL = True
@triton.jit
def _finish_kernel(c_ptr, loc_ptr, store_ptr, w_ptr, cos_ptr, sin_ptr, stride_c, eps, hscale, D: tl.constexpr,
                   R: tl.constexpr, SIM: tl.constexpr, LOG_D: tl.constexpr, USE_GDC: tl.constexpr = False):
    gdc_enter(USE_GDC)
    e = tl.program_id(0)
    o = round_to(tl.load(c_ptr + e * stride_c + tl.arange(0, D)).to(tl.float32), store_ptr.dtype.element_ty)
    row = store_ptr + tl.load(loc_ptr + e).to(tl.int64) * D
    finish_entry(o, row, w_ptr, cos_ptr + e * (R // 2), sin_ptr + e * (R // 2), eps, hscale, D, R, SIM, LOG_D)


def compress_finish(c, loc, store, norm_weight, cos, sin, eps, sim=SIM_NONE):
    """A prefill step's pooled entries c [E, d] fp32 -> store[loc] (loc [E] rows of the flat pool
    [rows, d]): rounded to store's dtype, RMSNorm, RoPE at cos / sin [E, R/2] fp32 (the entries'
    positions), the reference-numerics rounding `sim`; one program an entry, with the decode
    kernel's finish (finish_entry), so prefill and decode make the same bits of an entry."""
    if not FINISH_KERNEL:
        return compress_finish_ref(c, loc, store, norm_weight, cos, sin, eps, sim)
    E, D = c.shape
    assert store.shape[-1] == D and D & (D - 1) == 0 and c.stride(-1) == 1 and store.is_contiguous()
    if E:
        _finish_kernel[(E,)](c, loc.contiguous(), store, norm_weight.contiguous(), cos.contiguous(), sin.contiguous(),
                             c.stride(0), eps, D ** -0.5, D=D, R=2 * cos.shape[-1], SIM=sim, LOG_D=D.bit_length() - 1,
                             num_warps=4, **pdl_args())


def compress_finish_ref(c, loc, store, norm_weight, cos, sin, eps, sim=SIM_NONE):
    """Torch reference of compress_finish (the compressor's finish, engine.model.compressor)."""
    o = apply_rope(rms_norm_ref(c.to(store.dtype), norm_weight, eps), cos, sin)
    if sim == SIM_FP4:
        o = fp4_sim_ref(hadamard(o), 32)
    elif sim == SIM_FP8:
        nope = c.shape[-1] - 2 * cos.shape[-1]
        o = torch.cat((fp8_sim_ref(o[..., :nope], 64), o[..., nope:]), dim=-1)
    store[loc] = o.to(store.dtype)


# ---- a prefill step's pooling: every chunk's complete windows pooled, and the rows the state keeps ----
# (Compressor.prefill's torch bookkeeping is ~15 launches at HCA and ~27 at CSA's overlapping ratio
# 4 a compressor: the extended rows, the A halves, the softmax pool, the rows gathered for the state.)
@triton.jit
def _ext_rows(x, ok, c, cm, kv_ptr, sc_ptr, ape_ptr, ks_ptr, ss_ptr, src_ptr, apes_ptr, col_ptr,
              stride_kv, stride_sc, C):
    """Rows x [N] of the plan's extended order (masked by ok), this rank's columns c [BC] (masked by cm)
    -> kv, score [N, BC] fp32: a chunk token's projections (its score plus the ape of its slot in
    the window), or a state row (scored already)."""
    s = tl.load(src_ptr + x, mask=ok, other=0).to(tl.int64)
    tok = (s >= 0) & ok
    old = (s < 0) & ok
    col = tl.load(col_ptr + c, mask=cm, other=0).to(tl.int64)
    mt, ms = tok[:, None] & cm[None, :], old[:, None] & cm[None, :]
    a = tl.load(apes_ptr + x, mask=tok, other=0).to(tl.int64)
    st = (-s - 1) * C
    kv = tl.load(kv_ptr + s[:, None] * stride_kv + c[None, :], mask=mt, other=0.0) + \
        tl.load(ks_ptr + st[:, None] + col[None, :], mask=ms, other=0.0)
    sc = tl.load(sc_ptr + s[:, None] * stride_sc + c[None, :], mask=mt, other=0.0) + \
        tl.load(ape_ptr + a[:, None] * C + col[None, :], mask=mt, other=0.0) + \
        tl.load(ss_ptr + st[:, None] + col[None, :], mask=ms, other=0.0)
    return kv, sc


@triton.jit
def _online(m, den, acc, k, g):
    """One chunk of rows k, g [N, BC] into the per-channel online softmax pool (m, den, acc [BC])."""
    m_new = tl.maximum(m, tl.max(g, axis=0))
    base = tl.where(m_new == float("-inf"), 0.0, m_new)
    e = tl.exp(g - base[None, :])
    keep = tl.exp(m - base)
    return m_new, den * keep + tl.sum(e, axis=0), acc * keep + tl.sum(k * e, axis=0)


@triton.jit
def _pool_kernel(kv_ptr, sc_ptr, ape_ptr, ks_ptr, ss_ptr, src_ptr, apes_ptr, col_ptr, astate_ptr, outx_ptr,
                 pooled_ptr, okv_ptr, osc_ptr, E, stride_kv, stride_sc, C, DP, CP,
                 R: tl.constexpr, OVERLAP: tl.constexpr, BC: tl.constexpr, RB: tl.constexpr,
                 USE_GDC: tl.constexpr = False):
    gdc_enter(USE_GDC)
    pid = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    args = (kv_ptr, sc_ptr, ape_ptr, ks_ptr, ss_ptr, src_ptr, apes_ptr, col_ptr, stride_kv, stride_sc, C)
    if pid < E:                      # window pid: the softmax pool of its rows, channels c of d'
        cm = c < DP
        m = tl.full([BC], float("-inf"), tl.float32)
        den = tl.zeros([BC], tl.float32)
        acc = tl.zeros([BC], tl.float32)
        if OVERLAP:                  # the A half: the window before, or the state's for a row's first
            a0 = tl.load(astate_ptr + pid).to(tl.int64)
            col = tl.load(col_ptr + c, mask=cm, other=0).to(tl.int64)
            for j0 in range(0, R, RB):
                j = j0 + tl.arange(0, RB)
                ok = j < R
                if a0 >= 0:
                    mk = ok[:, None] & cm[None, :]
                    k = tl.load(ks_ptr + (a0 + j)[:, None] * C + col[None, :], mask=mk, other=0.0)
                    g = tl.load(ss_ptr + (a0 + j)[:, None] * C + col[None, :], mask=mk, other=float("-inf"))
                else:
                    k, g = _ext_rows((pid - 1) * R + j, ok, c, cm, *args)
                    g = tl.where(ok[:, None], g, float("-inf"))
                m, den, acc = _online(m, den, acc, k, g)
            cb = c + DP              # the window's own rows pool their B half
        else:
            cb = c
        for j0 in range(0, R, RB):
            j = j0 + tl.arange(0, RB)
            ok = j < R
            k, g = _ext_rows(pid * R + j, ok, cb, cm, *args)
            g = tl.where(ok[:, None], g, float("-inf"))
            m, den, acc = _online(m, den, acc, k, g)
        tl.store(pooled_ptr + pid.to(tl.int64) * DP + c, tl.math.div_rn(acc, den), mask=cm)
    else:                            # a row the state keeps: one extended row, channels c of C'
        o = pid - E
        cm = c < CP
        x = tl.load(outx_ptr + o + tl.arange(0, 1))
        kx, gx = _ext_rows(x, x >= 0, c, cm, *args)        # (names of their own: shapes differ from k, g)
        tl.store(okv_ptr + o.to(tl.int64) * CP + c[None, :], kx, mask=cm[None, :])
        tl.store(osc_ptr + o.to(tl.int64) * CP + c[None, :], gx, mask=cm[None, :])


POOL_KERNEL = True      # False: compress_pool_ref's torch ops (bench/levers.py: pool_kernel)


def compress_pool(kv, score, ape, ks, ss, p, ratio, overlap, ch=None):
    """A prefill step's pooling (Compressor.prefill before the finish): kv, score [T, C'] fp32 (this
    rank's columns ch of the C, or all C), ape [r, C] fp32, the flat states ks, ss [slots*rows, C]
    (read, not written), p the step's plan (model/compressor.py prefill_plan) -> the list the
    prefill stores (after the channel split's all-gather): the pooled entries [E, d'] (if E), at
    ratio 4 each emitting row's last window kv, score [n, r, C'] (if E), then the open tokens'
    kv, score [X - E*r, C'] (what stays in the state). One launch."""
    if not POOL_KERNEL:
        return compress_pool_ref(kv, score, ape, ks, ss, p, ratio, overlap, ch)
    E, CP, C = p["E"], kv.shape[-1], ks.shape[-1]
    DP = CP // 2 if overlap else CP
    assert kv.stride(-1) == 1 and score.stride(-1) == 1 and ks.is_contiguous() and ss.is_contiguous()
    col = _columns(C, kv.device) if ch is None else ch
    outx = p["out_x"]                   # each emitting row's last window (ratio 4), then the open tokens
    pooled = torch.empty(E, DP, dtype=torch.float32, device=kv.device)
    okv = torch.empty(outx.shape[0], CP, dtype=torch.float32, device=kv.device)
    osc = torch.empty_like(okv)
    if E + outx.shape[0]:
        bc = min(128, triton.next_power_of_2(max(DP, CP)))
        _pool_kernel[(E + outx.shape[0], triton.cdiv(max(DP, CP), bc))](
            kv, score, ape, ks, ss, p["src"], p["ext_ape"], col, p["a_state"], outx, pooled, okv, osc, E,
            kv.stride(0), score.stride(0), C, DP, CP, R=ratio, OVERLAP=bool(overlap), BC=bc,
            RB=min(triton.next_power_of_2(ratio), 16), num_warps=4, **pdl_args())
    n = p["n_last"]
    made = [pooled] if E else []
    if E and overlap:
        made += [okv[:n].view(-1, ratio, CP), osc[:n].view(-1, ratio, CP)]
    return made + [okv[n:], osc[n:]]


@functools.lru_cache(maxsize=16)
def _columns(C: int, device) -> torch.Tensor:
    return torch.arange(C, device=device)


def compress_pool_ref(kv, score, ape, ks, ss, p, ratio, overlap, ch=None):
    """Torch reference of compress_pool (same contract): the plan's extended rows (the open windows'
    earlier tokens from the state, the chunks' tokens plus their ape), each window's softmax pool
    (ratio 4: the A half of the window before, or of the state's previous window for a row's
    first), the rows the state keeps."""
    r, E, Cp = ratio, p["E"], kv.shape[-1]
    ape = ape if ch is None else ape[:, ch]
    ext_kv = _extend(ks, kv, p, None, ch)                                   # [X, C']
    ext_sc = _extend(ss, score, p, ape[p["tk_ape"]], ch)
    made = []
    if E:
        kvw, scw = ext_kv[:E * r].view(E, r, Cp), ext_sc[:E * r].view(E, r, Cp)
        if overlap:
            d = Cp // 2
            a_kv, a_sc = kvw[..., :d].roll(1, 0), scw[..., :d].roll(1, 0)
            cols = slice(0, d) if ch is None else ch[:d]
            a_kv[p["first_win"]] = ks.view(-1, 2 * r, ks.shape[-1])[p["emit_slot"], :r][..., cols]
            a_sc[p["first_win"]] = ss.view(-1, 2 * r, ss.shape[-1])[p["emit_slot"], :r][..., cols]
            kvw_, scw_ = torch.cat((a_kv, kvw[..., d:]), dim=-2), torch.cat((a_sc, scw[..., d:]), dim=-2)
        else:
            kvw_, scw_ = kvw, scw
        made.append((kvw_ * scw_.softmax(dim=-2)).sum(dim=-2))                 # [E,d']
        if overlap:        # each row's last complete window is the next entry's A half
            made += [kvw[p["last_win"]], scw[p["last_win"]]]
    return made + [ext_kv[E * r:], ext_sc[E * r:]]


def _extend(state, new, p, ape, ch=None):
    """state [slots*coff*r, C] and new tokens [T, C'] (C' = C, or the columns ch) -> [X, C']: the
    open windows' earlier tokens from the state, the chunks' tokens (plus their ape, if given)
    from `new`, in plan order."""
    out = new.new_empty(p["X"], new.shape[-1])
    out[p["st_pos"]] = state[p["st_idx"]] if ch is None else state[p["st_idx"][:, None], ch]
    tok = new[p["tk_tok"]]
    out[p["tk_pos"]] = tok if ape is None else tok + ape
    return out
