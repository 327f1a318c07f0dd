"""Sparse flash-decode MQA: every query head against one shared K=V head, keys picked by index lists.
Decode rows and prefill chunks alike: each query row t (a token) has its own key lists.

o[t, h] = sum_j p_j k_j / (sum_j p_j + exp(sink[h] - m)),  p_j = exp(q[t, h] . k_j * scale - m),
over the keys j of two lists: idx_a[t] into kv_a (the sliding-window ring, flattened) and idx_b[t]
into kv_b (the compressed-entry pool, flattened); -1 = no key. V = K: the same row, all D channels.

One op, two launches (one when a single split suffices):
- _split_kernel, grid (head groups, T, splits): a program walks its share of the key tiles. Each
  [BLOCK_N, D] key tile is gathered through the index list ONCE and hits every head of the group as
  one tl.dot (scores [BLOCK_H, BLOCK_N]), then acc += P @ K (reading K once per head is the MQA
  mistake). Online softmax in base 2; the running max starts at the sink logit, so no lane ever sees
  -inf - -inf and an all-empty split is simply (m = sink, l = 0, acc = 0).
- _combine_kernel, grid (T, H, D chunks): merges the splits' (m, l, acc) by log-sum-exp and adds the
  sink mass exp(sink - M) to the denominator once.
Split-K exists for small T: at T=1 the (T x head groups) grid alone launches a handful of programs on
132 SMs. Shapes are fixed per batch bucket (T, Ka, Kb, splits are host ints; a cached workspace that
fits is reused) and nothing syncs with the host, so the pair is CUDA-graph safe given `out` and
`workspace`.

`rope` = (cos, sin) [T, R/2]: the output is also rotated back by RoPE's inverse on its last R
channels (the attention output's un-rotation, rope_q(o, inverse=True): o rounded to q's dtype, the
pairs rotated in fp32, rounded again) in the epilogue of whichever kernel stores o, not a launch of
its own.

Duplicated indices are not deduplicated: a key listed twice counts twice (the torch reference does
the same). The engine never sends duplicates: the window and the compressed entries are disjoint
stores and the indexer's top-k ids are distinct.
"""

import torch
import triton
import triton.language as tl

from engine.numerics import up
from .common import gdc_enter, pdl_args, num_sms, round_to
from .rope_kv import _rope
from .rope_q import rope_q, rope_q_ref

# Launch configuration, all in one place; bench/attention.py --sweep compares alternatives on the GPU.
# Picked offline from ptxas -v for sm_90a at D=512 (no GPU run yet): BLOCK_H 16 / BLOCK_N 32 / 4 warps
# uses 243-252 registers and 57 KiB of shared memory, no spills; BLOCK_H 32 / 8 warps 186-192
# registers, no spills. BLOCK_N 64, or 64 heads in one program (acc alone is 128 registers a thread
# at 8 warps), spill 0.4-2.5 KB a thread. So H=64 runs as two head groups of 32, adjacent in the grid
# so the second read of a key tile comes from L2.
BLOCK_N = 32               # keys per tile: a [32, 512] bf16 tile, 32 KiB of shared memory per stage
HEAD_TILE = 32             # most heads one program carries; more heads -> head groups
NUM_STAGES = 2             # software pipelining depth of the key gather
MIN_KEYS_PER_SPLIT = 32    # one key tile: bench/attention.py --sweep (H200, 2026-12-04, 8k, H 8, graph
                           # replay with the combine) T = 1: CSA 17.2 us at 128 (5 splits) -> 12.0 at 32
                           # (20), HCA 21.5 (1) -> 10.7 (6); T = 16 CSA 21.5 -> 17.8
MAX_SPLITS = 32            # bounds the workspace
PROGRAMS_PER_SM = 2        # split-K target: at least this many programs per SM
COMBINE_BLOCK_D = 128      # channels per combine program
NAIVE_BLOCK_N = 32
LOG2E = 1.4426950408889634


def _num_warps(block_h: int) -> int:
    # acc [BLOCK_H, 512] fp32 lives in registers: past 16 heads it needs 8 warps to hold it.
    return 4 if block_h <= 16 else 8


@triton.jit
def _mma(a, b):
    """a @ b, fp32 accumulation; fp32 operands (interpreter tests) stay fp32, not tf32."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _tile(q, m, l, acc, k_ptr, stride_k, i_ptr, start, K, offs_n, offs_d, d_mask, qk_scale):
    """One key tile of one list into the running (m [BH], l [BH], acc [BH, BD]) of all heads."""
    j = start + offs_n
    idx = tl.load(i_ptr + j, mask=j < K, other=-1).to(tl.int64)                     # [BN]
    valid = idx >= 0
    # Missing keys are never fetched: the masked lanes of the gather move no bytes.
    k = tl.load(k_ptr + idx[:, None] * stride_k + offs_d[None, :],
                mask=valid[:, None] & d_mask[None, :], other=0.0)                    # [BN, BD]
    s = _mma(q, tl.trans(k)) * qk_scale                                             # [BH, BN] log2 units
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    # P goes down to the value dtype before P @ V, as DeepSeek's reference kernel does.
    acc = acc * alpha[:, None] + _mma(p.to(k.dtype), k)
    return m_new, l, acc


@triton.jit
def _split_kernel(q_ptr, ka_ptr, ia_ptr, kb_ptr, ib_ptr, sink_ptr, o_ptr, acc_ptr, m_ptr, l_ptr, cos_ptr, sin_ptr,
                  H, D, Ka, Kb, tiles_per_split, qk_scale,
                  stride_qt, stride_qh, stride_ka, stride_ia, stride_kb, stride_ib, stride_ot, stride_oh,
                  stride_wt, stride_ws, stride_wh, stride_mt, stride_ms, stride_cs,
                  BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  FINAL: tl.constexpr, R: tl.constexpr, USE_GDC: tl.constexpr = False):
    # head group on the fastest grid axis: the groups of one (token, split) read the same keys
    gdc_enter(USE_GDC)
    offs_h = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    t = tl.program_id(1)
    split = tl.program_id(2)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    h_mask = offs_h < H
    d_mask = offs_d < D
    q = tl.load(q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)                   # [BH, BD]
    sink2 = tl.load(sink_ptr + offs_h, mask=h_mask, other=0.0) * 1.4426950408889634
    m = tl.maximum(sink2, -1e30)        # the sink bounds the max from below; -1e30 keeps a -inf sink finite
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    # Tiles are numbered over list a, then list b; a split owns a contiguous run. Two loops rather
    # than a per-tile branch, so each loop body is one clean pipelining candidate.
    na = tl.cdiv(Ka, BLOCK_N)
    lo = split * tiles_per_split
    hi = tl.minimum(lo + tiles_per_split, na + tl.cdiv(Kb, BLOCK_N))
    for i in range(lo, tl.minimum(hi, na)):
        m, l, acc = _tile(q, m, l, acc, ka_ptr, stride_ka, ia_ptr + t * stride_ia, i * BLOCK_N, Ka,
                          offs_n, offs_d, d_mask, qk_scale)
    for i in range(tl.maximum(lo, na), hi):
        m, l, acc = _tile(q, m, l, acc, kb_ptr, stride_kb, ib_ptr + t * stride_ib, (i - na) * BLOCK_N, Kb,
                          offs_n, offs_d, d_mask, qk_scale)
    hd_mask = h_mask[:, None] & d_mask[None, :]
    if FINAL:   # a single split: normalise here and skip the combine launch
        o = acc / (l + tl.exp2(sink2 - m))[:, None]
        if R > 0:   # the inverse RoPE on the rounded output (BLOCK_D == D here)
            p = tl.arange(0, BLOCK_D // 2) - (BLOCK_D - R) // 2
            cos = tl.load(cos_ptr + t * stride_cs + p, mask=p >= 0, other=1.0)
            sin = tl.load(sin_ptr + t * stride_cs + p, mask=p >= 0, other=0.0)
            o = _rope(round_to(o, o_ptr.dtype.element_ty), cos, -sin, BLOCK_H, BLOCK_D, R)
        tl.store(o_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
                 round_to(o, o_ptr.dtype.element_ty).to(o_ptr.dtype.element_ty), mask=hd_mask)
    else:
        w = t * stride_wt + split * stride_ws
        tl.store(acc_ptr + w + offs_h[:, None] * stride_wh + offs_d[None, :], acc, mask=hd_mask)
        mo = t * stride_mt + split * stride_ms + offs_h
        tl.store(m_ptr + mo, m, mask=h_mask)
        tl.store(l_ptr + mo, l, mask=h_mask)


@triton.jit
def _combine_kernel(acc_ptr, m_ptr, l_ptr, sink_ptr, o_ptr, cos_ptr, sin_ptr, S, D,
                    stride_wt, stride_ws, stride_wh, stride_mt, stride_ms, stride_ot, stride_oh, stride_cs,
                    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, R: tl.constexpr, USE_GDC: tl.constexpr = False):
    gdc_enter(USE_GDC)
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    s_mask = offs_s < S
    d_mask = offs_d < D
    mo = t * stride_mt + offs_s * stride_ms + h
    m = tl.load(m_ptr + mo, mask=s_mask, other=float("-inf"))                      # [BS] log2 units
    l = tl.load(l_ptr + mo, mask=s_mask, other=0.0)
    sink2 = tl.load(sink_ptr + h) * 1.4426950408889634
    big = tl.maximum(tl.max(m, axis=0), tl.maximum(sink2, -1e30))
    w = tl.exp2(m - big)                                                             # [BS], 0 on padding
    denom = tl.sum(l * w, axis=0) + tl.exp2(sink2 - big)
    part = tl.load(acc_ptr + t * stride_wt + offs_s[:, None] * stride_ws + h * stride_wh + offs_d[None, :],
                   mask=s_mask[:, None] & d_mask[None, :], other=0.0)               # [BS, BD]
    o = tl.sum(part * w[:, None], axis=0) / denom
    if R > 0:   # the inverse RoPE on the rounded output: this chunk's pairs (BLOCK_D even) of the last R channels
        a, b = tl.split(tl.reshape(round_to(o, o_ptr.dtype.element_ty), (BLOCK_D // 2, 2)))
        p = (tl.program_id(2) * BLOCK_D) // 2 + tl.arange(0, BLOCK_D // 2) - (D - R) // 2
        cos = tl.load(cos_ptr + t * stride_cs + p, mask=p >= 0, other=1.0)
        sin = -tl.load(sin_ptr + t * stride_cs + p, mask=p >= 0, other=0.0)
        o = tl.reshape(tl.join(tl.where(p >= 0, a * cos - b * sin, a), tl.where(p >= 0, b * cos + a * sin, b)),
                       (BLOCK_D,))
    tl.store(o_ptr + t * stride_ot + h * stride_oh + offs_d, round_to(o, o_ptr.dtype.element_ty).to(
        o_ptr.dtype.element_ty), mask=d_mask)


class Workspace:
    """Split partials for one batch bucket: acc [T, S, H, D], m and l [T, S, H], all fp32.

    Allocated once per (T bucket, H, D, max splits) and shared by every layer (they run in sequence
    on one stream), so a captured graph always sees the same buffers. The cache only grows: a graph
    holds no reference to the buffers it was captured with, so none may ever be freed. Allocate
    (first call per bucket) outside capture, e.g. in the runner's eager warm-up."""
    _cache: dict = {}

    def __init__(self, T: int, H: int, D: int, max_splits: int, device):
        self.acc = torch.empty(T, max_splits, H, D, dtype=torch.float32, device=device)
        self.m = torch.empty(T, max_splits, H, dtype=torch.float32, device=device)
        self.l = torch.empty_like(self.m)

    @classmethod
    def get(cls, T: int, H: int, D: int, max_splits: int, device) -> "Workspace":
        """The smallest cached workspace that fits, else a new one for T rounded up to a power of
        two: prefill chunks come in every length, and each must not keep a workspace of its own."""
        device = torch.device(device)
        fitting = [w for (t, h, d, s, dev), w in cls._cache.items()
                   if dev == device and w.fits(T, H, D, max_splits)]
        if fitting:
            return min(fitting, key=lambda w: w.acc.numel())
        t = triton.next_power_of_2(T)
        key = (t, H, D, max_splits, device)
        cls._cache[key] = cls(t, H, D, max_splits, device)
        return cls._cache[key]

    def fits(self, T: int, H: int, D: int, splits: int) -> bool:
        t, s, h, d = self.acc.shape
        return T <= t and splits <= s and H == h and D == d


def sm_count(device: torch.device) -> int:
    """common.num_sms; the interpreter (CPU tensors) pretends a few SMs so the split path is exercised."""
    return num_sms(device, cpu=4)


def head_tiling(H: int) -> tuple[int, int]:
    """-> (BLOCK_H, head groups): tl.dot needs M >= 16, so a few heads are padded to 16."""
    groups = triton.cdiv(H, HEAD_TILE)
    return max(16, triton.next_power_of_2(triton.cdiv(H, groups))), groups


def choose_num_splits(T: int, K: int, sm_count: int, head_groups: int = 1) -> int:
    """Splits of the combined key list (K = Ka + Kb keys) so that T * head_groups * splits fills the
    GPU (PROGRAMS_PER_SM per SM), each split keeps >= MIN_KEYS_PER_SPLIT keys, at most MAX_SPLITS.
    Pure host arithmetic on bucket constants: the same bucket always gets the same count."""
    want = triton.cdiv(PROGRAMS_PER_SM * sm_count, max(1, T * head_groups))
    return _no_empty_splits(max(1, min(want, K // MIN_KEYS_PER_SPLIT, MAX_SPLITS)), triton.cdiv(K, BLOCK_N))


def _no_empty_splits(splits: int, tiles: int) -> int:
    """Fewest splits with the same tiles per split: no split is left without tiles."""
    tiles = max(1, tiles)
    return triton.cdiv(tiles, triton.cdiv(tiles, max(1, splits)))


def _flat_lists(q, kv_a, idx_a, kv_b, idx_b):
    T, H, D = q.shape
    assert q.stride(-1) == 1 and kv_a.stride(-1) == 1 and idx_a.stride(-1) == 1
    assert kv_a.dtype == q.dtype and kv_a.shape[1] == D and idx_a.shape[0] == T
    if kv_b is None or idx_b is None or idx_b.shape[1] == 0:
        return kv_a, idx_a, 0                     # list b empty: never read, any valid pointer does
    assert kv_b.stride(-1) == 1 and idx_b.stride(-1) == 1 and kv_b.dtype == q.dtype and kv_b.shape[1] == D
    return kv_b, idx_b, idx_b.shape[1]


def sparse_mqa(q, kv_a, idx_a, kv_b, idx_b, sink, scale: float, num_splits: int | None = None,
               out=None, workspace: Workspace | None = None, rope=None) -> torch.Tensor:
    """q [T,H,D], kv_a [Na,D], idx_a [T,Ka], kv_b [Nb,D] | None, idx_b [T,Kb] | None (int32/int64,
    -1 = none), sink [H] fp32 -> o [T,H,D] in q's dtype (into `out` when given). rope = (cos, sin)
    [T,R/2] fp32: o rotated back by RoPE's inverse on its last R channels (in the epilogue where D is
    a power of two from 64, else by rope_q after). No allocation and no host sync when `out` and a fitting
    `workspace` are passed (or a single split is used)."""
    T, H, D = q.shape
    if rope is not None and max(64, triton.next_power_of_2(D)) != D:    # the epilogues rotate whole rows
        o = sparse_mqa(q, kv_a, idx_a, kv_b, idx_b, sink, scale, num_splits, out, workspace)
        return o.copy_(rope_q(o, *rope, inverse=True))
    R = 0 if rope is None else 2 * rope[0].shape[-1]
    cos, sin = (rope[0].reshape(T, -1).float().contiguous(), rope[1].reshape(T, -1).float().contiguous()) \
        if rope is not None else (sink, sink)
    assert T < 65536, f"{T} query rows: the grid's y axis holds 65535 (prefill in smaller chunks)"
    kv_b, idx_b, Kb = _flat_lists(q, kv_a, idx_a, kv_b, idx_b)
    Ka = idx_a.shape[1]
    block_h, groups = head_tiling(H)
    if num_splits is None:
        num_splits = choose_num_splits(T, Ka + Kb, sm_count(q.device), groups)
    tiles = triton.cdiv(Ka, BLOCK_N) + triton.cdiv(Kb, BLOCK_N)      # tiles never straddle the lists
    splits = _no_empty_splits(num_splits, tiles)
    out = torch.empty_like(q) if out is None else out
    assert out.shape == q.shape and out.stride(-1) == 1 and sink.dtype == torch.float32
    ws = None
    if splits > 1:
        ws = workspace if workspace is not None else Workspace.get(T, H, D, splits, q.device)
        assert ws.fits(T, H, D, splits), "workspace too small for this bucket"
        acc, m, l = ws.acc, ws.m, ws.l
        w_strides = (acc.stride(0), acc.stride(1), acc.stride(2), m.stride(0), m.stride(1))
    else:                                        # FINAL: the kernel normalises, no partials
        acc, m, l, w_strides = out, sink, sink, (0, 0, 0, 0, 0)
    _split_kernel[(groups, T, splits)](
        q, kv_a, idx_a, kv_b, idx_b, sink, out, acc, m, l, cos, sin,
        H, D, Ka, Kb, triton.cdiv(max(tiles, 1), splits), scale * LOG2E,
        q.stride(0), q.stride(1), kv_a.stride(0), idx_a.stride(0), kv_b.stride(0), idx_b.stride(0),
        out.stride(0), out.stride(1), *w_strides, cos.stride(0),
        BLOCK_H=block_h, BLOCK_N=BLOCK_N, BLOCK_D=max(64, triton.next_power_of_2(D)), FINAL=ws is None, R=R,
        num_warps=_num_warps(block_h), num_stages=NUM_STAGES, **pdl_args())
    if ws is not None:
        block_d = min(COMBINE_BLOCK_D, D) if R else COMBINE_BLOCK_D
        _combine_kernel[(T, H, triton.cdiv(D, block_d))](
            ws.acc, ws.m, ws.l, sink, out, cos, sin, splits, D,
            ws.acc.stride(0), ws.acc.stride(1), ws.acc.stride(2), ws.m.stride(0), ws.m.stride(1),
            out.stride(0), out.stride(1), cos.stride(0),
            BLOCK_S=max(2, triton.next_power_of_2(splits)), BLOCK_D=block_d, R=R, num_warps=4, **pdl_args())
    return out


# ---------------------------------------------------------------------------------------------------
# Naive baseline, for the benchmark only: one program per (token, head), so every key is re-read
# once per head and the products run on SIMT lanes (the per-head kernel of the campaign write-up).

@triton.jit
def _naive_list(q, m, l, acc, k_ptr, stride_k, i_ptr, n_tiles, K, offs_n, offs_d, d_mask, qk_scale,
                BLOCK_N: tl.constexpr):
    for i in range(0, n_tiles):
        j = i * BLOCK_N + offs_n
        idx = tl.load(i_ptr + j, mask=j < K, other=-1).to(tl.int64)
        valid = idx >= 0
        k = tl.load(k_ptr + idx[:, None] * stride_k + offs_d[None, :],
                    mask=valid[:, None] & d_mask[None, :], other=0.0)                # [BN, BD]
        s = tl.sum(q[None, :] * k.to(tl.float32), axis=1) * qk_scale                # [BN]
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new)
        l = l * alpha + tl.sum(p, axis=0)
        pv = p.to(k.dtype).to(tl.float32)
        acc = acc * alpha + tl.sum(pv[:, None] * k.to(tl.float32), axis=0)
        m = m_new
    return m, l, acc


@triton.jit
def _naive_kernel(q_ptr, ka_ptr, ia_ptr, kb_ptr, ib_ptr, sink_ptr, o_ptr, D, Ka, Kb, na, nb, qk_scale,
                  stride_qt, stride_qh, stride_ka, stride_ia, stride_kb, stride_ib, stride_ot, stride_oh,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, USE_GDC: tl.constexpr = False):
    gdc_enter(USE_GDC)
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < D
    q = tl.load(q_ptr + t * stride_qt + h * stride_qh + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    sink2 = tl.load(sink_ptr + h) * 1.4426950408889634
    m = tl.maximum(sink2, -1e30)
    l = 0.0 * sink2
    acc = tl.zeros([BLOCK_D], tl.float32)
    m, l, acc = _naive_list(q, m, l, acc, ka_ptr, stride_ka, ia_ptr + t * stride_ia, na, Ka,
                            offs_n, offs_d, d_mask, qk_scale, BLOCK_N)
    m, l, acc = _naive_list(q, m, l, acc, kb_ptr, stride_kb, ib_ptr + t * stride_ib, nb, Kb,
                            offs_n, offs_d, d_mask, qk_scale, BLOCK_N)
    o = acc / (l + tl.exp2(sink2 - m))
    tl.store(o_ptr + t * stride_ot + h * stride_oh + offs_d, o.to(o_ptr.dtype.element_ty), mask=d_mask)


def sparse_mqa_naive(q, kv_a, idx_a, kv_b, idx_b, sink, scale: float, out=None) -> torch.Tensor:
    """Same contract as sparse_mqa (no split-K): the baseline the benchmark compares against."""
    T, H, D = q.shape
    kv_b, idx_b, Kb = _flat_lists(q, kv_a, idx_a, kv_b, idx_b)
    Ka = idx_a.shape[1]
    out = torch.empty_like(q) if out is None else out
    _naive_kernel[(T, H)](q, kv_a, idx_a, kv_b, idx_b, sink, out, D, Ka, Kb,
                          triton.cdiv(Ka, NAIVE_BLOCK_N), triton.cdiv(Kb, NAIVE_BLOCK_N), scale * LOG2E,
                          q.stride(0), q.stride(1), kv_a.stride(0), idx_a.stride(0), kv_b.stride(0),
                          idx_b.stride(0), out.stride(0), out.stride(1),
                          BLOCK_N=NAIVE_BLOCK_N, BLOCK_D=triton.next_power_of_2(D), num_warps=4, **pdl_args())
    return out


# ---------------------------------------------------------------------------------------------------
# Torch reference: gather, then attend(), which is also the model's attention math
# (engine.model.attention imports attend and gather_attend from here).

def attend(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
           scale: float) -> torch.Tensor:
    """Torch reference. q [B,S,H,D], gathered keys (= values) [B,S,K,D], valid [B,S,K], sink [H]
    -> o [B,S,H,D]: softmax over the valid keys plus a value-less sink logit per head."""
    s = torch.einsum("bshd,bskd->bshk", up(q), up(keys)) * scale
    s = s.masked_fill(~valid[:, :, None, :], float("-inf"))
    m = torch.maximum(s.amax(-1), up(sink))                                          # [B,S,H]
    p = torch.exp(s - m[..., None])
    denom = p.sum(-1) + torch.exp(up(sink) - m)
    o = torch.einsum("bshk,bskd->bshd", p, up(keys)) / denom[..., None]
    return o.to(q.dtype)


def gather_attend(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """q [B,S,H,D] against kv [B,N,D] at indices idx [B,S,K] (-1 = none) -> o [B,S,H,D]
    (the model's whole-sequence sparse attention, engine.model.attention.sparse_attn)."""
    B = q.shape[0]
    keys = kv[torch.arange(B, device=kv.device)[:, None, None], idx.clamp(min=0)]      # [B,S,K,D]
    return attend(q, keys, idx >= 0, sink, scale)


def gather_keys(kv_a, idx_a, kv_b, idx_b):
    """-> keys [T, Ka+Kb, D], valid [T, Ka+Kb]: the rows the kernel reads, zeros where -1."""
    keys, valid = [kv_a[idx_a.long().clamp(min=0)]], [idx_a >= 0]
    if kv_b is not None and idx_b is not None and idx_b.shape[1]:
        keys.append(kv_b[idx_b.long().clamp(min=0)])
        valid.append(idx_b >= 0)
    return torch.cat(keys, dim=1), torch.cat(valid, dim=1)


def sparse_mqa_ref(q, kv_a, idx_a, kv_b, idx_b, sink, scale: float, rope=None) -> torch.Tensor:
    """Same contract as sparse_mqa, computed by attend() (fp32 softmax and products), then
    rope_q_ref's inverse rotation when rope is given."""
    keys, valid = gather_keys(kv_a, idx_a, kv_b, idx_b)
    o = attend(q[:, None], keys[:, None], valid[:, None], sink, scale)[:, 0]
    return o if rope is None else rope_q_ref(o, *(c.reshape(q.shape[0], -1) for c in rope), inverse=True)


def attention_bytes(T: int, H: int, D: int, n_keys: int, elt: int = 2) -> int:
    """HBM bytes an ideal kernel moves: q and o once, each key row once per token (no reuse across
    tokens: their lists differ), the int32 index lists."""
    return T * (2 * H * D * elt + n_keys * (D * elt + 4))


def attention_flops(T: int, H: int, D: int, n_keys: int) -> int:
    """Useful FLOPs (no head padding): QK^T and PV, 2 * D each per (token, head, key)."""
    return 4 * T * H * D * n_keys


__all__ = ["sparse_mqa", "sparse_mqa_ref", "attend", "gather_attend", "sparse_mqa_naive", "choose_num_splits", "Workspace",
           "head_tiling", "gather_keys", "attention_bytes", "attention_flops"]
