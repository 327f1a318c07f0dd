"""Lightning indexer (CSA layers): picks the top-k compressed entries per query.

score[t, s] = sum_h w[t, h] * relu(q[t, h] . K[s]), causal over entries s < (t+1)//4.
Its keys come from its own overlapping 4:1 compressor at index_head_dim. No softmax.
"""
import torch
from torch import nn

from ..kernels import runs_kernel
from ..kernels.indexer import index_scores, index_select
from .compressor import Compressor
from .config import ModelConfig
from .kv_cache import entry_loc
from .linear import Linear
from .quant_sim import fp4_sim, hadamard
from .rope import apply_rope
from ..numerics import up


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype=None):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.ratio = cfg.ratio(layer)
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, "fp8", dtype=dtype)
        self.weights_proj = Linear(cfg.dim, self.n_heads, dtype=dtype)
        self.compressor = Compressor(cfg, layer, self.head_dim, rotate=True, dtype=dtype)
        self.sim = False

    def queries(self, x: torch.Tensor, qr: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """-> q [..., H, d] and head weights [..., H] (fp32, scales folded in)."""
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        if runs_kernel("rope_q", q) and cos.shape[:-1] == q.shape[:-2]:
            from ..kernels.rope_q import rope_q

            q = rope_q(q, cos, sin, fp4=self.sim)                 # rope, Hadamard, FP4: one kernel
        else:
            q = apply_rope(q, cos[..., None, :], sin[..., None, :])
            if self.sim:
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

    def forward_cached(self, x, qr, cos, sin, ctx, cache, n: int, inv_freq) -> torch.Tensor:
        """With the engine's cache: update the indexer keys, score the first n entries of
        each row's sequence -> top-k entry ids [B,S,k] (-1 where none)."""
        self.compressor.step(x, ctx, cache.idx_kv_state, cache.idx_score_state, cache.idx_k, inv_freq)
        loc = entry_loc(ctx.block_table, ctx.block_tokens, torch.arange(n, device=x.device).expand(x.shape[0], n),
                        self.ratio)
        keys = cache.idx_k.flatten(0, 1)[loc]                                   # [B,n,d]
        q, w = self.queries(x, qr, cos, sin)
        return self.select(self.scores(q, w, keys), ctx.positions)

    def decode_rows(self, x, qr, cos, sin, ctx, cache, n: int, inv_freq) -> torch.Tensor:
        """Decode through the Triton indexer: -> the selected entries' flat pool rows [B, k]
        (-1 where none), which the attention kernel reads directly."""
        from ..kernels.indexer import indexer_topk

        self.compressor.step(x, ctx, cache.idx_kv_state, cache.idx_score_state, cache.idx_k, inv_freq)
        q, w = self.queries(x, qr, cos, sin)
        visible = ctx.once(("visible entries", self.ratio), lambda: (ctx.positions[:, 0] + 1) // self.ratio)
        k = max(1, min(self.topk, n))
        _, rows = indexer_topk(q[:, 0].contiguous(), w[:, 0].contiguous(), cache.idx_k.flatten(0, 1),
                               ctx.block_table, ctx.block_tokens // self.ratio, visible, k, max(n, 1))
        return rows
