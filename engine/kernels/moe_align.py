"""The fused MoE's pair sort: the T*k (token, slot) pairs grouped by expert, each group padded to
BLOCK_M rows, for fused_moe's gate_up and down kernels (their blocks of routed rows).

moe_align (one program, the sort in registers: histogram, cumsum, a stable key sort, one scatter)
or, past ALIGN_MAX pairs, moe_align_ref (torch, fixed shapes, no host sync). align_pairs is the
sort as a jit function, which the router's last program also runs (router.py) so that decode
steps need no launch for it. Sizes come from align_bounds, so every grid is fixed per (T, k, E).
"""
import functools

import torch
import triton
import triton.language as tl

from .common import gdc_enter, pdl_args

ALIGN_MAX = 4096             # pairs the one-program align kernel sorts in registers; more -> torch


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, bexp_ptr, N, E, P_MAX, B_MAX,
                  BM: tl.constexpr, NP: tl.constexpr, EP: tl.constexpr, USE_GDC: tl.constexpr = False):
    gdc_enter(USE_GDC)
    align_pairs(ids_ptr, sorted_ptr, bexp_ptr, N, E, P_MAX, B_MAX, BM, NP, EP, False)


@triton.jit
def align_pairs(ids_ptr, sorted_ptr, bexp_ptr, N, E, P_MAX, B_MAX,
                BM: tl.constexpr, NP: tl.constexpr, EP: tl.constexpr, CG: tl.constexpr):
    """One program: the N (token, slot) pairs' expert ids -> sorted pair ids, one expert per block
    (moe_align_ref). CG: the ids read past L1 (other programs of this launch wrote them: the
    router's last program, router.py)."""
    offs = tl.arange(0, NP)
    if CG:
        e = tl.load(ids_ptr + offs, mask=offs < N, other=-1, cache_modifier=".cg").to(tl.int32)
    else:
        e = tl.load(ids_ptr + offs, mask=offs < N, other=-1).to(tl.int32)
    e = tl.where((e >= 0) & (e < E), e, E)                    # invalid ids and padding: bucket E
    cnt = tl.histogram(e, EP)
    eix = tl.arange(0, EP)
    padded = tl.where(eix < E, (cnt + BM - 1) // BM * BM, 0)
    pstart = tl.cumsum(padded, 0) - padded
    cstart = tl.cumsum(cnt, 0) - cnt
    key = tl.sort(e * NP + offs)                              # by expert, then pair: stable
    se = key // NP
    rank = offs - tl.gather(cstart, se, 0)                    # position inside the expert's group
    dest = tl.gather(pstart, se, 0) + rank
    ok = se < E
    for i in range(0, tl.cdiv(P_MAX, NP)):
        o = i * NP + offs
        tl.store(sorted_ptr + o, tl.full([NP], N, tl.int32), mask=o < P_MAX)   # padding rows: sentinel N
    for i in range(0, tl.cdiv(B_MAX, NP)):
        o = i * NP + offs
        tl.store(bexp_ptr + o, tl.full([NP], -1, tl.int32), mask=o < B_MAX)
    tl.debug_barrier()                                        # the fills land before the scatter
    tl.store(sorted_ptr + dest, key % NP, mask=ok)
    tl.store(bexp_ptr + dest // BM, se, mask=ok & (rank % BM == 0))


def align_bounds(n_pairs: int, E: int, bm: int) -> tuple[int, int]:
    """(padded rows, blocks) upper bounds: at most min(E, pairs) experts each waste < bm rows."""
    b = (n_pairs + min(E, n_pairs) * (bm - 1)) // bm
    return b * bm, b


def moe_align_ref(topk_ids: torch.Tensor, E: int, bm: int):
    """Torch version of _align_kernel (fixed shapes, no host sync): (sorted [P] int32, bexp [B] int32).
    Few launches (prefill steps of more than ALIGN_MAX pairs run it in every layer): a stable sort
    by expert, the groups' bounds by searchsorted, one scatter of the pairs, each block's expert
    by searchsorted."""
    flat = topk_ids.reshape(-1).long()
    N, dev = flat.numel(), flat.device
    P, B = align_bounds(N, E, bm)
    e = torch.where((flat >= 0) & (flat < E), flat, E)             # invalid ids: bucket E, dropped
    se, order = torch.sort(e, stable=True)                          # by expert, then pair
    starts = torch.searchsorted(se, _arange(E + 2, dev))            # [E+2]: each bucket's first sorted pair
    cnt = starts.diff()                                             # [E+1]
    padded = (cnt + bm - 1) // bm * bm
    ends = padded.cumsum(0)                                         # [E+1]: each group's end among the rows
    rank = _arange(N, dev) - starts[se]                # position inside the expert's group
    dest = torch.where(se < E, (ends - padded)[se] + rank, P)
    sorted_ids = torch.full((P + 1,), N, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    v = torch.searchsorted(ends[:E], _arange(B, dev) * bm, right=True)      # [B]: the group a block starts in
    bexp = torch.where(v < E, v, -1).to(torch.int32)
    return sorted_ids[:P], bexp


@functools.lru_cache(maxsize=16)
def _arange(n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, device=device)


def moe_align(topk_ids: torch.Tensor, E: int, bm: int):
    N = topk_ids.numel()
    if N > ALIGN_MAX:
        return moe_align_ref(topk_ids, E, bm)
    P, B = align_bounds(N, E, bm)
    sorted_ids = torch.empty(P, dtype=torch.int32, device=topk_ids.device)
    bexp = torch.empty(B, dtype=torch.int32, device=topk_ids.device)
    NP = max(16, triton.next_power_of_2(N))
    _align_kernel[(1,)](topk_ids.reshape(-1), sorted_ids, bexp, N, E, P, B, BM=bm, NP=NP,
                        EP=triton.next_power_of_2(E + 1), num_warps=8, **pdl_args())
    return sorted_ids, bexp
