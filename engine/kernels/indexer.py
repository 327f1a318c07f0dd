"""Lightning indexer: score every visible compressed entry, keep the top-k (one query row per token:
decode rows and prefill chunks alike).

scores[t, s] = sum_h w[t, h] * relu(q[t, h] . K[s]) for s < max_entries, -inf for s >= n_visible[t];
the top-k entries become ids (-1 where none) and the flat store rows the sparse attention reads,
loc = block_table[t, id // per_block] * per_block + id % per_block.

One op, two launches (one for rows up to TOPK_IN_SCORE_MAX_ROW, off by default):
- _score_kernel, one program per (row, run of key tiles): the [H, d] query tile is loaded once and
  reused over the run; each [BLOCK_N, d] key tile is gathered through the block table once for all
  heads and hits the tensor cores as one tl.dot (reading K once per head is the MQA mistake).
- the top-k of a row (_select), in the row's last score program to finish (a ticket per row, as
  split-K's tickets: store, barrier, acq_rel atomic), or in _topk_kernel, one program per row,
  for wide rows (more warps hold them): radix select of the k-th largest score over the row held
  in registers (32 counting passes), then a cumsum compaction, so ids come out in ascending order (the
  attention gathers in memory order) with their store rows beside them.
Shapes are fixed per bucket (T, max_entries, topk are host ints) and nothing syncs with the host,
so the op is CUDA-graph safe with the preallocated outputs and score buffer.
"""
import torch
import triton
import triton.language as tl

from engine.numerics import up
from .common import gdc_enter, pdl_args, entry_loc, num_sms, scratch

BLOCK_N = 64                 # keys per tile: the M of the [BLOCK_N, d] x [d, H] dot
RUN_TILES = 16               # most key tiles one score program walks
TOPK_MAX_ROW = 16384         # widest score row the register-resident top-k takes; wider -> torch.topk
# widest row whose top-k the last score program makes (its 4 warps hold the row: 32 keys a thread
# at 4096); wider rows take _topk_kernel's launch. 0 (the default): always two launches, since one
# measured slower in the 43-layer step (H100, 2026-12-06, bench/RESULTS.md: +0.014 ms at C = 1,
# +0.17 at C = 64, for 21 launches fewer); bench/levers.py's topk_in_score turns it on at 4096
TOPK_IN_SCORE_MAX_ROW = 0


@triton.jit
def _score_kernel(q_ptr, w_ptr, k_ptr, bt_ptr, nv_ptr, s_ptr, tk_ptr, ids_ptr, loc_ptr,
                  H, D, N, K, per_block, max_blocks, tiles_per_prog, w_scale,
                  stride_qt, stride_qh, stride_wt, stride_kr, stride_bt, stride_st, stride_it, stride_lt,
                  BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                  TOPK: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr,
                  USE_GDC: tl.constexpr = False):
    gdc_enter(USE_GDC)
    t = tl.program_id(0)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    hd_mask = (offs_h[:, None] < H) & (offs_d[None, :] < D)
    q = tl.load(q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=hd_mask, other=0.0)                                            # [BH, BD]
    w = tl.load(w_ptr + t * stride_wt + offs_h, mask=offs_h < H, other=0.0).to(tl.float32) * w_scale  # [BH]
    nv = tl.minimum(tl.load(nv_ptr + t), N)
    first = tl.program_id(1) * tiles_per_prog
    last = tl.minimum(first + tiles_per_prog, tl.cdiv(N, BLOCK_N))
    # Tiles past the row's visible entries need no keys and no math: split the run in two loops
    # rather than branch inside one, so the live loop stays a clean pipelining candidate.
    live = tl.maximum(tl.minimum(last, tl.cdiv(nv, BLOCK_N)), first)
    for i in range(first, live):
        s = i * BLOCK_N + offs_n
        vis = s < nv
        blk = tl.minimum(s // per_block, max_blocks - 1)
        phys = tl.load(bt_ptr + t * stride_bt + blk, mask=vis, other=0).to(tl.int64)
        rows = phys * per_block + s % per_block                                      # [BN] store rows
        k = tl.load(k_ptr + rows[:, None] * stride_kr + offs_d[None, :],
                    mask=vis[:, None] & (offs_d[None, :] < D), other=0.0)           # [BN, BD]
        # Keys on the M side, heads on N: the head reduction then stays inside each warp.
        logits = tl.dot(k, tl.trans(q))                                              # [BN, BH] fp32
        score = tl.sum(tl.maximum(logits, 0.0) * w[None, :], axis=1)                 # [BN]
        tl.store(s_ptr + t * stride_st + s, tl.where(vis, score, float("-inf")), mask=s < N)
    for i in range(live, last):
        s = i * BLOCK_N + offs_n
        tl.store(s_ptr + t * stride_st + s, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=s < N)
    if TOPK:    # the row's last program to finish selects (its ticket left at zero for the next launch)
        tl.debug_barrier()                             # every thread's scores are out before the release
        if tl.atomic_add(tk_ptr + t, 1, sem="acq_rel", scope="gpu") == tl.num_programs(1) - 1:
            tl.store(tk_ptr + t, 0)
            tl.debug_barrier()
            _select(s_ptr + t * stride_st, bt_ptr + t * stride_bt, nv, ids_ptr + t * stride_it,
                    loc_ptr + t * stride_lt, K, per_block, max_blocks, BLOCK_S, BLOCK_K)


@triton.jit
def _order_key(x):
    """fp32 -> uint32 whose unsigned order is the float order (negatives flipped, sign bit set on the rest)."""
    bits = (x + 0.0).to(tl.uint32, bitcast=True)                # -0.0 + 0.0 = +0.0: the zeros tie, as they compare
    return tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)


@triton.jit
def _kth_key(key, valid, k):
    """The k-th largest of the valid keys (uint32; 0xFFFFFFFF when k = 0), built bit by bit from the
    top: keep a bit when at least k keys reach it (one block-wide count a bit). Fixing 8 bits a
    pass instead (four tl.histogram passes of 256 bins) measured slower: bench/RESULTS.md."""
    thr = tl.zeros([], tl.uint32)
    bit = tl.full([], 0x80000000, tl.uint32)
    for _ in range(32):
        cand = thr | bit
        cnt = tl.sum((valid & (key >= cand)).to(tl.int32), axis=0)
        thr = tl.where(cnt >= k, cand, thr)
        bit = bit >> 1
    return thr


@triton.jit
def _select(s_row, bt_row, nv, ids_row, loc_row, K, per_block, max_blocks,
            BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr):
    """One row: its top min(K, nv) scores' ids (ascending) and store rows; -1 in the rest of K."""
    offs = tl.arange(0, BLOCK_S)
    valid = offs < nv
    # .cg: read at L2, where the row's other score programs' stores landed (the fused path)
    key = _order_key(tl.load(s_row + offs, mask=valid, other=float("-inf"), cache_modifier=".cg"))
    k = tl.minimum(K, nv)
    thr = _kth_key(key, valid, k)
    above = valid & (key > thr)
    tie = valid & (key == thr)
    # Ties at the threshold: the lowest ids fill what is left of k (torch.topk picks any).
    room = k - tl.sum(above.to(tl.int32), axis=0)
    take = above | (tie & (tl.cumsum(tie.to(tl.int32), axis=0) <= room))
    slot = tl.cumsum(take.to(tl.int32), axis=0) - 1
    blk = tl.minimum(offs // per_block, max_blocks - 1)
    phys = tl.load(bt_row + blk, mask=take, other=0).to(tl.int64)
    tl.store(ids_row + slot, offs, mask=take)
    tl.store(loc_row + slot, phys * per_block + offs % per_block, mask=take)
    rest = tl.arange(0, BLOCK_K)
    none = (rest >= k) & (rest < K)
    tl.store(ids_row + rest, tl.full([BLOCK_K], -1, tl.int32), mask=none)
    tl.store(loc_row + rest, tl.full([BLOCK_K], -1, tl.int32), mask=none)


@triton.jit
def _topk_kernel(s_ptr, bt_ptr, nv_ptr, ids_ptr, loc_ptr, N, K, per_block, max_blocks,
                 stride_st, stride_bt, stride_it, stride_lt,
                 BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr = False):
    gdc_enter(USE_GDC)
    t = tl.program_id(0)
    nv = tl.minimum(tl.load(nv_ptr + t), N)
    _select(s_ptr + t * stride_st, bt_ptr + t * stride_bt, nv, ids_ptr + t * stride_it, loc_ptr + t * stride_lt,
            K, per_block, max_blocks, BLOCK_S, BLOCK_K)


def indexer_scores(q, w, idx_k_store, block_table, per_block: int, n_visible, max_entries: int,
                   out=None, n_split: int | None = None, w_scale: float = 1.0) -> torch.Tensor:
    """q [T,H,d] bf16, w [T,H] (any float dtype; the head weights are w * w_scale in fp32),
    idx_k_store [rows,d] bf16, block_table [T,max_blocks] int, n_visible [T] int -> scores
    [T, max_entries] fp32 (written into out when given)."""
    return _scores(q, w, idx_k_store, block_table, per_block, n_visible, max_entries, out, n_split, w_scale)


def _scores(q, w, idx_k_store, block_table, per_block, n_visible, max_entries, out, n_split, w_scale, select=None):
    """indexer_scores; select = (ids, loc, topk): the last score program of each row also writes
    its top-k into ids and loc (_select)."""
    T, H, D = q.shape
    assert q.dtype in (torch.bfloat16, torch.float16) and idx_k_store.dtype == q.dtype
    assert q.stride(-1) == 1 and idx_k_store.stride(-1) == 1 and w.stride(-1) == 1 and block_table.stride(-1) == 1
    out = torch.empty(T, max_entries, dtype=torch.float32, device=q.device) if out is None else out
    n_tiles = triton.cdiv(max_entries, BLOCK_N)
    if n_split is None:
        # At least ~4 programs per SM, and runs of at most RUN_TILES tiles so the last wave is short;
        # each run loads its q tile once.
        n_split = min(n_tiles, max(triton.cdiv(4 * num_sms(q.device, cpu=4), T), triton.cdiv(n_tiles, RUN_TILES)))
    per_prog = triton.cdiv(n_tiles, n_split)
    grid = (T, triton.cdiv(n_tiles, per_prog))
    ids, loc, topk = select if select is not None else (out, out, 1)
    tickets = scratch("indexer.tickets", q.device, T, torch.int32, zero=True) if select is not None else out
    _score_kernel[grid](q, w, idx_k_store, block_table, n_visible, out, tickets, ids, loc,
                        H, D, max_entries, topk, per_block, block_table.shape[1], per_prog, w_scale,
                        q.stride(0), q.stride(1), w.stride(0), idx_k_store.stride(0),
                        block_table.stride(0), out.stride(0), ids.stride(0), loc.stride(0),
                        BLOCK_H=max(16, triton.next_power_of_2(H)), BLOCK_D=max(16, triton.next_power_of_2(D)),
                        BLOCK_N=BLOCK_N, TOPK=select is not None,
                        BLOCK_S=triton.next_power_of_2(max_entries) if select is not None else 16,
                        BLOCK_K=triton.next_power_of_2(topk) if select is not None else 16, num_warps=4, num_stages=3,
                        **pdl_args())
    return out


def _topk_torch(scores, block_table, per_block, n_visible, topk, ids, loc):
    """Fallback for rows too wide for the register top-k: torch.topk, then the same mapping."""
    k = min(topk, scores.shape[1])
    idx = scores.topk(k, dim=-1, sorted=False).indices                              # [T,k] int64
    keep = idx < n_visible[:, None]
    e = torch.where(keep, idx, 0)
    rows = block_table.gather(1, (e // per_block).clamp(max=block_table.shape[1] - 1)) * per_block + e % per_block
    ids[:, :k].copy_(torch.where(keep, idx, -1))
    loc[:, :k].copy_(torch.where(keep, rows, -1))
    ids[:, k:].fill_(-1)
    loc[:, k:].fill_(-1)


def indexer_topk(q, w, idx_k_store, block_table, per_block: int, n_visible, topk: int, max_entries: int,
                 out_ids=None, out_loc=None, score_buf=None, n_split: int | None = None, w_scale: float = 1.0):
    """-> ids [T, topk] int32 (entry ids, -1 where none; order unspecified: ascending from the Triton
    top-k), loc [T, topk] int32 (flat rows of idx_k_store's pool, -1 where none)."""
    T = q.shape[0]
    assert idx_k_store.shape[0] < 2 ** 31, "loc is int32"
    ids = torch.empty(T, topk, dtype=torch.int32, device=q.device) if out_ids is None else out_ids
    loc = torch.empty(T, topk, dtype=torch.int32, device=q.device) if out_loc is None else out_loc
    width = triton.next_power_of_2(max_entries)
    if width <= TOPK_IN_SCORE_MAX_ROW:     # one launch: the scores' last program per row selects
        _scores(q, w, idx_k_store, block_table, per_block, n_visible, max_entries, score_buf, n_split, w_scale,
                select=(ids, loc, topk))
        return ids, loc
    scores = _scores(q, w, idx_k_store, block_table, per_block, n_visible, max_entries, score_buf, n_split, w_scale)
    if width > TOPK_MAX_ROW:
        _topk_torch(scores, block_table, per_block, n_visible, topk, ids, loc)
        return ids, loc
    _topk_kernel[(T,)](scores, block_table, n_visible, ids, loc, max_entries, topk, per_block, block_table.shape[1],
                       scores.stride(0), block_table.stride(0), ids.stride(0), loc.stride(0),
                       BLOCK_S=width, BLOCK_K=triton.next_power_of_2(topk),
                       num_warps=max(1, min(16, width // 512)), **pdl_args())
    return ids, loc


# ---------------------------------------------------------------------------------------------------
# Torch reference: the indexer math, which the model's Indexer.scores / Indexer.select also call.

def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [B,S,H,d], w [B,S,H], keys [B,N,d] -> [B,S,N] fp32: sum_h w * relu(q . k)."""
    s = torch.einsum("bshd,bnd->bshn", up(q), up(keys)).relu()
    return (s * w[..., None]).sum(dim=2)


def index_select(scores: torch.Tensor, positions: torch.Tensor, ratio: int, topk: int) -> torch.Tensor:
    """Causal top-k: scores [B,S,N], positions [S] or [B,S] -> entry ids [B,S,k], -1 where none;
    entries s < (position + 1) // ratio are visible."""
    n = scores.shape[-1]
    k = min(topk, n)
    visible = ((positions + 1) // ratio)[..., None]                    # entries s < visible[t]
    future = torch.arange(n, device=scores.device) >= visible          # [(B,)S,N]
    idx = scores.masked_fill(future, float("-inf")).topk(k, dim=-1).indices
    return torch.where(idx < visible, idx, -1)


def indexer_scores_ref(q, w, idx_k_store, block_table, per_block: int, n_visible, max_entries: int,
                       w_scale: float = 1.0):
    """-> scores [T, max_entries] fp32, -inf where s >= n_visible[t]."""
    T = q.shape[0]
    w = up(w) * w_scale
    ent = torch.arange(max_entries, device=q.device).expand(T, max_entries)
    keys = idx_k_store[entry_loc(block_table.long(), per_block, ent, 1)]            # [T,N,d]
    s = index_scores(q[:, None], w[:, None], keys)[:, 0]                             # [T,N]
    return s.masked_fill(ent >= n_visible[:, None], float("-inf"))


def indexer_topk_ref(q, w, idx_k_store, block_table, per_block: int, n_visible, topk: int, max_entries: int,
                     w_scale: float = 1.0):
    """-> ids [T, topk] int64 (score order, -1 where none), loc [T, topk] int64, scores [T, max_entries]."""
    scores = indexer_scores_ref(q, w, idx_k_store, block_table, per_block, n_visible, max_entries, w_scale)
    # index_select reads entries s < (position + 1) // ratio as visible: ratio 1, position n_visible - 1.
    sel = index_select(scores[:, None], (n_visible.long() - 1)[:, None], 1, topk)[:, 0]
    ids = torch.full((q.shape[0], topk), -1, dtype=torch.long, device=q.device)
    ids[:, :sel.shape[1]] = sel
    loc = entry_loc(block_table.long(), per_block, ids.clamp(min=0), 1)
    return ids, torch.where(ids >= 0, loc, -1), scores
