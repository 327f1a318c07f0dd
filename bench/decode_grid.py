"""Put random routed experts on the FP4 grid, so that Experts.pack() accepts them and the bench's
MoE runs the fused kernel on packed codes, as a real checkpoint's would.

Random normal weights are not FP4 values: pack() (which re-derives the codes and checks them by
dequantising) refuses them, and the MoE silently falls back to the torch path. Rounding each
expert onto the MXFP4 grid (quantise, dequantise) gives weights pack() reproduces exactly.

Engine-free on purpose: the functions take the tree's own format helpers as arguments and find
the experts by class name, so the same code rounds an older tree's model in a baseline run
(bench/decode.py --baseline: only torch and that tree's engine.model.formats are needed).
"""
import torch


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
