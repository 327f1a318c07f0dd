"""FP8 block-scaled GEMM: y[M, N] = x[M, K] @ W^T, W float8_e4m3fn [N, K] kept FP8 in HBM.

W carries one scale per 128x128 block ([ceil(N/128), K/128], E8M0 or fp32; spec §4.2). Two modes:
- act_quant=True, DeepSeek's numerics (spec §3.10): each x tile [BLOCK_M, 128] is quantised on the
  fly to e4m3 with a power-of-two scale per token and 128 channels (fp8_sim's rule), the dot runs
  fp8 x fp8 on the tensor cores, and each K-block's partial product is scaled by
  sa[m, kb] * sb[n // 128, kb] into an fp32 accumulator.
- act_quant=False (W8A16): x stays bf16, W tiles widen to bf16 in registers (exact), scale after the dot.
`groups` > 1 is a grouped GEMM (wo_a): x [M, groups*K], W [groups*Ng, K], group g of y reads
x[:, g*K:(g+1)*K] and W rows [g*Ng, (g+1)*Ng).

Small M (decode) leaves most SMs idle with one program per output tile, so the K blocks are split
over programs (split-K). Each split writes its fp32 partial to a fixed workspace and takes a ticket;
the tile's last split sums all partials in split order (deterministic) and stores y, then resets the
ticket. One launch, no allocation with a preallocated workspace, no host sync: CUDA-graph safe.
The split-K pieces (SplitKWorkspace, plan_split, the jit helpers) live in kernels/common.py.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine.numerics import fp8_block_dequant, fp8_sim_ref as fp8_sim
# The split-K pieces live in common (shared with bf16_gemm); re-exported for the tests and bench.
from .common import (gdc_enter, pdl_args, MAX_SPLIT, SplitKWorkspace, SplitPlan, get_workspace, interpreting,  # noqa: F401
                     num_sms, plan_split, round_to, splitk_arrive, splitk_reset, splitk_total)

QBLOCK = 128                      # weight scale block and activation quant block
_QB = tl.constexpr(QBLOCK)
_E8M0_MIN = tl.constexpr(2.0 ** -127)  # E8M0 byte 0: an fp32 subnormal the exponent-bits trick cannot build


# ----------------------------------------------------------------------------- activation quant

@triton.jit
def _round_e4m3(v):
    """fp32 v in [-448, 448] -> nearest e4m3 value (ties to even), as fp32. Only for the interpreter,
    whose fp32 -> fp8 cast rounds half up and mishandles carries; the GPU's cvt.rn is exact RNE."""
    a = tl.abs(v)
    b = a.to(tl.int32, bitcast=True)
    normal = ((b + 0x7FFFF + ((b >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)  # keep 3 bits
    sub = ((a * 512.0 + 8388608.0) - 8388608.0) * (1.0 / 512.0)   # below 2^-6: multiples of 2^-9, RNE
    r = tl.where(a < 0.015625, sub, normal)
    return tl.where(v < 0, -r, r)


@triton.jit
def quant_e4m3_rows(x, SW_ROUND: tl.constexpr):
    """x [BM, 128] fp32 -> (e4m3 [BM, 128], scale [BM] fp32) with scale 2^ceil(log2(max(amax,1e-4)/448)).

    ceil(log2(amax/448)) from amax's bits, no division: with amax = m * 2^E (m in [1, 2)) and
    448 = 1.75 * 2^8 it is E - 8, plus one when m > 1.75. fp32 rounding of amax/448 (the reference's
    frexp) never crosses a power of two here, so this is the reference's exponent exactly."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4)
    bits = amax.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)          # 2^-e: the divide is an exact multiply
    v = tl.minimum(tl.maximum(x * inv[:, None], -448.0), 448.0)
    if SW_ROUND:
        v = _round_e4m3(v)
    return v.to(tl.float8e4nv), ((127 + e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def load_block_scale(s_ptr, offs, mask, E8M0: tl.constexpr):
    """Weight block scales -> fp32: E8M0 bytes decode as 2^(b-127) by placing b in the exponent field."""
    if E8M0:
        b = tl.load(s_ptr + offs, mask=mask, other=127).to(tl.int32)
        return tl.where(b == 0, _E8M0_MIN, (b << 23).to(tl.float32, bitcast=True))
    return tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32)


# ----------------------------------------------------------------------------- kernel

@triton.jit
def _fp8_gemm_kernel(x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, ticket_ptr,
                     M, N, K, n_per_group, kb_per_split, n_split,
                     stride_xm, stride_wn, stride_sn, stride_ym,
                     ACT_QUANT: tl.constexpr, E8M0: tl.constexpr, SW_ROUND: tl.constexpr,
                     SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_GDC: tl.constexpr = False):
    # m fastest: the programs sharing one W tile run side by side and read it from L2
    gdc_enter(USE_GDC)
    pid_m, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, _QB)
    rm, cm = rows < M, cols < N
    g = (pid_n * BLOCK_N) // n_per_group                       # a tile never straddles two groups
    x_row = x_ptr + rows[:, None] * stride_xm + g * K          # [BM, 1]
    w_row = w_ptr + cols.to(tl.int64)[:, None] * stride_wn     # [BN, 1]
    s_row = (cols // _QB) * stride_sn                       # [BN] scale row of each column
    kb0 = pid_s * kb_per_split
    kb1 = tl.minimum(kb0 + kb_per_split, K // _QB)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(kb0, kb1):
        k = kb * _QB + kk
        x = tl.load(x_row + k[None, :], mask=rm[:, None], other=0.0)                   # [BM, 128]
        w = tl.load(w_row + k[None, :], mask=cm[:, None], other=0.0)                   # [BN, 128] e4m3
        sb = load_block_scale(s_ptr, s_row + kb, cm, E8M0)                             # [BN]
        if ACT_QUANT:
            xq, sa = quant_e4m3_rows(x.to(tl.float32), SW_ROUND)
            # a fresh dot per 128-K block: Hopper's fp8 MMA accumulates imprecisely, so the block's
            # sum is promoted to the fp32 accumulator every 128 (as DeepSeek's kernels do)
            acc += tl.dot(xq, tl.trans(w)) * (sa[:, None] * sb[None, :])
        elif x_ptr.dtype.element_ty == tl.float32:                                     # fp32 tests
            acc += tl.dot(x, tl.trans(w.to(tl.float32)), input_precision="ieee") * sb[None, :]
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype))) * sb[None, :]
    mask = rm[:, None] & cm[None, :]
    y_offs = rows[:, None] * stride_ym + cols[None, :]
    out_ty = y_ptr.dtype.element_ty
    if SPLIT:
        p_offs = rows[:, None] * N + cols[None, :]
        tp = ticket_ptr + pid_n * tl.num_programs(0) + pid_m
        if splitk_arrive(acc, part_ptr + pid_s * M * N, p_offs, mask, tp, n_split):
            acc = splitk_total(part_ptr, p_offs, mask, M * N, n_split)
            splitk_reset(tp)
            tl.store(y_ptr + y_offs, round_to(acc, out_ty).to(out_ty), mask=mask)
    else:
        tl.store(y_ptr + y_offs, round_to(acc, out_ty).to(out_ty), mask=mask)


# ----------------------------------------------------------------------------- host

@dataclass(frozen=True)
class Fp8Plan:
    block_m: int
    block_n: int
    split: SplitPlan
    grid: tuple
    num_warps: int
    num_stages: int


def fp8_gemm_plan(M, N, K, groups=1, device=None, split_k=None, block_m=None,
                  block_n=None, num_warps=None, num_stages=None) -> Fp8Plan:
    """Tile sizes and split count for y [M, groups*N] (N, K per group); the overrides are for tuning."""
    bm = block_m or min(128, max(16, triton.next_power_of_2(M)))
    bn = block_n or (64 if M <= 64 else 128)               # small M: more N tiles, fewer splits
    assert N % bn == 0 or groups == 1, "a grouped GEMM needs whole N tiles per group"
    n_tiles = triton.cdiv(groups * N, bn)
    tiles = triton.cdiv(M, bm) * n_tiles
    sp = plan_split(tiles, K // QBLOCK, num_sms(device), split_k)
    warps = num_warps or (8 if bm * bn >= 128 * 128 else 4)
    stages = num_stages or (3 if bm >= 128 else 4)
    return Fp8Plan(bm, bn, sp, (triton.cdiv(M, bm), n_tiles, sp.split), warps, stages)


def fp8_gemm_need(M, N, K, groups=1, device=None, **plan_kw):
    """(partial_numel, n_tickets) a SplitKWorkspace must hold for this GEMM."""
    p = fp8_gemm_plan(M, N, K, groups, device, **plan_kw)
    if p.split.split == 1:
        return 0, 0
    return p.split.split * M * groups * N, p.grid[0] * p.grid[1]


def _check_args(x, weight, scale, groups):
    NG, K = weight.shape
    assert weight.dtype == torch.float8_e4m3fn, weight.dtype
    assert K % QBLOCK == 0, f"K={K} must be a multiple of {QBLOCK}"
    assert x.shape[-1] == groups * K and NG % groups == 0, (tuple(x.shape), tuple(weight.shape), groups)
    assert tuple(scale.shape) == (triton.cdiv(NG, QBLOCK), K // QBLOCK), tuple(scale.shape)
    assert weight.stride(-1) == 1
    if scale.dtype == torch.float8_e8m0fnu:
        scale = scale.view(torch.uint8)
    assert scale.dtype in (torch.uint8, torch.float32), scale.dtype
    return scale.contiguous(), NG // groups, K


def fp8_gemm(x, weight, scale, act_quant=True, groups=1, out=None, out_dtype=torch.bfloat16,
             workspace=None, **plan_kw):
    """x [..., groups*K] (bf16/fp32), weight e4m3 [groups*N, K], scale [ceil(groups*N/128), K/128]
    (E8M0 as float8_e8m0fnu/uint8, or fp32) -> y [..., groups*N] in out_dtype (or into `out`).

    `workspace`: a SplitKWorkspace big enough for this shape (see fp8_gemm_need); without one a split-K
    plan allocates its own, which a CUDA graph must not do. plan_kw: fp8_gemm_plan's overrides."""
    scale, N, K = _check_args(x, weight, scale, groups)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, groups * K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    y = out if out is not None else torch.empty(*lead, groups * N, dtype=out_dtype, device=x.device)
    y2 = y.view(M, groups * N)
    if M == 0:
        return y
    p = fp8_gemm_plan(M, N, K, groups, x.device, **plan_kw)
    split = p.split.split > 1
    ws = get_workspace(workspace, *fp8_gemm_need(M, N, K, groups, x.device, **plan_kw), x.device) if split else None
    _fp8_gemm_kernel[p.grid](
        x2, weight, scale, y2, ws.partials if split else y2, ws.tickets if split else y2,
        M, groups * N, K, N, p.split.kb_per_split, p.split.split,
        x2.stride(0), weight.stride(0), scale.stride(0), y2.stride(0),
        ACT_QUANT=act_quant, E8M0=scale.dtype == torch.uint8, SW_ROUND=interpreting(), SPLIT=split,
        BLOCK_M=p.block_m, BLOCK_N=p.block_n, num_warps=p.num_warps, num_stages=p.num_stages, **pdl_args())
    return y


def fp8_gemm_ref(x, weight, scale, act_quant=True, groups=1, out=None, out_dtype=torch.bfloat16, **_):
    """Torch reference: dequantised W (formats.fp8_block_dequant), fp8_sim'd x when act_quant,
    F.linear per group in fp32, cast."""
    if scale.dtype == torch.float32:
        w = weight.float() * scale.repeat_interleave(QBLOCK, 0).repeat_interleave(QBLOCK, 1)[:weight.shape[0]]
    else:
        w = fp8_block_dequant(weight, scale)
    xs = fp8_sim(x, QBLOCK) if act_quant else x
    if groups == 1:
        y = F.linear(xs.float(), w)
    else:                                                                         # x [..., G, K]
        y = torch.einsum("...gk,gnk->...gn", xs.float().unflatten(-1, (groups, -1)),
                         w.unflatten(0, (groups, -1))).flatten(-2)
    y = y.to(out.dtype if out is not None else out_dtype)
    return out.copy_(y) if out is not None else y
