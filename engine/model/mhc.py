"""mHC: manifold-constrained hyper-connections over `hc` residual streams.

hc_pre collapses the streams into one sub-layer input and derives the post and comb
weights; hc_post expands the sub-layer output back and mixes the residual through the
Sinkhorn-normalised (doubly stochastic) comb matrix. All coefficient math is fp32.
The mix projection, Sinkhorn and hc_post math live beside their kernels (engine.kernels.*_ref).
"""
import torch

from ..kernels.bf16_gemm import mhc_mix_ref as _mix
from ..kernels.mhc_post import mhc_post_ref as hc_post  # noqa: F401 (hc_post: f, res, post, comb)
from ..kernels.sinkhorn import sinkhorn_ref as sinkhorn
from ..numerics import up


def hc_pre(h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
           iters: int, eps: float, norm_eps: float):
    """h [B,S,hc,D] -> x [B,S,D] (h's dtype), post [B,S,hc], comb [B,S,hc,hc] (fp32)."""
    hc = h.shape[-2]
    mix = _mix(h, fn, norm_eps=norm_eps)
    pre = torch.sigmoid(mix[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mix[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = (mix[..., 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc))
    comb = sinkhorn(comb, iters, eps)
    x = (pre[..., None] * up(h)).sum(-2).to(h.dtype)
    return x, post, comb


def hc_head(h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
            eps: float, norm_eps: float) -> torch.Tensor:
    """Final collapse of the streams (no Sinkhorn, no post): [B,S,hc,D] -> [B,S,D]."""
    pre = torch.sigmoid(_mix(h, fn, norm_eps=norm_eps) * scale + base) + eps
    return (pre[..., None] * up(h)).sum(-2).to(h.dtype)
