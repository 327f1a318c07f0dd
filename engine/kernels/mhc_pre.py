"""mHC pre after the mix projection, fused with the sub-layer's RMSNorm: one kernel, one pass.

Input is the mix GEMM's output (already times rsqrt(mean h^2), a separate kernel). Per token
the kernel derives pre/post/comb (Sinkhorn in registers), collapses the streams
x = sum_j pre_j h_j, rounds x to h's dtype (hc_pre hands it over in that dtype) and applies
the weighted RMSNorm (attn_norm / ffn_norm). Replaces the tail of engine.model.mhc.hc_pre
(about 20 Sinkhorn rounds of small torch ops, the collapse and a cast) plus RMSNorm.
"""
import torch
import triton
import triton.language as tl

from engine.numerics import up
from .common import gdc_enter, pdl_args, round_to
from .rms_norm import rms_norm_ref as rms_norm
from .sinkhorn import sinkhorn_ref as sinkhorn, sinkhorn_tile


@triton.jit
def _mhc_pre_kernel(mix_ptr, scale_ptr, base_ptr, h_ptr, w_ptr, y_ptr, post_ptr, comb_ptr,
                    D, stride_mt, stride_ht, stride_hj, stride_yt, hc_eps, norm_eps,
                    HC: tl.constexpr, ITERS: tl.constexpr, BLOCK_D: tl.constexpr, USE_GDC: tl.constexpr = False):
    gdc_enter(USE_GDC)
    t = tl.program_id(0)
    m = mix_ptr + t * stride_mt                          # mix row: pre [HC], post [HC], comb [HC*HC]
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    k = tl.arange(0, HC)
    post = 2 * tl.sigmoid(tl.load(m + HC + k) * s1 + tl.load(base_ptr + HC + k))
    tl.store(post_ptr + t * HC + k, post)
    jk = k[:, None] * HC + k[None, :]                                                     # [HC,HC]
    logits = tl.load(m + 2 * HC + jk) * s2 + tl.load(base_ptr + 2 * HC + jk)
    tl.store(comb_ptr + t * HC * HC + jk, sinkhorn_tile(logits, hc_eps, ITERS))

    d = tl.arange(0, BLOCK_D)
    dm = d < D
    x = tl.zeros([BLOCK_D], tl.float32)
    for j in tl.static_range(HC):
        # streams summed in order j = 0..hc-1, as torch's sum over the stream axis does
        pj = tl.sigmoid(tl.load(m + j) * s0 + tl.load(base_ptr + j)) + hc_eps
        hj = tl.load(h_ptr + t * stride_ht + j * stride_hj + d, mask=dm, other=0.0)
        x += pj * hj.to(tl.float32)
    x = round_to(x, h_ptr.dtype.element_ty)
    r = tl.math.rsqrt(tl.sum(x * x, axis=0) / D + norm_eps)
    w = tl.load(w_ptr + d, mask=dm, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * stride_yt + d, round_to(w * (x * r), y_ptr.dtype.element_ty), mask=dm)


def mhc_pre(mix: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, h: torch.Tensor,
            norm_weight: torch.Tensor, iters: int, hc_eps: float, norm_eps: float, out=None):
    """mix [...,(2+hc)*hc] fp32, scale [3], base [(2+hc)*hc], h [...,hc,D], norm_weight [D]
    -> y = RMSNorm(sum_j pre_j h_j) [...,D] (h dtype), post [...,hc] fp32, comb [...,hc,hc] fp32.

    `out` = (y, post, comb) preallocated (contiguous) to write into, e.g. inside a CUDA graph."""
    hc, D = h.shape[-2:]
    assert hc & (hc - 1) == 0 and mix.shape[-1] == (2 + hc) * hc
    lead = h.shape[:-2]
    h3 = h.reshape(-1, hc, D)
    T = h3.shape[0]
    m2 = mix.reshape(T, -1).float()
    assert h3.stride(-1) == 1 and m2.stride(-1) == 1
    if out is None:
        y = torch.empty(T, D, dtype=h.dtype, device=h.device)
        post = torch.empty(T, hc, dtype=torch.float32, device=h.device)
        comb = torch.empty(T, hc, hc, dtype=torch.float32, device=h.device)
    else:
        y, post, comb = out
        assert y.is_contiguous() and post.is_contiguous() and comb.is_contiguous()
    if T:
        block = triton.next_power_of_2(D)
        _mhc_pre_kernel[(T,)](m2, scale.float().contiguous(), base.float().contiguous(), h3,
                              norm_weight.contiguous(), y, post, comb, D, m2.stride(0),
                              h3.stride(0), h3.stride(1), D,
                              hc_eps, norm_eps, HC=hc, ITERS=iters, BLOCK_D=block,
                              num_warps=min(16, max(1, block // 512)), **pdl_args())
    if out is not None:
        return out
    return y.view(*lead, D), post.view(*lead, hc), comb.view(*lead, hc, hc)


def mhc_pre_ref(mix, scale, base, h, norm_weight, iters, hc_eps, norm_eps, out=None):
    """Torch reference: hc_pre's lines after its mix projection, then rms_norm (engine code)."""
    hc = h.shape[-2]
    pre = torch.sigmoid(mix[..., :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(mix[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = (mix[..., 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc))
    comb = sinkhorn(comb, iters, hc_eps)
    x = (pre[..., None] * up(h)).sum(-2).to(h.dtype)
    res = rms_norm(x, norm_weight, norm_eps), post, comb
    if out is None:
        return res
    for o, r in zip(out, res):
        o.copy_(r.reshape(o.shape))
    return out
