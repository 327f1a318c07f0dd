"""Lightning indexer (CSA layers): picks the top-k compressed entries per query.

score[t, s] = sum_h w[t, h] * relu(q[t, h] . K[s]), causal over entries s < (t+1)//4.
Its keys come from its own overlapping 4:1 compressor at index_head_dim. No softmax.
"""
import torch
from torch import nn

from ..kernels.indexer import index_scores, index_select
from .compressor import Compressor
from .config import ModelConfig
from .linear import Linear
from .rope import apply_rope
from ..numerics import PLAIN, fp4_sim_ref as fp4_sim, hadamard, up


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype=None):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.ratio = cfg.ratio(layer)
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, "fp8", dtype=dtype)
        self.weights_proj = Linear(cfg.dim, self.n_heads, dtype=dtype)
        self.compressor = Compressor(cfg, layer, self.head_dim, rotate=True, dtype=dtype)
        self.numerics = PLAIN

    def queries(self, x: torch.Tensor, qr: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """-> q [..., H, d] and head weights [..., H] (fp32, scales folded in)."""
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        q = apply_rope(q, cos[..., None, :], sin[..., None, :])
        if self.numerics.indexer_fp4:
            q = fp4_sim(hadamard(q), 32)
        w = up(self.weights_proj(x)) * (self.head_dim ** -0.5 * self.n_heads ** -0.5)
        return q, w

    @staticmethod
    def scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """q [B,S,H,d], w [B,S,H], keys [B,N,d] -> [B,S,N] fp32 (engine.kernels.indexer.index_scores)."""
        return index_scores(q, w, keys)

    def select(self, scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Causal top-k: scores [B,S,N], positions [S] or [B,S] -> entry ids [B,S,k], -1 where none."""
        return index_select(scores, positions, self.ratio, self.topk)

    def forward(self, x, qr, cos, sin, positions, inv_freq):
        """Whole sequence: -> (top-k entry ids [B,S,k], scores [B,S,N]) ; scores kept for tie checks."""
        keys = self.compressor(x, inv_freq)
        q, w = self.queries(x, qr, cos, sin)
        scores = self.scores(q, w, keys)
        return self.select(scores, positions), scores
