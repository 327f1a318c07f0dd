"""Fused routed-expert MoE, W4A16: e2m1 weights stay packed and are decoded inside the GEMMs.

fused_moe(x [T,D], topk_weights [T,k], topk_ids [T,k], packed, swiglu_limit) -> [T,D] fp32 computes
what engine/model/moe.py Experts.forward does, in up to four launches (two in decode steps, where
the router sorts the pairs and the down kernel sums), no host sync (CUDA-graph safe):
 1. moe_align.py's _align_kernel: one program sorts the T*k (token, slot) pairs by expert and pads
    each expert's group to BLOCK_M rows -> sorted pair ids and one expert id per block (-1: unused).
    Everything is sized from the bound T*k + min(E, T*k)*(BM-1), so every grid is fixed per
    (T, k, E). In decode steps the router's last program does this sort instead (router.py,
    `aligned`): no launch here.
 2. _gate_up_kernel, per (block, 64 intermediate columns, K split): one [128, 128] tile (64 gate +
    64 up rows) is decoded to bf16 straight into wgmma's register A operand, against the gathered
    activations (swap-AB: weights are M, tokens N, so a lone decode token still fills the wide side).
    Epilogue: clamped SwiGLU, routing weight, bf16 rounding (where the reference rounds). Small
    batches split K; the last split to take an atomic ticket adds the partials in split order.
 3. _down_kernel, per (block, 128 hidden rows): w2 against the intermediate, a row per pair in x's
    dtype (rounded where the reference's F.linear rounds it: half the bytes of fp32 to write and sum).
    Small steps (SUM_IN_DOWN_MAX_T): the last program to take a ticket for its 128 hidden rows does 4.
 4. _sum_kernel: a token's k slot rows summed in slot order; ids outside [0, E) (experts on another
    EP rank) are skipped. Tickets only pick which program adds, never the order: deterministic.
The shared expert's output is added after the routed sum. Small steps (SHARED_IN_DOWN_MAX_T) may
hand the shared expert's down projection to the down kernel (`shared_expert`): one more program
row makes SwiGLU of its w1/w3 outputs (rounded as swiglu.py does) and the bf16 GEMM with its w2,
so neither the SwiGLU launch nor w2's GEMM runs apart (the issue's "seventh expert").

The experts' packed layout and its decode: moe_pack.py.
Under TRITON_INTERPRET=1 (CPU tests) the decode runs in plain Triton ops and the math in fp32.
"""
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine.numerics import fp8_sim_ref, up, up_dtype
from . import moe_align as ma
from .act_sim import fp8_round_trip
from .common import gdc_enter, pdl_args, interpreting, num_sms, round_to, scratch
from .moe_pack import PackedExperts, dequant_experts, pack_experts  # noqa: F401 (their home is moe_pack)

BM_CHOICES = (16, 32, 64)    # routed rows per block (the wgmma N); 16 is the instruction minimum
# Each pair's down-projection row is stored in the model dtype, rounded where the reference's
# F.linear rounds it: half the bytes an fp32 row costs the down kernel's stores and the sum's
# loads (an 8k prefill writes and reads 0.8 GB a layer of them in fp32). False: fp32 rows (the lever).
PAIR_ROWS_IN_MODEL_DTYPE = True
# Tokens up to which the down kernel's last program per 128 hidden rows sums the slots itself (no
# _sum_kernel launch); past it that one program's serial sum would cost more than the launch.
SUM_IN_DOWN_MAX_T = 64
# Tokens up to which the shared expert's SwiGLU and down projection run as the down kernel's last
# program row (fused_moe's `shared_expert`): two launches fewer a layer; past it one program per
# 128 hidden rows would carry every token. 0: always apart (the model's step reads takes_shared).
SHARED_IN_DOWN_MAX_T = 0      # off: measured slower (H200, 2026-12-05: +0.11 ms at C = 1, +3.6 ms at C = 64, bench/RESULTS.md); tokens up to which the down kernel makes the shared expert
_SIGN: tl.constexpr = tl.constexpr(0x80008000)
_MAG: tl.constexpr = tl.constexpr(0x01C001C0)


# ----------------------------------------------------------------------------- routing

def align_plan(T: int, k: int, packed: "PackedExperts", device) -> tuple[int, int, int, int, int] | None:
    """(BLOCK_M, padded rows P, blocks B, NP, EP) of fused_moe's pair sort for T tokens of k slots,
    or None where the one-program sort does not take them (more than ALIGN_MAX pairs)."""
    N = T * k
    if N > ma.ALIGN_MAX:
        return None
    bm = moe_config(T, k, packed.E, packed.I, packed.D, num_sms(device, cpu=4))[0]
    return (bm, *ma.align_bounds(N, packed.E, bm), max(16, triton.next_power_of_2(N)),
            triton.next_power_of_2(packed.E + 1))



# ----------------------------------------------------------------------------- decode

@triton.jit
def _decode_asm(w):
    """int32 words -> 8 bf16 (pairs q0h0, q0h1, .., q3h1) = e2m1 * 2^-126; 11 logic ops per word."""
    return tl.inline_asm_elementwise(
        """{ .reg .b32 t0, t1, t2, t3, a, b;
        and.b32 t0, $8, 0x81C081C0;
        shl.b32 a, $8, 1; shl.b32 b, $8, 3; and.b32 a, a, 0x80008000; and.b32 b, b, 0x01C001C0; or.b32 t1, a, b;
        shl.b32 a, $8, 2; shf.l.wrap.b32 b, $8, $8, 12; and.b32 a, a, 0x80008000; and.b32 b, b, 0x01C001C0;
        or.b32 t2, a, b; shl.b32 t3, $8, 6; and.b32 t3, t3, 0x81C081C0;
        mov.b32 {$0, $1}, t0; mov.b32 {$2, $3}, t1; mov.b32 {$4, $5}, t2; mov.b32 {$6, $7}, t3; }""",
        "=h,=h,=h,=h,=h,=h,=h,=h,r", [w], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)


@triton.jit
def _bf16_halves(q, F32: tl.constexpr):
    if F32:   # straight to fp32 bits: the interpreter flushes bf16 subnormals (the 0.5 code) in casts
        return (q << 16).to(tl.float32, bitcast=True), (q & 0xFFFF0000).to(tl.float32, bitcast=True)
    return ((q & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True),
            (q >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True))


@triton.jit
def _decode_ops(w, F32: tl.constexpr):
    """Plain-op twin of _decode_asm (interpreter, or ASM=False)."""
    u = w.to(tl.uint32, bitcast=True)
    a0, a1 = _bf16_halves(u & (_SIGN | _MAG), F32)
    b0, b1 = _bf16_halves(((u << 1) & _SIGN) | ((u << 3) & _MAG), F32)
    c0, c1 = _bf16_halves(((u << 2) & _SIGN) | (((u << 12) | (u >> 20)) & _MAG), F32)
    d0, d1 = _bf16_halves((u << 6) & (_SIGN | _MAG), F32)
    return a0, a1, b0, b1, c0, c1, d0, d1


@triton.jit
def _scales_bf16(s, MX: tl.constexpr, ASM: tl.constexpr):
    """Stored scale bytes -> bf16 scales (see module docstring); asm spreads 4 bytes per 2 ops."""
    if ASM:
        if MX:
            return tl.inline_asm_elementwise(
                """{ .reg .b32 a, b; prmt.b32 a, $2, 0, 0x4140; prmt.b32 b, $2, 0, 0x4342;
                shl.b32 $0, a, 7; shl.b32 $1, b, 7; }""",
                "=r,=r,r", [s], dtype=tl.bfloat16, is_pure=True, pack=4)
        return tl.inline_asm_elementwise(
            """{ .reg .b32 a, b; prmt.b32 a, $2, 0, 0x4140; prmt.b32 b, $2, 0, 0x4342;
            mad.lo.u32 $0, a, 16, 0x75807580; mad.lo.u32 $1, b, 16, 0x75807580; }""",
            "=r,=r,r", [s], dtype=tl.bfloat16, is_pure=True, pack=4)
    s = s.to(tl.uint16)
    if MX:
        return (s << 7).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return ((s << 4) + 0x7580).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _weight_tile(words, sc, MX: tl.constexpr, ASM: tl.constexpr, F32: tl.constexpr):
    """words [2 half, 2 g, 128 t, 4 wr] int32, sc [32, 4*NB] uint8 -> W [128 n, 128 k] (bf16, fp32 if F32).

    The joins and permutes only rename registers: the result is already wgmma's A layout."""
    NB: tl.constexpr = 4 if MX else 8
    if ASM:
        a0, a1, b0, b1, c0, c1, d0, d1 = _decode_asm(words)
    else:
        a0, a1, b0, b1, c0, c1, d0, d1 = _decode_ops(words, F32)
    lo = tl.join(tl.join(a0, c0), tl.join(b0, d0))                # [.., r1, r2] for h = 0
    hi = tl.join(tl.join(a1, c1), tl.join(b1, d1))
    w = tl.join(lo, hi)                                           # [half, g, t, wr, r2, r1, h]
    w = w.reshape(2, 2, 4, 8, 4, 4, 2, 2, 2)                       # t -> (warp, lrow, lk)
    w = w.permute(0, 2, 7, 3, 1, 5, 6, 4, 8).reshape(128, 128)     # (half, warp, r1, lrow) x (g, wr, r2, lk, h)
    s = _scales_bf16(sc, MX, ASM).reshape(4, 8, 2, NB, 2).permute(2, 0, 4, 1, 3).reshape(128, NB)
    if F32:
        w = w.to(tl.float32).reshape(128, NB, 128 // NB) * s.to(tl.float32)[:, :, None]
    else:
        w = w.reshape(128, NB, 128 // NB) * s[:, :, None]
    return w.reshape(128, 128)


@triton.jit
def _mainloop(w_ptr, s_ptr, b_ptr, row_off, row_ok, kt0, kt1,
              BM: tl.constexpr, MX: tl.constexpr, ASM: tl.constexpr, F32: tl.constexpr):
    """acc [128, BM] = sum over k tiles kt0..kt1 of W_tile(kt) @ B[rows, kt*128:+128]^T.

    w_ptr/s_ptr point at the tile row's k-tile 0; B row r starts at b_ptr + row_off[r]."""
    NB: tl.constexpr = 4 if MX else 8
    woff = (((tl.arange(0, 2)[:, None, None, None] * 2 + tl.arange(0, 2)[None, :, None, None]) * 128
             + tl.arange(0, 128)[None, None, :, None]) * 4 + tl.arange(0, 4)[None, None, None, :])
    soff = tl.arange(0, 32)[:, None] * (4 * NB) + tl.arange(0, 4 * NB)[None, :]
    rk = tl.arange(0, 128)
    acc = tl.zeros([128, BM], tl.float32)
    for kt in range(kt0, kt1):
        wt = _weight_tile(tl.load(w_ptr + kt * 2048 + woff), tl.load(s_ptr + kt * 128 * NB + soff), MX, ASM, F32)
        xb = tl.load(b_ptr + row_off[:, None] + (kt * 128 + rk)[None, :], mask=row_ok[:, None], other=0.0)
        if F32:
            acc = tl.dot(wt, tl.trans(xb.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(wt, tl.trans(xb), acc)
    return acc


# ----------------------------------------------------------------------------- expert GEMMs

@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, alpha_ptr, sorted_ptr, bexp_ptr, tw_ptr, h_ptr, ws_ptr, cnt_ptr,
                    N, D, I, stride_x, limit, KT_PER,
                    TOPK: tl.constexpr, BM: tl.constexpr, SPLIT: tl.constexpr,
                    MX: tl.constexpr, ASM: tl.constexpr, F32: tl.constexpr, USE_GDC: tl.constexpr = False):
    gdc_enter(USE_GDC)
    b, j, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    e = tl.load(bexp_ptr + b)
    if e < 0:
        return
    NB: tl.constexpr = 4 if MX else 8
    NT, KT = I // 64, D // 128
    rows = b * BM + tl.arange(0, BM)
    pair = tl.load(sorted_ptr + rows)
    ok = pair < N
    tile = (e * NT + j).to(tl.int64) * KT
    kt0 = sp * KT_PER
    acc = _mainloop(w_ptr + tile * 2048, s_ptr + tile * 128 * NB, x_ptr, (pair // TOPK).to(tl.int64) * stride_x,
                    ok, kt0, tl.minimum(kt0 + KT_PER, KT), BM, MX, ASM, F32)
    if SPLIT > 1:
        # Partial tiles go to their own slot; the last split to take a ticket adds them in split order.
        toff = tl.arange(0, 128)[:, None] * BM + tl.arange(0, BM)[None, :]
        slot = ws_ptr + ((b * NT + j) * SPLIT).to(tl.int64) * (128 * BM)
        tl.store(slot + sp * (128 * BM) + toff, acc)
        tl.debug_barrier()                                    # every thread's partial precedes the ticket
        if tl.atomic_add(cnt_ptr + b * NT + j, 1, sem="acq_rel", scope="gpu") != SPLIT - 1:
            return
        acc = tl.load(slot + toff, cache_modifier=".cg")
        for i in tl.static_range(1, SPLIT):
            acc += tl.load(slot + i * (128 * BM) + toff, cache_modifier=".cg")
        tl.store(cnt_ptr + b * NT + j, 0)                     # re-armed for the next call / replay
    g, u = acc.reshape(2, 64, BM).permute(1, 2, 0).split()
    g = tl.minimum(g * tl.load(alpha_ptr + e * 3), limit)
    u = tl.minimum(tl.maximum(u * tl.load(alpha_ptr + e * 3 + 1), -limit), limit)
    wr = tl.load(tw_ptr + pair, mask=ok, other=0.0)
    h = g * tl.sigmoid(g) * u * wr[None, :]                   # [64, BM]; routing weight before w2
    cols = j * 64 + tl.arange(0, 64)
    tl.store(h_ptr + rows.to(tl.int64)[None, :] * I + cols[:, None], h.to(h_ptr.dtype.element_ty))


@triton.jit
def _down_kernel(h_ptr, w_ptr, s_ptr, alpha_ptr, sorted_ptr, bexp_ptr, y_ptr, N, D, I,
                 ids_ptr, sh_ptr, out_ptr, cnt_ptr, T, E, stride_sh,
                 g_ptr, u_ptr, w2s_ptr, IS, stride_g, stride_u, limit,
                 BM: tl.constexpr, MX: tl.constexpr, ASM: tl.constexpr, F32: tl.constexpr,
                 SUM: tl.constexpr, TOPK: tl.constexpr, BT: tl.constexpr, SHARED: tl.constexpr,
                 SHX: tl.constexpr = 0, SH_FP8: tl.constexpr = False, BTS: tl.constexpr = 16,
                 USE_GDC: tl.constexpr = False):
    gdc_enter(USE_GDC)
    b, j = tl.program_id(0), tl.program_id(1)
    if SHX:
        if b < tl.num_programs(0) - 1:
            _routed_down(h_ptr, w_ptr, s_ptr, alpha_ptr, sorted_ptr, bexp_ptr, y_ptr, N, D, I, b, j, BM, MX, ASM, F32)
        else:           # the shared expert (last program row): its hidden rows j of every token into sh
            _shared_down(g_ptr, u_ptr, w2s_ptr, sh_ptr, T, IS, stride_g, stride_u, stride_sh, limit, j,
                         SH_FP8, BTS, F32)
    else:
        _routed_down(h_ptr, w_ptr, s_ptr, alpha_ptr, sorted_ptr, bexp_ptr, y_ptr, N, D, I, b, j, BM, MX, ASM, F32)
    if SUM:
        # Small steps: the last block program (unused blocks too) to finish hidden rows j sums every
        # token's k rows there, as _sum_kernel would, so no launch of its own
        tl.debug_barrier()                                    # every thread's rows precede the ticket
        if tl.atomic_add(cnt_ptr + j, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
            n = j * 128 + tl.arange(0, 128)
            for t0 in range(0, T, BT):
                _sum_rows(y_ptr, ids_ptr, sh_ptr, out_ptr, t0 + tl.arange(0, BT), n, T, D, E, stride_sh,
                          TOPK, SHARED, True)
            tl.store(cnt_ptr + j, 0)                          # re-armed for the next call / replay


@triton.jit
def _routed_down(h_ptr, w_ptr, s_ptr, alpha_ptr, sorted_ptr, bexp_ptr, y_ptr, N, D, I, b, j,
                 BM: tl.constexpr, MX: tl.constexpr, ASM: tl.constexpr, F32: tl.constexpr):
    """y[pair, 128 j:+128] = w2_e[128 j:+128] @ h[row] for block b's pairs (expert e; none if unused)."""
    e = tl.load(bexp_ptr + b)
    if e >= 0:
        NB: tl.constexpr = 4 if MX else 8
        KT = I // 128
        rows = b * BM + tl.arange(0, BM)
        pair = tl.load(sorted_ptr + rows)
        ok = pair < N
        tile = (e * (D // 128) + j).to(tl.int64) * KT
        acc = _mainloop(w_ptr + tile * 2048, s_ptr + tile * 128 * NB, h_ptr, rows.to(tl.int64) * I, ok,
                        0, KT, BM, MX, ASM, F32)
        y = acc * tl.load(alpha_ptr + e * 3 + 2)
        n = j * 128 + tl.arange(0, 128)
        ty = y_ptr.dtype.element_ty      # the model dtype: F.linear's output rounding in the reference
        tl.store(y_ptr + pair.to(tl.int64)[None, :] * D + n[:, None], round_to(y, ty).to(ty), mask=ok[None, :])


@triton.jit
def _shared_down(g_ptr, u_ptr, w_ptr, sh_ptr, T, IS, stride_g, stride_u, stride_sh, limit, j,
                 FP8: tl.constexpr, BTS: tl.constexpr, F32: tl.constexpr):
    """sh[t, 128 j:+128] = w2[128 j:+128] @ act(t) for every token, BTS at a time (the routed
    path's registers suffice): act = SwiGLU of the shared expert's g, u [T, IS] rounded to sh's
    dtype and, if FP8, to e4m3 per 128 channels (swiglu.py's math); w2 [D, IS] in sh's dtype;
    fp32 accumulation, rounded once at the store."""
    ty = sh_ptr.dtype.element_ty
    n = j * 128 + tl.arange(0, 128)
    for t0 in range(0, T, BTS):
        t = t0 + tl.arange(0, BTS)
        tm = t < T
        acc = tl.zeros([128, BTS], tl.float32)
        for k0 in range(0, IS, 128):
            k = k0 + tl.arange(0, 128)
            g = tl.load(g_ptr + t[:, None] * stride_g + k[None, :], mask=tm[:, None], other=0.0).to(tl.float32)
            u = tl.load(u_ptr + t[:, None] * stride_u + k[None, :], mask=tm[:, None], other=0.0).to(tl.float32)
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
            a = round_to(g / (1.0 + tl.exp(-g)) * u, ty)                       # [BTS, 128]
            if FP8:
                a = round_to(tl.reshape(fp8_round_trip(tl.reshape(a, (BTS * 128,)), BTS * 128, 128), (BTS, 128)), ty)
            w = tl.load(w_ptr + n.to(tl.int64)[:, None] * IS + k[None, :])    # [128, 128]
            if F32:
                acc = tl.dot(w.to(tl.float32), tl.trans(a), acc, input_precision="ieee")
            else:
                acc = tl.dot(w, tl.trans(a.to(w.dtype)), acc)
        y = round_to(acc, ty)
        tl.store(sh_ptr + t.to(tl.int64)[None, :] * stride_sh + n[:, None], y.to(ty), mask=tm[None, :])


@triton.jit
def _sum_rows(y_ptr, ids_ptr, sh_ptr, out_ptr, t, n, T, D, E, stride_sh, TOPK: tl.constexpr,
              SHARED: tl.constexpr, CG: tl.constexpr):
    """out[t, n] = sum over slots s of y[t k + s, n] (ids outside [0, E) skipped), + shared[t, n];
    CG: y (and shared) read past L1 (other programs of this launch wrote them)."""
    acc = tl.zeros([t.shape[0], n.shape[0]], tl.float32)
    for s in tl.static_range(TOPK):
        e = tl.load(ids_ptr + t * TOPK + s, mask=t < T, other=-1)
        live = (e >= 0) & (e < E)
        at = y_ptr + (t * TOPK + s).to(tl.int64)[:, None] * D + n[None, :]
        m = live[:, None] & (n < D)[None, :]
        if CG:
            acc += tl.load(at, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
        else:
            acc += tl.load(at, mask=m, other=0.0).to(tl.float32)
    tn = (t < T)[:, None] & (n < D)[None, :]
    if SHARED:      # the shared expert's output, added after the routed sum (the reference's order)
        at = sh_ptr + t.to(tl.int64)[:, None] * stride_sh + n[None, :]
        if CG:
            acc += tl.load(at, mask=tn, other=0.0, cache_modifier=".cg").to(tl.float32)
        else:
            acc += tl.load(at, mask=tn, other=0.0).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64)[:, None] * D + n[None, :], acc, mask=tn)


@triton.jit
def _sum_kernel(y_ptr, ids_ptr, sh_ptr, out_ptr, T, D, E, stride_sh, TOPK: tl.constexpr, BT: tl.constexpr,
                BD: tl.constexpr, SHARED: tl.constexpr, USE_GDC: tl.constexpr = False):
    gdc_enter(USE_GDC)
    _sum_rows(y_ptr, ids_ptr, sh_ptr, out_ptr, tl.program_id(0) * BT + tl.arange(0, BT),
              tl.program_id(1) * BD + tl.arange(0, BD), T, D, E, stride_sh, TOPK, SHARED, False)


# ----------------------------------------------------------------------------- host side

def moe_config(T: int, k: int, E: int, I: int, D: int, n_sm: int) -> tuple[int, int]:
    """(BLOCK_M, K splits of the gate/up GEMM) from shapes only, so a captured graph stays valid."""
    n = T * k
    per = n / min(E, n)                                       # rows per touched expert (uniform routing)
    bm = next((c for c in BM_CHOICES if per <= c), BM_CHOICES[-1])
    progs = min(E, n) * math.ceil(per / bm) * (I // 64)
    kt = D // 128
    split = max(1, min(kt // 2, math.ceil(2 * n_sm / progs)))  # >= 2 waves, >= 2 k tiles per split
    return bm, split


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Split-K tickets, zero at rest (the kernel re-arms them); grown only outside graph capture."""
    return scratch("fused_moe.tickets", device, n, torch.int32, zero=True, min_numel=4096)


def takes_shared(T: int, w2: torch.Tensor) -> bool:
    """Does a step of T tokens hand the shared expert (w2 [D,IS]) to fused_moe (`shared_expert`)?"""
    return T <= min(SHARED_IN_DOWN_MAX_T, 64) and w2.shape[1] % 128 == 0


def _shared_args(shared_expert, T: int, D: int, dtype):
    """fused_moe's shared_expert -> (g, u, w2 [D,IS], IS, limit, fp8), checked."""
    g, u, w2, limit, fp8 = shared_expert
    IS = w2.shape[1]
    g, u = g.reshape(T, IS), u.reshape(T, IS)
    if g.stride(-1) != 1 or u.stride(-1) != 1:
        g, u = g.contiguous(), u.contiguous()
    if w2.shape != (D, IS) or w2.dtype != dtype or IS % 128 or T > 64:
        raise ValueError(f"shared_expert: need w2 [{D}, IS % 128 == 0] in {dtype} and at most 64 tokens, got "
                         f"{tuple(w2.shape)} {w2.dtype}, T = {T}")
    return g, u, w2.contiguous(), IS, limit if limit > 0 else float("inf"), fp8


def fused_moe(x, topk_weights, topk_ids, packed: PackedExperts, swiglu_limit: float = 0.0,
              block_m: int | None = None, split_k: int | None = None, use_asm: bool = True, shared=None,
              aligned=None, after=None, shared_expert=None):
    """x [T,D] bf16 (or fp32), topk_weights [T,k] fp32, topk_ids [T,k] int (ids outside [0,E)
    contribute nothing) -> sum_k w * expert(x) [T,D] fp32, plus `shared` [T,D] (the shared
    expert's output, any float dtype) when given. block_m/split_k override moe_config. aligned:
    moe_align's (sorted pair ids, block experts) of topk_ids at moe_config's BLOCK_M, when the
    router made them (router.route's `packed`), else sorted here. after: the stream `shared` is
    made on (beside the routed experts): the sum waits for it. shared_expert: instead of
    `shared`, (g, u [T,IS], w2 [D,IS] in x's dtype, limit, fp8) of the shared expert for the down
    kernel to finish (T <= 64): + w2 @ swiglu_act(g, u, limit, fp8) in x's dtype."""
    T, D = x.shape
    k, E, I = topk_ids.shape[1], packed.E, packed.I
    if D != packed.D or x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"x must be [T, {packed.D}] bf16/fp32, got {tuple(x.shape)} {x.dtype}")
    emu = interpreting()                              # CPU tests: plain ops, fp32 math
    bm, split = moe_config(T, k, E, I, D, num_sms(x.device, cpu=4))  # CPU: 4, so small tests split
    bm, split = block_m or bm, split_k or split
    kt_per = math.ceil((D // 128) / split)
    split = math.ceil((D // 128) / kt_per)
    mx, asm, f32 = packed.fmt == "mxfp4", use_asm and not emu, emu or x.dtype == torch.float32
    n = T * k
    sorted_ids, bexp = aligned if aligned is not None and not block_m else ma.moe_align(topk_ids, E, bm)
    nblk = bexp.numel()
    x = x.contiguous()
    h = torch.empty(nblk * bm, I, dtype=x.dtype, device=x.device)
    ws = torch.empty(nblk * (I // 64) * split * 128 * bm if split > 1 else 1, dtype=torch.float32, device=x.device)
    cnt = _counters(x.device, nblk * (I // 64))
    limit = swiglu_limit if swiglu_limit > 0 else float("inf")
    tw = topk_weights.reshape(-1).float().contiguous()
    _gate_up_kernel[(nblk, I // 64, split)](
        x, packed.w13, packed.s13, packed.alpha, sorted_ids, bexp, tw, h, ws, cnt,
        n, D, I, x.stride(0), limit, kt_per, TOPK=k, BM=bm, SPLIT=split, MX=mx, ASM=asm, F32=f32,
        num_warps=4, num_stages=3, **pdl_args())
    y = torch.empty(n, D, dtype=x.dtype if PAIR_ROWS_IN_MODEL_DTYPE else torch.float32, device=x.device)
    out = torch.empty(T, D, dtype=torch.float32, device=x.device)
    if after is not None:
        torch.cuda.current_stream(x.device).wait_stream(after)
    if shared_expert is not None:           # the down kernel's last program row makes it
        g, u, w2s, IS, slimit, sfp8 = _shared_args(shared_expert, T, D, x.dtype)
        sh = torch.empty(T, D, dtype=x.dtype, device=x.device)
    else:
        sh = shared.reshape(T, D) if shared is not None else out
        g = u = w2s = out
        IS, slimit, sfp8 = 0, 0.0, False
    if sh.stride(-1) != 1:
        sh = sh.contiguous()
    has_shared = shared is not None or shared_expert is not None
    ids = topk_ids.contiguous()
    fuse = T <= SUM_IN_DOWN_MAX_T
    tickets = scratch("fused_moe.sum_tickets", x.device, D // 128, torch.int32, zero=True) if fuse else cnt
    shx = int(shared_expert is not None)
    _down_kernel[(nblk + shx, D // 128)](h, packed.w2, packed.s2, packed.alpha, sorted_ids, bexp, y, n, D, I,
                                         ids, sh, out, tickets, T, E, sh.stride(0),
                                         g, u, w2s, IS, g.stride(0), u.stride(0), slimit,
                                         BM=bm, MX=mx, ASM=asm, F32=f32, SUM=fuse, TOPK=k, BT=4,
                                         SHARED=has_shared, SHX=shx, SH_FP8=sfp8,
                                         num_warps=4, num_stages=3, **pdl_args())
    if not fuse:
        _sum_kernel[(triton.cdiv(T, 4), triton.cdiv(D, 512))](y, ids, sh, out, T, D, E, sh.stride(0),
                                                              TOPK=k, BT=4, BD=512, SHARED=has_shared,
                                                              num_warps=4, **pdl_args())
    return out


def fused_moe_ref(x, topk_weights, topk_ids, packed: PackedExperts, swiglu_limit: float = 0.0, weights=None,
                  shared=None, after=None, shared_expert=None, **_):
    """experts_ref (the model's Experts.forward math) on the dequantized experts, in x's dtype; ids
    outside [0, E) count as weight 0; then + up(shared) when given. weights: dequant_experts(packed),
    if at hand (cached on CPU). after: the stream `shared` is made on: waited for first (fused_moe's
    contract: a step with the kernel off still runs the shared expert beside). shared_expert: (g,
    u, w2, limit, fp8), the shared expert's output made here as the model's step makes it apart."""
    if after is not None:
        torch.cuda.current_stream(x.device).wait_stream(after)
    if shared_expert is not None:      # swiglu.swiglu_act_ref's math, then w2
        g, u, w2, limit, fp8 = shared_expert
        a = swiglu(g, u, limit).to(x.dtype)
        shared = F.linear(fp8_sim_ref(a, 128) if fp8 else a, w2)
    if weights is None:
        weights = getattr(packed, "_dequant", None) or dequant_experts(packed)
        if not x.is_cuda:
            packed._dequant = weights         # the CPU model calls this every step
    w1, w3, w2 = (w.to(x.dtype) for w in weights)
    live = (topk_ids >= 0) & (topk_ids < packed.E)
    out = experts_ref(x, torch.where(live, topk_weights, 0.0), torch.where(live, topk_ids, 0), w1, w3, w2,
                      swiglu_limit)
    return out if shared is None else up(out) + up(shared)


# ----------------------------------------------------------------------------- torch math (the model's too)

def swiglu(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    """SwiGLU with the gate clamped above and the up projection clamped both ways at limit (0: none)."""
    g, u = up(g), up(u)
    if limit > 0:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return F.silu(g) * u


def _same(a: torch.Tensor) -> torch.Tensor:
    return a


def experts_ref(x, weights, idx, w1, w3, w2, limit: float, act_round=None) -> torch.Tensor:
    """Routed experts in torch: x [T,D], weights/idx [T,k], w1/w3 [E,I,D], w2 [E,D,I]
    -> sum_k w * expert_k(x) [T,D] fp32 (fp64 for an fp64 x). The model's Experts.forward.

    act_round: None, or the round trip applied to the experts' input and to the intermediate
    (reference numerics: FP8 per 128 channels; the caller picks kernel or torch for it).
    On CPU it loops over the experts that have tokens (host sync): the oracle, not the decode
    path. On CUDA it gathers (fewer pairs than experts) or runs every expert densely: fixed
    shapes, no host sync, so a CUDA graph can capture it."""
    rnd = act_round or _same
    if x.is_cuda:
        if idx.numel() < w1.shape[0]:
            return _experts_gathered(x, weights, idx, w1, w3, w2, limit, rnd)
        return _experts_dense(x, weights, idx, w1, w3, w2, limit, rnd)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=up_dtype(x.dtype), device=x.device)
    xs = rnd(x)
    flat = idx.flatten()
    order = flat.argsort()
    counts = torch.bincount(flat, minlength=w1.shape[0]).tolist()
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        sel = order[start:start + n]
        start += n
        tok = sel // idx.shape[1]
        xe = xs[tok]
        a = swiglu(F.linear(xe, w1[e]), F.linear(xe, w3[e]), limit)
        a = rnd((a * weights.flatten()[sel, None]).to(x.dtype))
        out.index_add_(0, tok, up(F.linear(a, w2[e])))
    return out


def _experts_gathered(x, weights, idx, w1, w3, w2, limit, rnd):
    """Small batches: gather the routed experts' weights per (token, slot) and batch the
    matmuls: reads only the experts touched, fixed shapes, no host sync."""
    T, k = idx.shape
    xs = rnd(x)[:, None, :, None].expand(T, k, -1, 1)                                    # [T,k,D,1]
    e = idx.flatten()
    g = (w1[e].unflatten(0, (T, k)) @ xs)[..., 0]                                        # [T,k,I]
    u = (w3[e].unflatten(0, (T, k)) @ xs)[..., 0]
    a = rnd((swiglu(g, u, limit) * weights[..., None]).to(x.dtype))
    y = (w2[e].unflatten(0, (T, k)) @ a[..., None])[..., 0]                              # [T,k,D]
    return up(y).sum(1)


def _experts_dense(x, weights, idx, w1, w3, w2, limit, rnd):
    """Every expert on every token, weighted 0 where not routed: fixed shapes, no host
    sync. Only for small models and tests; the fused MoE kernel is the real path."""
    E = w1.shape[0]
    dense = torch.zeros(x.shape[0], E, dtype=weights.dtype, device=x.device).scatter_add_(1, idx, weights)
    xs = rnd(x)
    a = swiglu(torch.einsum("td,eid->tei", xs, w1), torch.einsum("td,eid->tei", xs, w3), limit)
    a = rnd((a * dense[..., None]).to(x.dtype))
    return up(torch.einsum("tei,edi->td", a, w2))
