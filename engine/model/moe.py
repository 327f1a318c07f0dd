"""MoE: score-routed or hash-routed (first layers) top-k experts plus one shared expert.

Gate: scores = sqrt(softplus(x W^T)); the bias only steers which experts are chosen
("noaux_tc"); the chosen scores are renormalised and scaled by route_scale. Hash layers
choose by a fixed token -> experts table instead. Experts are SwiGLU with the gate
clamped above and the up projection clamped both ways at swiglu_limit.
"""
import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.comm import all_reduce, shard
from ..kernels.fused_moe import experts_ref, fused_moe_ref, swiglu
from ..numerics import PLAIN, fp8_sim_ref as fp8_sim, up
from .config import ModelConfig
from .linear import Linear


class Gate(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype=None):
        super().__init__()
        self.topk, self.score_func = cfg.n_activated_experts, cfg.score_func
        self.route_scale, self.norm_topk = cfg.route_scale, cfg.norm_topk_prob
        self.is_hash = cfg.is_hash_layer(layer)
        E = cfg.n_routed_experts
        self.weight = nn.Parameter(torch.empty(E, cfg.dim, dtype=dtype), requires_grad=False)
        if self.is_hash:
            self.register_buffer("tid2eid", torch.empty(cfg.vocab_size, self.topk, dtype=torch.long))
        else:
            self.bias = nn.Parameter(torch.empty(E, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T,D], ids [T] -> routing weights [T,k] fp32, expert ids [T,k]."""
        logits = F.linear(up(x), up(self.weight))
        if self.score_func == "sqrtsoftplus":
            scores = F.softplus(logits).sqrt()
        elif self.score_func == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = logits.softmax(-1)
        if self.is_hash:
            idx = self.tid2eid[ids]
        else:
            idx = (scores + self.bias).topk(self.topk, dim=-1).indices
        w = scores.gather(-1, idx)
        if self.norm_topk and self.score_func != "softmax":
            w = w / w.sum(-1, keepdim=True)
        return w * self.route_scale, idx


class Experts(nn.Module):
    """All routed experts stacked: w1, w3 [E,I,D] (gate, up), w2 [E,D,I] (down)."""

    def __init__(self, cfg: ModelConfig, dtype=None):
        super().__init__()
        # tensor parallel inside every expert: each rank owns I/tp of the intermediate width
        E, I, D = cfg.n_routed_experts, shard(cfg.moe_inter_dim, "moe_intermediate_size"), cfg.dim
        self.limit = cfg.swiglu_limit
        self.w1 = nn.Parameter(torch.empty(E, I, D, dtype=dtype), requires_grad=False)
        self.w3 = nn.Parameter(torch.empty(E, I, D, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(E, D, I, dtype=dtype), requires_grad=False)
        # DeepSeek's FP8/FP4 expert GEMMs take e4m3 activations in reference numerics; NVFP4 experts
        # (a transcode of the MXFP4 ones) get exactly the same input rounding
        self.quantized = cfg.expert_dtype in ("fp4", "nvfp4", "fp8")
        self.numerics = PLAIN
        self.packed = None    # engine.kernels.fused_moe.PackedExperts once pack() ran
        self.nvfp4_parts = None    # [(codes, scales, globals) of w1, w3, w2] when loaded from NVFP4

    def pack(self) -> bool:
        """Hold the experts in the fused MoE kernel's layout and drop the dequantised weights ->
        False (nothing changed) where the packed codes would not reproduce the held weights.

        NVFP4 experts pack the checkpoint's own codes and scales (kept by the loader). MXFP4
        codes are re-derived from the weights, which is exact for weights loaded from MXFP4:
        re-deriving a block's power-of-two scale only ever halves it while the codes double,
        which stays on the e2m1 grid. Every expert is checked by dequantising what is packed."""
        from ..kernels.moe_pack import pack_experts
        from .formats import mxfp4_dequant, mxfp4_quant, nvfp4_dequant

        if self.packed is not None:
            return True
        held = (self.w1, self.w3, self.w2)
        if self.nvfp4_parts is not None:
            projs, fmt, dequant = self.nvfp4_parts, "nvfp4", nvfp4_dequant
        else:
            def quant(w):   # [E,out,in] -> (codes [E,out,in/2], scales [E,out,in/32])
                parts = [mxfp4_quant(w[e].float()) for e in range(w.shape[0])]
                return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
            projs, fmt, dequant = [quant(w) for w in held], "mxfp4", mxfp4_dequant
        for parts, w in zip(projs, held):
            if not all(torch.equal(dequant(*(t[e] for t in parts)).to(w.dtype), w[e]) for e in range(w.shape[0])):
                return False
        self.packed = pack_experts(*projs, fmt)
        self.w1 = self.w2 = self.w3 = self.nvfp4_parts = None
        return True

    @property
    def act(self) -> bool:
        """Do the experts' inputs get the FP8 round trip (reference numerics, quantised experts)."""
        return self.numerics.act_fp8 and self.quantized

    def forward(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """x [T,D], weights/idx [T,k] -> sum_k w * expert_k(x) [T,D] fp32: the fused MoE kernel on
        packed experts, else the torch math (engine.kernels.fused_moe.experts_ref: a loop over the
        experts that have tokens on CPU, gathered or dense on CUDA, which a CUDA graph can capture)."""
        if self.packed is not None:
            # W4A16: in reference numerics only the input gets DeepSeek's FP8 rounding here
            return up(fused_moe_ref(fp8_sim(x, 128) if self.act else x, weights, idx, self.packed, self.limit))
        act_round = (lambda a: fp8_sim(a, 128)) if self.act else None
        return experts_ref(x, weights, idx, self.w1, self.w3, self.w2, self.limit, act_round)


class SharedExpert(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype=None):
        super().__init__()
        fmt = "fp8" if cfg.fp8_linears else "bf16"
        I = shard(cfg.moe_inter_dim * cfg.n_shared_experts, "moe_intermediate_size")
        self.w1 = Linear(cfg.dim, I, fmt, dtype=dtype)
        self.w3 = Linear(cfg.dim, I, fmt, dtype=dtype)
        self.w2 = Linear(I, cfg.dim, fmt, dtype=dtype)
        self.limit = cfg.swiglu_limit  # clamped, as the current official reference does

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w1(x), self.w3(x), self.limit).to(x.dtype))


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype=None):
        super().__init__()
        self.gate = Gate(cfg, layer, dtype=dtype)
        self.experts = Experts(cfg, dtype=dtype)
        self.shared_experts = SharedExpert(cfg, dtype=dtype) if cfg.n_shared_experts else None

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [...,D], ids [...] (token ids, for hash routing) -> [...,D]."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        w, idx = self.gate(x, ids.reshape(-1))
        y = self.experts(x, w, idx)
        if self.shared_experts is not None:
            y = y + up(self.shared_experts(x))
        return all_reduce(y).to(x.dtype).reshape(shape)   # one all-reduce for routed + shared
