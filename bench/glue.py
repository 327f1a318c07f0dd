"""Fused glue kernels vs their torch references: median times and kernels per layer (CUDA).

    python bench/glue.py [--quick] [--T 1 64 256] [--H 64]

For each fused kernel (mhc_pre with its mix projection, sinkhorn, mhc_post, rope_qkv, route) at the real shapes
(D 4096, Dh 512, rope 64, E 256, k 6, window 128): do_bench medians of the torch reference
and of the kernel. Then one layer's glue in decode order (attn pre, rope/kv, attn post, ffn
pre, router, ffn post; the GEMMs left out) under torch.profiler: CUDA kernels launched by
the references vs by the fused path. Inputs fit in L2 at these sizes, so the times are the
L2-resident, launch-bound case that decode sees.
"""
import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.kernels.bf16_gemm import split_bf16  # noqa: E402
from engine.kernels.mhc_post import mhc_post, mhc_post_ref  # noqa: E402
from engine.kernels.mhc_pre import mhc_pre, mhc_pre_ref  # noqa: E402
from engine.kernels.rope_kv import rope_qkv, rope_qkv_ref  # noqa: E402
from engine.kernels.router import route, route_ref  # noqa: E402
from engine.kernels.sinkhorn import sinkhorn, sinkhorn_ref  # noqa: E402
from engine.model.rope import cos_sin, inv_freq  # noqa: E402

D, DH, R, E, K, W, HC = 4096, 512, 64, 256, 6, 128, 4


def inputs(T, H, dev="cuda", dt=torch.bfloat16):
    r = lambda *s: torch.randn(*s, device=dev)  # noqa: E731
    pos = torch.randint(0, 60000, (T,), device=dev)
    cos, sin = cos_sin(pos, inv_freq(R, 160000.0, None).to(dev))
    return dict(
        pre=(r(T, HC, D).to(dt), *split_bf16(r(24, HC * D) * 0.6 / (HC * D) ** 0.5), 1 + 0.1 * r(3), 0.5 * r(24),
             (1 + 0.05 * r(D)).to(dt), 20, 1e-6, 1e-6),
        sink=(2 * r(T, HC, HC), 20, 1e-6),
        post=(r(T, D).to(dt), r(T, HC, D).to(dt), 2 * torch.sigmoid(r(T, HC)),
              torch.softmax(r(T, HC, HC), -1)),
        rope=((r(T, H, DH).to(dt), r(T, DH).to(dt), (1 + 0.1 * r(DH)).to(dt), 1e-6, cos, sin),
              dict(positions=pos, ring=torch.zeros(T, W, DH, device=dev, dtype=dt),
                   slots=torch.arange(T, device=dev), fp8=True)),
        route=((2 * r(T, E), K, 1.5), dict(bias=0.1 * r(E))),
    )


def ops(x):
    """name -> (reference thunk, fused thunk)."""
    ra, rk = x["rope"]
    ga, gk = x["route"]
    return {
        "mhc_pre": (lambda: mhc_pre_ref(*x["pre"]), lambda: mhc_pre(*x["pre"])),
        "sinkhorn": (lambda: sinkhorn_ref(*x["sink"]), lambda: sinkhorn(*x["sink"])),
        "mhc_post": (lambda: mhc_post_ref(*x["post"]), lambda: mhc_post(*x["post"])),
        "rope_qkv": (lambda: rope_qkv_ref(*ra, **rk), lambda: rope_qkv(*ra, **rk)),
        "route": (lambda: route_ref(*ga, **gk), lambda: route(*ga, **gk)),
    }


def layer_glue(x, fused):
    """One block's glue in decode order; the sub-layer outputs are stand-ins (no GEMMs)."""
    o = {k: v[1 if fused else 0] for k, v in ops(x).items()}
    f = x["post"][0]
    _, post, comb = o["mhc_pre"]()
    o["rope_qkv"]()
    h = (mhc_post if fused else mhc_post_ref)(f, x["pre"][0], post, comb)
    _, post, comb = (mhc_pre if fused else mhc_pre_ref)(h, *x["pre"][1:])
    o["route"]()
    return (mhc_post if fused else mhc_post_ref)(f, h, post, comb)


def count_kernels(fn):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="T=1 and 64 only, short timing")
    ap.add_argument("--T", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--H", type=int, default=64, help="local query heads (64 = no TP)")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "CUDA only"
    Ts = [1, 64] if args.quick else args.T
    rep = 20 if args.quick else 100
    print(f"{'op':10} {'T':>4} {'torch us':>9} {'fused us':>9} {'speedup':>8}")
    for T in Ts:
        x = inputs(T, args.H)
        for name, (ref, fused) in ops(x).items():
            fused()
            t_ref = do_bench(ref, warmup=5, rep=rep, return_mode="median") * 1e3
            t_fused = do_bench(fused, warmup=5, rep=rep, return_mode="median") * 1e3
            print(f"{name:10} {T:4d} {t_ref:9.1f} {t_fused:9.1f} {t_ref / t_fused:7.1f}x")
    x = inputs(Ts[0], args.H)
    n_ref = count_kernels(lambda: layer_glue(x, False))
    n_fused = count_kernels(lambda: layer_glue(x, True))
    print(f"kernels per layer's glue (T={Ts[0]}, H={args.H}): torch {n_ref}, fused {n_fused}")


if __name__ == "__main__":
    main()
