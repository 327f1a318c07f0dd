"""Sinkhorn normalisation of the mHC comb logits, one kernel ([T,hc,hc] -> doubly stochastic).

Row softmax, then column sums, then iters-1 rounds of row and column sums, each with +eps
in the denominator, exactly the order of sinkhorn_ref (the model's sinkhorn). The hc x hc matrix of a
token lives in registers for all rounds. `sinkhorn_tile` is shared with the fused mhc_pre.
"""
import torch
import triton
import triton.language as tl
from .common import gdc_enter, pdl_args



@triton.jit
def sinkhorn_tile(c, eps, ITERS: tl.constexpr):
    """c [..., hc(j), hc(k)] fp32 logits -> comb (rows sum over k, columns over j)."""
    c = tl.exp(c - tl.max(c, axis=-1, keep_dims=True))
    # IEEE divisions: `/` is div.full (approximate) on NVIDIA, and 20 rounds compound it
    c = tl.math.div_rn(c, tl.sum(c, axis=-1, keep_dims=True)) + eps
    c = tl.math.div_rn(c, tl.sum(c, axis=-2, keep_dims=True) + eps)
    for _ in range(ITERS - 1):
        c = tl.math.div_rn(c, tl.sum(c, axis=-1, keep_dims=True) + eps)
        c = tl.math.div_rn(c, tl.sum(c, axis=-2, keep_dims=True) + eps)
    return c


@triton.jit
def _sinkhorn_kernel(x_ptr, out_ptr, T, eps,
                     HC: tl.constexpr, ITERS: tl.constexpr, BLOCK_T: tl.constexpr, USE_GDC: tl.constexpr = False):
    gdc_enter(USE_GDC)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.arange(0, HC)
    off = t[:, None, None] * (HC * HC) + j[None, :, None] * HC + j[None, None, :]     # [BT,HC,HC]
    m = (t < T)[:, None, None]
    c = tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + off, sinkhorn_tile(c, eps, ITERS), mask=m)


def sinkhorn(logits: torch.Tensor, iters: int, eps: float, out: torch.Tensor | None = None,
             block_t: int = 16) -> torch.Tensor:
    """logits [..., hc, hc] -> doubly stochastic comb [..., hc, hc] fp32."""
    hc = logits.shape[-1]
    assert logits.shape[-2] == hc and hc & (hc - 1) == 0, "square, power-of-two hc"
    x = logits.reshape(-1, hc, hc).contiguous()
    T = x.shape[0]
    o = torch.empty(x.shape, dtype=torch.float32, device=x.device) if out is None else out
    assert o.is_contiguous() and o.dtype == torch.float32
    if T:
        _sinkhorn_kernel[(triton.cdiv(T, block_t),)](x, o, T, eps, HC=hc, ITERS=iters,
                                                      BLOCK_T=block_t, num_warps=1, **pdl_args())
    return o.view(logits.shape)


def sinkhorn_ref(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Torch reference, and the model's sinkhorn: [..., hc, hc] -> doubly stochastic: row softmax
    first, then alternate col/row sums."""
    c = logits.softmax(-1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return c
