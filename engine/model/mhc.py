"""mHC: manifold-constrained hyper-connections over `hc` residual streams.

hc_pre collapses the streams into one sub-layer input and derives the post and comb
weights; hc_post expands the sub-layer output back and mixes the residual through the
Sinkhorn-normalised (doubly stochastic) comb matrix. All coefficient math is fp32.
"""
import torch
from .precision import up


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """[..., hc, hc] -> doubly stochastic: row softmax first, then alternate col/row sums."""
    c = logits.softmax(-1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return c


def _mix(h: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    # fn applied to the unweighted-RMS-normalised flat streams: [B,S,hc*D] -> [B,S,mix]
    xf = up(h.flatten(-2))
    return xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps) @ fn.to(xf.dtype).t()


def hc_pre(h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
           iters: int, eps: float, norm_eps: float):
    """h [B,S,hc,D] -> x [B,S,D] (h's dtype), post [B,S,hc], comb [B,S,hc,hc] (fp32)."""
    hc = h.shape[-2]
    mix = _mix(h, fn, norm_eps)
    pre = torch.sigmoid(mix[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mix[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = (mix[..., 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc))
    comb = sinkhorn(comb, iters, eps)
    x = (pre[..., None] * up(h)).sum(-2).to(h.dtype)
    return x, post, comb


def hc_post(f: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """out[k] = post[k] * f + sum_j comb[j, k] * res[j]  ->  [B,S,hc,D]."""
    out = post[..., None] * up(f)[..., None, :] + comb.transpose(-1, -2) @ up(res)
    return out.to(res.dtype)


def hc_head(h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
            eps: float, norm_eps: float) -> torch.Tensor:
    """Final collapse of the streams (no Sinkhorn, no post): [B,S,hc,D] -> [B,S,D]."""
    pre = torch.sigmoid(_mix(h, fn, norm_eps) * scale + base) + eps
    return (pre[..., None] * up(h)).sum(-2).to(h.dtype)
