"""mHC between two sub-layers, per sub-layer: mhc_post, the mix GEMM and mhc_pre (three launches);
mhc_post also making the next mix's partials + mhc_pre (two, --fused: with mhc_pre's Sinkhorn on a
side stream as the step runs it); mhc_post_pre (one launch and Sinkhorn on the side, at each
--post-pre-plans: channels and warps a program). 8 layers' distinct weights per CUDA graph; checks the streams equal and the
outputs close. Prints us per sub-layer (graph replay, median of 50) and the fused kernel's
registers and spills. H200 figures: bench/RESULTS.md, bench/results/post-mix-h200.json.

    python bench/post_mix.py [--T 1,16,64] [--sweep] [--fused] [--post-pre-plans 128:4,256:8]
"""
import argparse
import statistics
import sys

import torch

sys.path[:0] = [".", "tests"]
from engine.kernels.bf16_gemm import split_bf16
from engine.kernels import mhc_post as post_mod
from engine.kernels.mhc_post import mhc_post, mhc_post_pre
from engine.kernels.mhc_pre import mhc_pre
from engine.kernels.sinkhorn import sinkhorn_ref

D, L = 4096, 8


def timed(fn, reps=50):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record(); g.replay(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b) * 1e3 / L)
    return statistics.median(ts)


def registers():
    """(constexprs that differ, n_regs, n_spills) of each compiled _mhc_post_pre_kernel."""
    out = []
    for cache in getattr(post_mod._mhc_post_pre_kernel, "device_caches", {}).values():
        for k in cache[0].values():
            out.append((k.metadata.num_warps, getattr(k, "n_regs", None), getattr(k, "n_spills", None)))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", default="1,16,64")
    ap.add_argument("--sweep", action="store_true", help="the fused post + mix's tokens and channels a program")
    ap.add_argument("--fused", action="store_true", help="mhc_post + mix then mhc_pre with side, and mhc_post_pre")
    ap.add_argument("--post-pre-plans", default="128:4,256:8,128:8", help="channels:warps of mhc_post_pre")
    args = ap.parse_args()
    torch.manual_seed(0)
    side = torch.cuda.Stream()
    for T in map(int, args.T.split(",")):
        f = [torch.randn(T, D, device="cuda", dtype=torch.bfloat16) for _ in range(L)]
        res = [torch.randn(T, 4, D, device="cuda", dtype=torch.bfloat16) for _ in range(L)]
        post = 2 * torch.sigmoid(torch.randn(T, 4, device="cuda"))
        comb = sinkhorn_ref(torch.randn(T, 4, 4, device="cuda"), 20, 1e-6)
        fns = [split_bf16(torch.randn(24, 4 * D, device="cuda") * 0.6 / (4 * D) ** 0.5) for _ in range(L)]
        rest = (1 + 0.1 * torch.randn(3, device="cuda"), 0.5 * torch.randn(24, device="cuda"),
                (1 + 0.05 * torch.randn(D, device="cuda")).to(torch.bfloat16), 20, 1e-6, 1e-6)
        xa = torch.empty(T, D, device="cuda", dtype=torch.bfloat16)
        xq = (torch.empty(T, D, device="cuda", dtype=torch.float8_e4m3fn), torch.empty(T, D // 128, device="cuda"))

        def old():
            for i in range(L):
                h = mhc_post(f[i], res[i], post, comb)
                mhc_pre(h, *fns[i], *rest)

        def new(tb=None, bd=64):
            def run():
                for i in range(L):
                    h, m = mhc_post(f[i], res[i], post, comb, mix=(*fns[i], 1e-6), tokens_per_program=tb,
                                    mix_block_d=bd)
                    mhc_pre(h, *fns[i], *rest, mix=m)
            return run

        def two():      # the step's sub-layer boundary before mhc_post_pre: post + mix, collapse, Sinkhorn beside
            for i in range(L):
                h, m = mhc_post(f[i], res[i], post, comb, mix=(*fns[i], 1e-6), after=side)
                mhc_pre(h, *fns[i], *rest, mix=m, side=side, act_out=xa, act_q=xq)
            torch.cuda.current_stream().wait_stream(side)

        def one(bd, w):
            def run():
                for i in range(L):
                    mhc_post_pre(f[i], res[i], post, comb, *fns[i], *rest, after=side, act_out=xa, act_q=xq,
                                 side=side, block_d=bd, warps=w)
                torch.cuda.current_stream().wait_stream(side)
            return run

        h0 = mhc_post(f[0], res[0], post, comb)
        a = mhc_pre(h0, *fns[0], *rest)
        h1, m = mhc_post(f[0], res[0], post, comb, mix=(*fns[0], 1e-6))
        b = mhc_pre(h1, *fns[0], *rest, mix=m)
        err = max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))
        row = [f"T={T} eq_h={torch.equal(h0, h1)} maxdiff={err:.2e} old(post+mix+pre)={timed(old):.2f}us"]
        if args.sweep:
            for tb in sorted({1, min(4, T), min(8, T), min(16, T)}):
                for bd in (32, 64, 128):
                    row.append(f"tb{tb}/bd{bd}={timed(new(tb, bd)):.2f}")
        else:
            row.append(f"post+mix,pre={timed(new(None, None)):.2f}")
        if args.fused:
            row.append(f"two+side={timed(two):.2f}")
            for plan in args.post_pre_plans.split(","):
                bd, w = map(int, plan.split(":"))
                h2, (y2, p2, c2) = mhc_post_pre(f[0], res[0], post, comb, *fns[0], *rest, block_d=bd, warps=w)
                e2 = max((x.float() - y.float()).abs().max().item() for x, y in zip(a, (y2, p2, c2)))
                row.append(f"post_pre/bd{bd}w{w}={timed(one(bd, w)):.2f} (eq_h={torch.equal(h0, h2)} maxdiff={e2:.2e})")
        print(" ".join(row), flush=True)
    print("mhc_post_pre kernels (num_warps, registers, spills):", registers(), flush=True)


if __name__ == "__main__":
    main()
