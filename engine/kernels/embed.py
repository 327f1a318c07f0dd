"""The token embedding, vocab-parallel, written straight into the hc residual streams: one launch.

A rank holds rows [lo, lo + V) of the table; a token outside them looks up zeros (the all-reduce
after it sums the ranks' rows into the embedding), and each row is stored `hc` times, once per
residual stream mHC starts from. Torch spends eight small launches on this at decode (the
offset, two compares, an and, a clamp, the gather, the mask's multiply, then the streams' copy:
Embedding.forward and the step's expand), ~1-4 us each; here one program per (token, channel
block) loads the row once and stores its copies.
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .common import gdc_enter, pdl_args

# False: the torch ops (bench/levers.py's lever)
EMBED_KERNEL = True
BLOCK_D = 1024         # channels a program copies: 4096 / 1024 = 4 programs a token


@triton.jit
def _embed_kernel(ids_ptr, w_ptr, out_ptr, lo, V, D, stride_w,
                  HC: tl.constexpr, BLOCK_D: tl.constexpr, USE_GDC: tl.constexpr = False):
    gdc_enter(USE_GDC)
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = offs < D
    local = tl.load(ids_ptr + t).to(tl.int64) - lo
    mine = (local >= 0) & (local < V)
    row = tl.load(w_ptr + local * stride_w + offs, mask=dm & mine, other=0.0)        # [BLOCK_D]; 0 if not ours
    for s in tl.static_range(HC):
        tl.store(out_ptr + (t * HC + s) * D + offs, row, mask=dm)


def embed(ids: torch.Tensor, weight: torch.Tensor, lo: int = 0, hc: int = 1) -> torch.Tensor:
    """ids [...] (int), weight [V, D] this rank's rows [lo, lo + V) -> [..., hc, D] in weight's
    dtype: weight[id - lo] in every one of the hc copies, zeros for ids outside the rank's rows."""
    if not EMBED_KERNEL:
        return embed_ref(ids, weight, lo, hc)
    V, D = weight.shape
    assert weight.stride(-1) == 1
    ids1 = ids.reshape(-1)
    out = torch.empty(*ids.shape, hc, D, dtype=weight.dtype, device=weight.device)
    if ids1.numel():
        _embed_kernel[(ids1.numel(), triton.cdiv(D, BLOCK_D))](
            ids1, weight, out, lo, V, D, weight.stride(0), HC=hc, BLOCK_D=min(BLOCK_D, triton.next_power_of_2(D)),
            num_warps=4, **pdl_args())
    return out


def embed_ref(ids: torch.Tensor, weight: torch.Tensor, lo: int = 0, hc: int = 1) -> torch.Tensor:
    """Torch reference: model.linear.Embedding's lookup (before its all-reduce), expanded to hc copies."""
    V = weight.shape[0]
    local = ids - lo
    mine = (local >= 0) & (local < V)
    e = F.embedding(local.clamp(0, V - 1), weight) * mine[..., None]
    return e[..., None, :].expand(*e.shape[:-1], hc, e.shape[-1]).contiguous()
