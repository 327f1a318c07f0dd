"""DeepSeek-V4-Flash's real dims, and random weights in its real formats.

REAL is the checkpoint's config.json (43 blocks, 256 experts of which 6 per token, FP8
projections in 128x128 blocks, MXFP4 routed experts); RATIOS its compress ratio per block.
Random normal weights are not FP4/FP8 values: the experts' pack() (which re-derives the codes
and checks them by dequantising) refuses them, and the MoE silently falls back to the torch
path. Rounding each weight onto its grid (quantise, dequantise) gives weights the packers
reproduce exactly, as a real checkpoint's.

Torch-only on purpose: the functions take the format helpers as arguments and find modules by
class name, so bench/decode.py --baseline loads this file by path and rounds an older tree's
model with it. engine.simulate builds a simulated rank from these.
"""
import math

import torch

REAL = dict(vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=43,
            num_attention_heads=64, head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8,
            o_lora_rank=1024, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=6, num_hash_layers=3,
            routed_scaling_factor=1.5, swiglu_limit=10.0, sliding_window=128, index_n_heads=64, index_head_dim=128,
            index_topk=512, hc_mult=4, hc_sinkhorn_iters=20, rope_theta=10000, compress_rope_theta=160000,
            rope_scaling=dict(type="yarn", factor=16, original_max_position_embeddings=65536, beta_fast=32, beta_slow=1),
            max_position_embeddings=1048576, num_nextn_predict_layers=0, expert_dtype="fp4",
            quantization_config=dict(quant_method="fp8", fmt="e4m3", scale_fmt="ue8m0", weight_block_size=[128, 128]))
RATIOS = [0, 0] + [4, 128] * 20 + [4]

# REAL shrunk for CPU tests and smoke runs, keeping every format: widths stay whole 128-blocks
# per rank up to tp=2 (FP8 projections, the fused MoE's 128-row tiles), the same layer kinds.
SMALL = {**REAL, "vocab_size": 4096, "hidden_size": 256, "moe_intermediate_size": 256, "num_attention_heads": 8,
         "head_dim": 128, "q_lora_rank": 128, "o_groups": 4, "o_lora_rank": 128, "n_routed_experts": 8,
         "num_experts_per_tok": 2, "sliding_window": 16, "index_n_heads": 8, "index_topk": 8, "num_hidden_layers": 4,
         "compress_ratios": [0, 4, 128, 4], "num_hash_layers": 1, "max_position_embeddings": 4096,
         "rope_scaling": dict(type="yarn", factor=4, original_max_position_embeddings=1024, beta_fast=32, beta_slow=1)}


def real_dict(layers: int = 43) -> dict:
    """REAL cut to its first `layers` blocks (their compress ratios and hash layers with them)."""
    return {**REAL, "num_hidden_layers": layers, "compress_ratios": RATIOS[:layers],
            "num_hash_layers": min(REAL["num_hash_layers"], layers)}


@torch.no_grad()
def init_random(params, buffers, generator, n_experts: int) -> int:
    """Fill (name, tensor) pairs in place, seeded by `generator`: weights N(0, 1/fan_in) so
    activations stay O(1), norms and mHC scales around 1, hash tables (tid2eid) with expert ids.
    -> number of tensors filled."""
    n = 0
    for name, p in params:
        if p.dtype.is_floating_point:
            fan_in = p.shape[-1] if p.dim() > 1 else 1
            p.normal_(0, 1 / math.sqrt(fan_in), generator=generator)
            if name.endswith(("norm.weight", "hc_attn_scale", "hc_ffn_scale", "hc_head_scale")):
                p.add_(1)
            n += 1
    for name, b in buffers:
        if name.endswith("tid2eid"):
            b.copy_(torch.randint(0, n_experts, b.shape, device=b.device, generator=generator))
            n += 1
    return n


def experts_modules(model):
    """-> [(name, module)] of every routed-experts module (stacked w1, w3 [E,I,D], w2 [E,D,I])."""
    return [(n, m) for n, m in model.named_modules() if type(m).__name__ == "Experts"]


@torch.no_grad()
def round_experts_mxfp4(model, mxfp4_quant, mxfp4_dequant, chunk: int = 16) -> int:
    """Round every expert weight in place onto the MXFP4 grid (E8M0 scale per 32 input channels):
    w <- mxfp4_dequant(*mxfp4_quant(w)). `chunk` experts at a time bound the fp32 copies.
    -> number of expert weights rounded. Returns 0 for experts already packed (no w1)."""
    n = 0
    for _, m in experts_modules(model):
        for w in (getattr(m, "w1", None), getattr(m, "w3", None), getattr(m, "w2", None)):
            if w is None:
                continue
            E, rows, cols = w.shape
            for e0 in range(0, E, chunk):
                part = w[e0:e0 + chunk]                       # [c, rows, cols]: blocks run along cols
                flat = part.reshape(-1, cols).float()
                part.copy_(mxfp4_dequant(*mxfp4_quant(flat)).view_as(part).to(w.dtype))
            n += 1
        if getattr(m, "nvfp4_parts", None) is not None:       # the rounded weights are MXFP4 now
            m.nvfp4_parts = None
    return n


@torch.no_grad()
def round_experts_nvfp4(model, nvfp4_quant, nvfp4_dequant) -> int:
    """Round every expert weight in place onto the NVFP4 grid (e4m3 scale per 16 channels, one fp32
    global scale per expert and projection) and keep its codes in `nvfp4_parts`, as the loader
    does for an NVFP4 checkpoint, so pack() takes the NVFP4 path. -> number of expert weights."""
    n = 0
    for _, m in experts_modules(model):
        parts = []
        for w in (m.w1, m.w3, m.w2):
            codes, scales, globals_ = [], [], []
            for e in range(w.shape[0]):
                c, s, g = nvfp4_quant(w[e].float())
                w[e].copy_(nvfp4_dequant(c, s, g).to(w.dtype))
                codes.append(c), scales.append(s), globals_.append(g.reshape(()))
            parts.append((torch.stack(codes), torch.stack(scales), torch.stack(globals_)))
            n += 1
        m.nvfp4_parts = parts
    return n


def unpacked_experts(model) -> list[str]:
    """Names of the experts modules that did not pack (they would run the torch fallback)."""
    return [n for n, m in experts_modules(model) if getattr(m, "packed", None) is None]


@torch.no_grad()
def round_fp8_linears(model, fp8_block_quant, fp8_block_dequant) -> int:
    """Round every FP8-format Linear's random weight onto the e4m3 + E8M0 grid in place, as a
    checkpoint's are, so the packed projections keep its rows as FP8 bytes (they take a weight as
    FP8 only where that is exact). -> number of weights rounded."""
    n = 0
    for _, m in model.named_modules():
        w = getattr(m, "weight", None)
        if type(m).__name__ == "Linear" and getattr(m, "fmt", None) == "fp8" and w is not None and w.dim() == 2:
            w.copy_(fp8_block_dequant(*fp8_block_quant(w.float())).to(w.dtype))
            n += 1
    return n
