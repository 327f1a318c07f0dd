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
from ..kernels.sparse_attn import gather_attend as sparse_attn
from ..numerics import PLAIN, fp8_sim_ref as fp8_sim
from .rope import apply_rope, cos_sin, layer_inv_freq


def window_indices(positions: torch.Tensor, window: int) -> torch.Tensor:
    """Whole sequence from 0: query positions [S] -> key positions [S, window], -1 before 0."""
    idx = positions[:, None] - window + 1 + torch.arange(window, device=positions.device)
    return torch.where(idx >= 0, idx, -1)


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
        self.wo_a = Linear(cfg.n_heads * cfg.head_dim // cfg.o_groups, self.n_groups * cfg.o_lora_rank, fp8,
                           dtype=dtype, fp8_gemm=False)
        self.wo_b = Linear(self.n_groups * cfg.o_lora_rank, cfg.dim, fp8, dtype=dtype)   # row-parallel
        self.attn_sink = nn.Parameter(torch.empty(self.n_heads, dtype=torch.float32), requires_grad=False)
        self.compressor = Compressor(cfg, layer, cfg.head_dim, rotate=False, dtype=dtype) if self.ratio else None
        self.indexer = Indexer(cfg, layer, dtype=dtype) if self.kind == "csa" else None
        self.register_buffer("inv_freq", layer_inv_freq(cfg, layer), persistent=False)
        self.rope_key = "compressed" if self.ratio else "plain"      # which inv_freq set (StepInputs.cos_sin)
        self.numerics = PLAIN

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [...,D] -> q [...,H,Dh], kv [...,Dh] (roped; nope dims FP8-rounded in reference), qr."""
        qr = self.q_norm(self.wq_a(x))
        q = rms_norm(self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim)), None, self.eps)
        q = apply_rope(q, cos[..., None, :], sin[..., None, :])
        kv = apply_rope(self.kv_norm(self.wkv(x)), cos, sin)
        if self.numerics.kv_fp8:
            nope = self.head_dim - self.rope_dim
            kv = torch.cat((fp8_sim(kv[..., :nope], 64), kv[..., nope:]), dim=-1)
        return q, kv, qr

    def output(self, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """o [...,H,Dh] -> [...,D]: inverse rope at the query position, then grouped wo_a, wo_b."""
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
