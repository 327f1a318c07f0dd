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
import torch
import triton
import triton.language as tl

from engine.numerics import fp4_sim_ref, fp8_sim_ref, hadamard
from .act_sim import fp4_round_trip, fp8_round_trip, hadamard_rows
from .common import gdc_enter, hold, pdl_args, apply_rope, entry_loc, round_to, scratch
from .rms_norm import rms_norm_ref
from .rope_kv import _rope

SIM_NONE, SIM_FP8, SIM_FP4 = 0, 1, 2


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
            dd = tl.arange(0, D)
            if NC > 1:
                tl.debug_barrier()
                o = tl.load(row + dd, cache_modifier=".cg").to(tl.float32)    # at L2: the other SMs' shares
                tl.store(tick_ptr + b, 0)                                      # at rest for the next launch
            else:
                o = c
            o = o * tl.math.rsqrt(tl.sum(o * o, axis=0) / D + eps)
            o = round_to(tl.load(w_ptr + dd).to(tl.float32) * o, out_ty)
            half = tl.arange(0, D // 2) - (D - R) // 2
            hm = half >= 0
            cos = tl.load(cos_ptr + b * (R // 2) + half, mask=hm, other=1.0)
            sin = tl.load(sin_ptr + b * (R // 2) + half, mask=hm, other=0.0)
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
