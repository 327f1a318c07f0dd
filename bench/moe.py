"""Fused W4A16 MoE (engine.kernels.fused_moe) at V4-Flash per-rank shapes vs its byte roofline and bf16 torch (CUDA).

    python bench/moe.py [--quick] [--T 1 2 4 ...] [--layout tp ep] [--fmt mxfp4 nvfp4]

Layouts: tp = TP=8 (256 experts, intermediate 2048/8 = 256), ep = 32 local experts of the full
2048 width; hidden 4096, top-6 (ep draws all 6 among the local experts: the busiest rank).
Per (layout, fmt, T), do_bench medians in us of: fused_moe eager, fused_moe under CUDA-graph replay
(how decode runs it), and a torch bf16 reference on the dequantized weights (grouped matmuls via
torch._grouped_mm when present, else per-(token, slot) gathered bmm; every op fixed-shape).
Bytes moved = packed weights + scales of the experts the batch touches, plus activations; the
roofline time is bytes / the device-to-device copy bandwidth measured in the same run. do_bench
clears L2 between repetitions, so the weights come from HBM every time. Goal: graph time within
1.5x of the roofline at T = 1 and 64.
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.kernels import fused_moe as fm  # noqa: E402

D, K, LIMIT = 4096, 6, 10.0
LAYOUTS = {"tp": (256, 256), "ep": (32, 2048)}                 # (experts, intermediate) per rank
GROUPED = hasattr(torch, "_grouped_mm")


def median(fn) -> float:
    return do_bench(fn, return_mode="median") * 1e3             # us


def copy_bandwidth() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    bw = 2 * x.numel() / (median(lambda: y.copy_(x)) * 1e-6)   # bytes read + written per second
    del x, y
    return bw


def random_experts(fmt, E, I):
    """Random checkpoint-layout experts, packed; plus bf16 dequantized weights for the reference."""
    def proj(R, C):
        w = torch.randint(0, 256, (E, R, C // 2), dtype=torch.uint8, device="cuda")
        if fmt == "mxfp4":
            return w, torch.randint(118, 127, (E, R, C // 32), dtype=torch.uint8, device="cuda")
        s = (torch.rand(E, R, C // 16, device="cuda") * 6 + 0.05).to(torch.float8_e4m3fn)
        return w, s, torch.rand(E, device="cuda") * 1e-2 + 1e-3
    p = fm.pack_experts(proj(I, D), proj(I, D), proj(D, I), fmt)
    w1, w3, w2 = (w.bfloat16() for w in fm.dequant_experts(p))
    return p, (w1, w3, w2)


def graphed(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()                                                   # compile, size the split-K tickets
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def torch_bf16(x, w, ids, weights):
    """Sorted (token, slot) pairs through grouped GEMMs of the bf16 experts (no host sync)."""
    w1, w3, w2 = weights
    E, I, T = w1.shape[0], w1.shape[1], x.shape[0]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = order // ids.shape[1]
    xs = x[tok]
    if GROUPED:
        cnt = torch.zeros(E, dtype=torch.int32, device=x.device).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(cnt, 0, dtype=torch.int32)                  # bincount would sync with the host
        g = torch._grouped_mm(xs, w1.transpose(1, 2), offs)
        u = torch._grouped_mm(xs, w3.transpose(1, 2), offs)
    else:                                                                # gathered weights: small batches only
        e = flat[order]
        g, u = (torch.bmm(m[e], xs[:, :, None])[..., 0] for m in (w1, w3))
    h = (F.silu(g.float().clamp(max=LIMIT)) * u.float().clamp(-LIMIT, LIMIT) * w.reshape(-1)[order, None]).bfloat16()
    if GROUPED:
        y = torch._grouped_mm(h, w2.transpose(1, 2), offs)
    else:
        y = torch.bmm(w2[flat[order]], h[:, :, None])[..., 0]
    return torch.zeros(T, x.shape[1], device=x.device).index_add_(0, tok, y.float())


def moved(p: fm.PackedExperts, ids, T) -> int:
    """Bytes the fused op must move: touched experts' packed weights + scales, and the activations."""
    n = int(torch.unique(ids).numel())
    per_expert = sum(t[0].numel() * t.element_size() for t in (p.w13, p.s13, p.w2, p.s2))
    acts = T * D * 2 + T * K * (2 * p.I * 2 + 2 * D * 4) + T * D * 4   # x, h in+out, y in+out, out
    return n * per_expert + acts, n


def bench_one(fmt, layout, T, p, weights, bw):
    E, I = LAYOUTS[layout]
    x = torch.randn(T, D, device="cuda").bfloat16()
    ids = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(T)])
    w = torch.rand(T, K, device="cuda")
    op = lambda: fm.fused_moe(x, w, ids, p, LIMIT)                        # noqa: E731
    eager, graph = median(op), median(graphed(op))
    if GROUPED or T * K * 3 * I * D * 2 < 4e9:
        try:
            ref = median(graphed(lambda: torch_bf16(x, w, ids, weights)))
        except RuntimeError:                                             # not capturable here: eager
            ref = median(lambda: torch_bf16(x, w, ids, weights))
        r = torch_bf16(x, w, ids, weights)
        err = float((op() - r).abs().max() / r.abs().max())
    else:
        ref = err = float("nan")
    nbytes, n = moved(p, ids, T)
    roof = nbytes / bw * 1e6
    return (f"| {layout} | {fmt} | {T} | {n} | {nbytes / 1e6:.1f} | {eager:.1f} | {graph:.1f} | {roof:.1f} "
            f"| {graph / roof:.2f}x | {nbytes / graph / 1e3:.0f} | {ref:.1f} | {ref / graph:.2f}x | {err:.1e} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="T 1 and 64 only")
    ap.add_argument("--T", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    ap.add_argument("--layout", nargs="+", default=["tp", "ep"], choices=list(LAYOUTS))
    ap.add_argument("--fmt", nargs="+", default=["mxfp4", "nvfp4"], choices=["mxfp4", "nvfp4"])
    args = ap.parse_args()
    Ts = [1, 64] if args.quick else args.T
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s (measured); hidden {D}, top-{K}")
    print("| layout | fmt | T | experts | MB moved | eager us | graph us | roofline us | of roofline | GB/s "
          "| bf16 torch us | vs bf16 | max err vs bf16 |")
    print("|" + " --- |" * 13)
    for layout in args.layout:
        for fmt in args.fmt:
            p, weights = random_experts(fmt, *LAYOUTS[layout])
            for T in Ts:
                print(bench_one(fmt, layout, T, p, weights, bw), flush=True)
            del p, weights
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
