"""One decoder block: attention and MoE, each wrapped in mHC over the residual streams."""
import torch
from torch import nn

from ..kernels.bf16_gemm import split_bf16
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
        self.mix_split = {}
        self.proj = {}          # "attn", "ffn", "q", "wo_a", "wo" -> the packed projections (engine.model.projections)

    def pre(self, h: torch.Tensor, name: str):
        return hc_pre(h, getattr(self, f"hc_{name}_fn"), getattr(self, f"hc_{name}_scale"),
                      getattr(self, f"hc_{name}_base"), self.hc_iters, self.hc_eps, self.norm_eps)

    def mix_weight(self, name: str):
        """-> (fn_hi, fn_lo) for ops.mhc_pre: the mix projection's fp32 weight split into two bf16
        halves for the mix kernel (prepare_mix), or (fn, None) for the reference."""
        return self.mix_split.get(name) or (getattr(self, f"hc_{name}_fn"), None)

    def prepare_mix(self, split: bool):
        """The mix kernel reads fn as bf16 hi + lo (tensor cores at fp32-grade accuracy): split it
        once, before any graph capture; split False drops the halves (the reference reads fn)."""
        self.mix_split = {n: split_bf16(getattr(self, f"hc_{n}_fn")) for n in ("attn", "ffn")} if split else {}

    def forward(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The oracle, whole sequences: h [B,S,hc,D] -> [B,S,hc,D] (the engine: step.block)."""
        x, post, comb = self.pre(h, "attn")
        h = hc_post(self.attn(self.attn_norm(x)), h, post, comb)
        x, post, comb = self.pre(h, "ffn")
        return hc_post(self.ffn(self.ffn_norm(x), ids), h, post, comb)
