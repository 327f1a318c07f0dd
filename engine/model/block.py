"""One decoder block: attention and MoE, each wrapped in mHC over the residual streams."""
import torch
from torch import nn

from ..kernels import runs_kernel
from .attention import Attention
from .config import ModelConfig
from .mhc import hc_post, hc_pre
from .moe import MoE
from .norm import RMSNorm


def _hc_params(module: nn.Module, name: str, hc: int, dim: int):
    mix = (2 + hc) * hc
    for suffix, shape in (("fn", (mix, hc * dim)), ("base", (mix,)), ("scale", (3,))):
        module.register_parameter(f"hc_{name}_{suffix}",
                                  nn.Parameter(torch.empty(shape, dtype=torch.float32), requires_grad=False))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype=None):
        super().__init__()
        self.layer = layer
        self.hc_iters, self.hc_eps, self.norm_eps = cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg, layer, dtype=dtype)
        self.ffn = MoE(cfg, layer, dtype=dtype)
        _hc_params(self, "attn", cfg.hc_mult, cfg.dim)
        _hc_params(self, "ffn", cfg.hc_mult, cfg.dim)

    def pre(self, h: torch.Tensor, name: str):
        return hc_pre(h, getattr(self, f"hc_{name}_fn"), getattr(self, f"hc_{name}_scale"),
                      getattr(self, f"hc_{name}_base"), self.hc_iters, self.hc_eps, self.norm_eps)

    def pre_fused(self, h: torch.Tensor, name: str, norm: RMSNorm):
        """pre() then norm, in two kernels: the mix GEMM (bf16 tensor cores, fp32-exact through
        the hi/lo split of fn) and mhc_pre (Sinkhorn, collapse, RMSNorm)."""
        from ..kernels.bf16_gemm import mhc_mix, split_bf16
        from ..kernels.mhc_pre import mhc_pre

        fn = getattr(self, f"hc_{name}_fn")
        split = getattr(self, f"_{name}_fn_split", None)
        if split is None or split[0].device != fn.device:     # once, before any graph capture
            split = split_bf16(fn)
            setattr(self, f"_{name}_fn_split", split)
        mix = mhc_mix(h, *split, self.norm_eps)
        return mhc_pre(mix, getattr(self, f"hc_{name}_scale"), getattr(self, f"hc_{name}_base"), h,
                       norm.weight, self.hc_iters, self.hc_eps, self.norm_eps)

    def forward(self, h: torch.Tensor, ids: torch.Tensor, attn=None) -> torch.Tensor:
        """h [B,S,hc,D] -> [B,S,hc,D]. `attn` replaces the cache-free attention (engine caches)."""
        attn = attn or self.attn
        if runs_kernel("mhc", h):
            from ..kernels.mhc_post import mhc_post

            x, post, comb = self.pre_fused(h, "attn", self.attn_norm)
            h = mhc_post(attn(x), h, post, comb)
            x, post, comb = self.pre_fused(h, "ffn", self.ffn_norm)
            return mhc_post(self.ffn(x, ids), h, post, comb)
        x, post, comb = self.pre(h, "attn")
        h = hc_post(attn(self.attn_norm(x)), h, post, comb)
        x, post, comb = self.pre(h, "ffn")
        return hc_post(self.ffn(self.ffn_norm(x), ids), h, post, comb)
