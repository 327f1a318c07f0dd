"""MoE router after the gate GEMM, one kernel: scores, top-k (or hash ids), gather, renormalise;
for the fused MoE also its pair sort (fused_moe's align, in the last program to finish).

scores = sqrt(softplus(logits)); experts = top-k of scores + bias (the bias steers selection
only), or tid2eid[token_id] in hash layers; weights = the chosen scores / their sum *
route_scale. Replaces the tail of engine.model.moe.Gate.forward (softplus, sqrt, add, topk,
gather, sum, divide, multiply). One program per token holds all E scores in registers and
takes the top k by k rounds of argmax.

One-token steps (decode at batch 1) sort their k pairs in the same program from the ids in
registers: nothing to wait for, and with k <= BLOCK_M every expert's group is one block.

Ties: among equal (score + bias) values the lowest expert id is taken first (tl.argmax keeps
the first maximum). torch.topk does not promise an order among ties, so the two agree on
distinct values only.
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine.numerics import up
from .common import gdc_enter, pdl_args, scratch
from .fused_moe import align_plan
from .moe_align import align_pairs, moe_align_ref

# One-token steps sort their k pairs from the ids in registers (_align_one), no ticket or generic
# sort; False: the generic path (bench/decode.py's lever).
ONE_TOKEN_SORT = True


@triton.jit
def _log1p(u):
    # log(1 + u) without cancellation for small u (Goldberg): exact where 1 + u rounds to 1
    v = 1.0 + u
    return tl.where(v == 1.0, u, tl.log(v) * (u / (v - 1.0)))


@triton.jit
def _router_kernel(logits_ptr, bias_ptr, tid_ptr, tok_ptr, w_ptr, id_ptr, E, stride_lt,
                   stride_tid, route_scale, sorted_ptr, bexp_ptr, cnt_ptr, N, P_MAX, B_MAX,
                   K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                   HASH: tl.constexpr, RENORM: tl.constexpr, ALIGN: tl.constexpr = False, BM: tl.constexpr = 16,
                   NP: tl.constexpr = 16, EP: tl.constexpr = 16, ONE: tl.constexpr = False,
                   USE_GDC: tl.constexpr = False):
    gdc_enter(USE_GDC)
    t = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    em = e < E
    x = tl.load(logits_ptr + t * stride_lt + e, mask=em, other=0.0)                    # [BE]
    # torch's softplus: x above its threshold 20, else log1p(exp(x))
    s = tl.math.sqrt_rn(tl.where(x > 20.0, x, _log1p(tl.exp(x))))
    kk = tl.arange(0, BLOCK_K)
    if HASH:
        ids = tl.load(tid_ptr + tl.load(tok_ptr + t) * stride_tid + kk, mask=kk < K, other=0)
        ids = ids.to(tl.int32)
    else:
        sel = tl.where(em, s + tl.load(bias_ptr + e, mask=em, other=0.0), float("-inf"))
        ids = tl.zeros([BLOCK_K], tl.int32)
        for i in tl.static_range(K):
            best = tl.argmax(sel, axis=0).to(tl.int32)
            ids = tl.where(kk == i, best, ids)
            sel = tl.where(e == best, float("-inf"), sel)
    hit = (e[None, :] == ids[:, None]) & (kk < K)[:, None]                               # [BK,BE]
    w = tl.sum(tl.where(hit, s[None, :], 0.0), axis=1)                                   # [BK]
    if RENORM:
        w = tl.math.div_rn(w, tl.sum(w, axis=0))
    km = kk < K
    tl.store(w_ptr + t * K + kk, w * route_scale, mask=km)
    tl.store(id_ptr + t * K + kk, ids.to(id_ptr.dtype.element_ty), mask=km)
    if ALIGN and ONE:
        _align_one(ids, kk, K, E, N, P_MAX, B_MAX, sorted_ptr, bexp_ptr, BM, BLOCK_K)
    elif ALIGN:
        # the last token's program to take the ticket sorts every pair for the fused MoE (its
        # align kernel's work, no launch of its own)
        tl.debug_barrier()                                    # every thread's ids precede the ticket
        if tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
            align_pairs(id_ptr, sorted_ptr, bexp_ptr, N, E, P_MAX, B_MAX, BM, NP, EP, True)
            tl.store(cnt_ptr, 0)                              # re-armed for the next call / replay


@triton.jit
def _align_one(ids, kk, K, E, N, P_MAX, B_MAX, sorted_ptr, bexp_ptr, BM: tl.constexpr, BLOCK_K: tl.constexpr):
    """align_pairs for one token's K <= BM pairs, from its ids in registers (no ticket, no reload,
    no histogram or sort): every expert's group fits one block, so pair i goes to row
    BM * (distinct experts below its own) + (earlier pairs of its expert), as moe_align_ref puts it."""
    key = tl.where((kk < K) & (ids >= 0) & (ids < E), ids, E)                          # [BK]; E: not placed
    ki, kj = key[:, None], key[None, :]
    ii, jj = kk[:, None], kk[None, :]
    within = tl.sum(((kj == ki) & (jj < ii)).to(tl.int32), axis=1)                    # rank in its group
    first = within == 0
    below = tl.sum((first[None, :] & (kj < ki)).to(tl.int32), axis=1)                 # distinct experts below
    placed = key < E
    dest = below * BM + within
    r = tl.arange(0, BLOCK_K * BM)                                                    # >= P_MAX rows
    hit = (r[:, None] == dest[None, :]) & placed[None, :]
    pair = tl.sum(tl.where(hit, jj, 0), axis=1)
    tl.store(sorted_ptr + r, tl.where(tl.sum(hit.to(tl.int32), axis=1) > 0, pair, N), mask=r < P_MAX)
    b = kk                                                                            # >= B_MAX blocks
    bh = (b[:, None] == below[None, :]) & (placed & first)[None, :]
    e = tl.sum(tl.where(bh, kj, 0), axis=1)
    tl.store(bexp_ptr + b, tl.where(tl.sum(bh.to(tl.int32), axis=1) > 0, e, -1), mask=b < B_MAX)


def route(logits: torch.Tensor, k: int, route_scale: float, bias: torch.Tensor | None = None,
          tid2eid: torch.Tensor | None = None, token_ids: torch.Tensor | None = None,
          renorm: bool = True, ids_dtype: torch.dtype = torch.int64, packed=None):
    """logits [T,E] fp32 (gate GEMM output) -> weights [T,k] fp32, expert ids [T,k] (ids_dtype).

    Score layers pass bias [E]; hash layers pass tid2eid [V,k] and token_ids [T] instead. packed:
    the fused MoE's experts (fused_moe.PackedExperts, its E the router's) that take these ids:
    the same launch then also sorts the pairs for them -> (weights, ids, fused_moe's `aligned`,
    or None where the one-program sort does not take T * k pairs)."""
    T, E = logits.shape
    hashed = tid2eid is not None
    assert hashed != (bias is not None), "either bias (top-k) or tid2eid + token_ids (hash)"
    assert packed is None or packed.E == E, "the experts' ids are the router's"
    lg = logits.float()
    assert lg.stride(-1) == 1
    w = torch.empty(T, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, k, dtype=ids_dtype, device=logits.device)
    plan = align_plan(T, k, packed, logits.device) if packed is not None and T else None
    aligned = None
    if plan is not None:
        bm, P, B, NP, EP = plan
        aligned = (torch.empty(P, dtype=torch.int32, device=logits.device),
                   torch.empty(B, dtype=torch.int32, device=logits.device))
        one = T == 1 and k <= bm and ONE_TOKEN_SORT
        align_kw = dict(ALIGN=True, BM=bm, NP=NP, EP=EP, ONE=one)
        cnt = scratch("router.align_ticket", logits.device, 1, torch.int32, zero=True) if not one else w
    else:
        P = B = 0
        align_kw, cnt = {}, w
    if T:
        dummy = w
        _router_kernel[(T,)](
            lg, bias.float().contiguous() if not hashed else dummy,
            tid2eid if hashed else ids, token_ids.contiguous() if hashed else ids, w, ids, E,
            lg.stride(0), tid2eid.stride(0) if hashed else 0, route_scale,
            *(aligned or (ids, ids)), cnt, T * k, P, B,
            K=k, BLOCK_E=triton.next_power_of_2(E), BLOCK_K=triton.next_power_of_2(k),
            HASH=hashed, RENORM=renorm, **align_kw, num_warps=4 if E >= 128 else 1, **pdl_args())
    return (w, ids) if packed is None else (w, ids, aligned)


def route_ref(logits, k, route_scale, bias=None, tid2eid=None, token_ids=None, renorm=True,
              ids_dtype=torch.int64, packed=None):
    """Torch reference: Gate.forward's lines after its GEMM (sqrtsoftplus scoring; the tests
    check it against Gate itself); with `packed` also the pairs sorted (moe_align_ref)."""
    scores = F.softplus(up(logits)).sqrt()
    if tid2eid is not None:
        idx = tid2eid[token_ids]
    else:
        idx = (scores + bias).topk(k, dim=-1).indices
    w = scores.gather(-1, idx)
    if renorm:
        w = w / w.sum(-1, keepdim=True)
    w, idx = w * route_scale, idx.to(ids_dtype)
    if packed is None:
        return w, idx
    plan = align_plan(idx.shape[0], k, packed, idx.device) if idx.shape[0] else None
    return w, idx, moe_align_ref(idx, packed.E, plan[0]) if plan is not None else None
