"""The multi-token-prediction block `mtp.0`: predicts the token after next.

Its input mixes the main model's last 4-stream hidden state at position t with the
embedding of token t+1 (the DeepSeek-V3 pairing; V4's reference does not wire MTP),
runs one sliding-window block, and collapses with its own hc_head into the shared head.
"""
import torch
from torch import nn

from .block import Block
from .config import ModelConfig
from .linear import Linear
from .mhc import hc_head
from .norm import RMSNorm


class MTPBlock(Block):
    def __init__(self, cfg: ModelConfig, dtype=None):
        super().__init__(cfg, cfg.n_layers, dtype=dtype)
        fmt = "fp8" if cfg.fp8_linears else "bf16"
        self.e_proj = Linear(cfg.dim, cfg.dim, fmt, dtype=dtype)
        self.h_proj = Linear(cfg.dim, cfg.dim, fmt, dtype=dtype)
        self.enorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        hc = cfg.hc_mult
        self.hc_head_fn = nn.Parameter(torch.empty(hc, hc * cfg.dim, dtype=torch.float32), requires_grad=False)
        self.hc_head_base = nn.Parameter(torch.empty(hc, dtype=torch.float32), requires_grad=False)
        self.hc_head_scale = nn.Parameter(torch.empty(1, dtype=torch.float32), requires_grad=False)

    def hidden(self, h_main: torch.Tensor, next_emb: torch.Tensor, next_ids: torch.Tensor, attn=None):
        """h_main [B,S,hc,D], next_emb [B,S,D] -> the block's output streams [B,S,hc,D]."""
        x = self.e_proj(self.enorm(next_emb))[..., None, :] + self.h_proj(self.hnorm(h_main))
        return super().forward(x, next_ids, attn)

    def collapse(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(hc_head(h, self.hc_head_fn, self.hc_head_scale, self.hc_head_base,
                                 self.hc_eps, self.norm_eps))
