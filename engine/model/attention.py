"""Attention for all three layer kinds: one shared 512-d K=V head for every query head.

Each query attends to a set of key indices into one KV buffer: the sliding window
(its last `window` tokens, itself included) plus, in CSA layers, the indexer's top-k
compressed entries, or, in HCA layers, every visible compressed entry. A learned
per-head sink adds mass to the softmax denominator only. The rope channels of the
output are rotated back by the query position, then a grouped low-rank projection
(wo_a per group of heads, wo_b across groups) returns to the model width.
"""
import torch
from torch import nn

from ..parallel.comm import all_reduce, shard
from .compressor import Compressor
from .config import ModelConfig
from .indexer import Indexer
from .linear import Linear
from .norm import RMSNorm, rms_norm
from .quant_sim import fp8_sim
from ..kernels import runs_kernel
from ..kernels.sparse_attn import attend, gather_attend as sparse_attn
from .kv_cache import LayerCache, StepContext, entry_loc, window_keys
from .rope import apply_rope, cos_sin, layer_inv_freq


def window_indices(positions: torch.Tensor, window: int) -> torch.Tensor:
    """Whole sequence from 0: query positions [S] -> key positions [S, window], -1 before 0."""
    idx = positions[:, None] - window + 1 + torch.arange(window, device=positions.device)
    return torch.where(idx >= 0, idx, -1)


def window_rows(ctx: StepContext, W: int) -> torch.Tensor:
    """Decode: each row's window keys as flat rows of the [slots * W, Dh] ring, -1 before 0."""
    key_pos = ctx.positions[:, :1] - W + 1 + torch.arange(W, device=ctx.positions.device)   # [B,W]
    return torch.where(key_pos >= 0, ctx.slots[:, None] * W + key_pos % W, -1)


def entry_rows(ctx: StepContext, ratio: int, n: int) -> torch.Tensor:
    """Decode, HCA: every visible entry of each row as flat rows of the pool, -1 past the visible."""
    pos = ctx.positions[:, 0]
    ent = torch.arange(n, device=pos.device).expand(len(pos), n)
    rows = entry_loc(ctx.block_table, ctx.block_tokens, ent, ratio)
    return torch.where(ent < ((pos + 1) // ratio)[:, None], rows, -1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype=None):
        super().__init__()
        self.kind, self.ratio = cfg.layer_kind(layer), cfg.ratio(layer)
        # tensor parallel: each rank owns n_heads/tp heads, i.e. o_groups/tp whole output groups
        self.n_heads, self.head_dim, self.rope_dim = shard(cfg.n_heads, "num_attention_heads"), cfg.head_dim, cfg.rope_dim
        self.n_groups = shard(cfg.o_groups, "o_groups")
        self.window, self.eps = cfg.window_size, cfg.norm_eps
        self.scale = cfg.head_dim ** -0.5
        fp8 = "fp8" if cfg.fp8_linears else "bf16"
        self.wq_a = Linear(cfg.dim, cfg.q_lora_rank, fp8, dtype=dtype)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * cfg.head_dim, fp8, dtype=dtype)
        self.wkv = Linear(cfg.dim, cfg.head_dim, fp8, dtype=dtype)
        self.kv_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        # wo_a: [groups * o_lora, heads_per_group * head_dim]; DeepSeek runs it in bf16.
        self.wo_a = Linear(cfg.n_heads * cfg.head_dim // cfg.o_groups, self.n_groups * cfg.o_lora_rank, fp8, dtype=dtype)
        self.wo_b = Linear(self.n_groups * cfg.o_lora_rank, cfg.dim, fp8, dtype=dtype)   # row-parallel
        self.attn_sink = nn.Parameter(torch.empty(self.n_heads, dtype=torch.float32), requires_grad=False)
        self.compressor = Compressor(cfg, layer, cfg.head_dim, rotate=False, dtype=dtype) if self.ratio else None
        self.indexer = Indexer(cfg, layer, dtype=dtype) if self.kind == "csa" else None
        self.register_buffer("inv_freq", layer_inv_freq(cfg, layer), persistent=False)
        self.rope_key = "compressed" if self.ratio else "plain"      # which inv_freq set (StepContext.cos_sin)
        self.sim = False

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [...,D] -> q [...,H,Dh], kv [...,Dh] (roped; nope dims FP8-rounded in reference), qr."""
        qr = self.q_norm(self.wq_a(x))
        q = rms_norm(self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim)), None, self.eps)
        q = apply_rope(q, cos[..., None, :], sin[..., None, :])
        kv = apply_rope(self.kv_norm(self.wkv(x)), cos, sin)
        if self.sim:
            nope = self.head_dim - self.rope_dim
            kv = torch.cat((fp8_sim(kv[..., :nope], 64), kv[..., nope:]), dim=-1)
        return q, kv, qr

    def output(self, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """o [...,H,Dh] -> [...,D]: inverse rope at the query position, then grouped wo_a, wo_b."""
        if runs_kernel("rope_q", o) and cos.shape[:-1] == o.shape[:-2]:
            from ..kernels.rope_q import rope_q

            o = rope_q(o, cos, sin, inverse=True)
        else:
            o = apply_rope(o, cos[..., None, :], sin[..., None, :], inverse=True)
        o = o.flatten(-2).unflatten(-1, (self.n_groups, -1))                               # [...,G,H/G*Dh]
        wa = self.wo_a.weight.unflatten(0, (self.n_groups, -1))                              # [G,R,H/G*Dh]
        z = torch.einsum("...gd,grd->...gr", o, wa)
        return all_reduce(self.wo_b(z.flatten(-2)))

    def forward(self, x: torch.Tensor, input_ids=None) -> torch.Tensor:
        """Whole sequence from position 0, no cache: x [B,S,D] -> [B,S,D]."""
        B, S, _ = x.shape
        pos = torch.arange(S, device=x.device)
        cos, sin = cos_sin(pos, self.inv_freq)
        q, kv, qr = self.qkv(x, cos, sin)
        idx = window_indices(pos, self.window).expand(B, S, -1)
        if self.compressor is not None:
            comp = self.compressor(x, self.inv_freq)                                          # [B,N,Dh]
            n = comp.shape[1]
            if self.indexer is not None:
                sel, _ = self.indexer(x, qr, cos, sin, pos, self.inv_freq)
            else:
                ent = torch.arange(n, device=x.device).expand(S, n)
                sel = torch.where(ent < ((pos + 1) // self.ratio)[:, None], ent, -1).expand(B, S, n)
            idx = torch.cat((idx, torch.where(sel >= 0, sel + S, -1)), dim=-1)
            kv = torch.cat((kv, comp), dim=1)
        o = sparse_attn(q, kv, idx, self.attn_sink, self.scale)
        return self.output(o, cos, sin)

    def forward_cached(self, x: torch.Tensor, ctx: StepContext, cache: LayerCache) -> torch.Tensor:
        """This step's tokens x [B,S,D] against the engine's cache -> [B,S,D]; updates the cache."""
        if ctx.decode and runs_kernel("sparse_attn", x):
            return self.decode_kernels(x, ctx, cache)
        pos = ctx.positions
        cos, sin = ctx.cos_sin(self.rope_key, self.inv_freq)
        q, kv, qr = self.qkv(x, cos, sin)
        keys, valid = window_keys(kv, ctx, cache.window)
        if self.compressor is not None:
            self.compressor.step(x, ctx, cache.kv_state, cache.score_state, cache.kv, self.inv_freq)
            n = ctx.max_len // self.ratio                      # entries visible to the latest token
            if self.indexer is not None:
                sel = self.indexer.forward_cached(x, qr, cos, sin, ctx, cache, n, self.inv_freq)
            else:
                ent = torch.arange(n, device=x.device)
                sel = torch.where(ent < ((pos + 1) // self.ratio)[..., None], ent, -1)    # [B,S,n]
            loc = entry_loc(ctx.block_table, ctx.block_tokens, sel.clamp(min=0), self.ratio)
            keys = torch.cat((keys, cache.kv.flatten(0, 1)[loc].to(keys.dtype)), dim=2)
            valid = torch.cat((valid, sel >= 0), dim=2)
        o = attend(q, keys, valid, self.attn_sink, self.scale)
        return self.output(o, cos, sin)

    def decode_kernels(self, x: torch.Tensor, ctx: StepContext, cache: LayerCache) -> torch.Tensor:
        """Decode (one token per row) through the Triton kernels: the keys are never gathered;
        the sparse MQA kernel reads them through flat row lists of the ring and the pool."""
        from ..kernels.sparse_attn import sparse_mqa

        pos = ctx.positions[:, 0]
        cos, sin = ctx.cos_sin(self.rope_key, self.inv_freq)
        W = cache.window.shape[1]
        if runs_kernel("rope_kv", x):
            # norms, RoPE, the KV's FP8 rounding and the ring write in one kernel
            from ..kernels.rope_kv import rope_qkv

            qr = self.q_norm(self.wq_a(x))
            q, _ = rope_qkv(self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim)), self.wkv(x),
                            self.kv_norm.weight, self.eps, cos, sin, positions=ctx.positions,
                            ring=cache.window, slots=ctx.slots, fp8=self.sim)
        else:
            q, kv, qr = self.qkv(x, cos, sin)
            cache.window[ctx.slots, pos % W] = kv[:, 0].to(cache.window.dtype)
        idx_a = ctx.once(("window rows", W), lambda: window_rows(ctx, W))
        kv_b = idx_b = None
        if self.compressor is not None:
            self.compressor.step(x, ctx, cache.kv_state, cache.score_state, cache.kv, self.inv_freq)
            n = ctx.max_len // self.ratio
            if self.indexer is not None:
                idx_b = self.indexer.decode_rows(x, qr, cos, sin, ctx, cache, n, self.inv_freq)
            else:
                idx_b = ctx.once(("entry rows", self.ratio), lambda: entry_rows(ctx, self.ratio, n))
            kv_b = cache.kv.flatten(0, 1)
        o = sparse_mqa(q[:, 0], cache.window.flatten(0, 1), idx_a, kv_b, idx_b, self.attn_sink, self.scale)
        return self.output(o[:, None], cos, sin)
