"""MoE router after the gate GEMM, one kernel: scores, top-k (or hash ids), gather, renormalise.

scores = sqrt(softplus(logits)); experts = top-k of scores + bias (the bias steers selection
only), or tid2eid[token_id] in hash layers; weights = the chosen scores / their sum *
route_scale. Replaces the tail of engine.model.moe.Gate.forward (softplus, sqrt, add, topk,
gather, sum, divide, multiply). One program per token holds all E scores in registers and
takes the top k by k rounds of argmax.

Ties: among equal (score + bias) values the lowest expert id is taken first (tl.argmax keeps
the first maximum). torch.topk does not promise an order among ties, so the two agree on
distinct values only.
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine.numerics import up
from .common import gdc_enter, pdl_args


@triton.jit
def _log1p(u):
    # log(1 + u) without cancellation for small u (Goldberg): exact where 1 + u rounds to 1
    v = 1.0 + u
    return tl.where(v == 1.0, u, tl.log(v) * (u / (v - 1.0)))


@triton.jit
def _router_kernel(logits_ptr, bias_ptr, tid_ptr, tok_ptr, w_ptr, id_ptr, E, stride_lt,
                   stride_tid, route_scale,
                   K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                   HASH: tl.constexpr, RENORM: tl.constexpr, USE_GDC: tl.constexpr = False):
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


def route(logits: torch.Tensor, k: int, route_scale: float, bias: torch.Tensor | None = None,
          tid2eid: torch.Tensor | None = None, token_ids: torch.Tensor | None = None,
          renorm: bool = True, ids_dtype: torch.dtype = torch.int64):
    """logits [T,E] fp32 (gate GEMM output) -> weights [T,k] fp32, expert ids [T,k] (ids_dtype).

    Score layers pass bias [E]; hash layers pass tid2eid [V,k] and token_ids [T] instead."""
    T, E = logits.shape
    hashed = tid2eid is not None
    assert hashed != (bias is not None), "either bias (top-k) or tid2eid + token_ids (hash)"
    lg = logits.float()
    assert lg.stride(-1) == 1
    w = torch.empty(T, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, k, dtype=ids_dtype, device=logits.device)
    if T:
        dummy = w
        _router_kernel[(T,)](
            lg, bias.float().contiguous() if not hashed else dummy,
            tid2eid if hashed else ids, token_ids.contiguous() if hashed else ids, w, ids, E,
            lg.stride(0), tid2eid.stride(0) if hashed else 0, route_scale,
            K=k, BLOCK_E=triton.next_power_of_2(E), BLOCK_K=triton.next_power_of_2(k),
            HASH=hashed, RENORM=renorm, num_warps=4 if E >= 128 else 1, **pdl_args())
    return w, ids


def route_ref(logits, k, route_scale, bias=None, tid2eid=None, token_ids=None, renorm=True,
              ids_dtype=torch.int64):
    """Torch reference: Gate.forward's lines after its GEMM (sqrtsoftplus scoring; the tests
    check it against Gate itself)."""
    scores = F.softplus(up(logits)).sqrt()
    if tid2eid is not None:
        idx = tid2eid[token_ids]
    else:
        idx = (scores + bias).topk(k, dim=-1).indices
    w = scores.gather(-1, idx)
    if renorm:
        w = w / w.sum(-1, keepdim=True)
    return w * route_scale, idx.to(ids_dtype)
