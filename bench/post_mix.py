"""mHC post + pre per sub-layer: mhc_post, the mix GEMM and mhc_pre (three launches) against
mhc_post also making the next mix's partials + mhc_pre (two), 8 layers' distinct weights per CUDA
graph, at T = 1, 16, 64, with a sweep of the fused launch's tokens (tb) and channels (bd) per
program; checks the streams equal and the outputs close. Prints us per sub-layer (graph replay).
H200 figures: bench/RESULTS.md, bench/results/post-mix-h200.json.
"""
import sys, torch, statistics
sys.path[:0] = [".", "tests"]
from engine.kernels.bf16_gemm import split_bf16
from engine.kernels.mhc_post import mhc_post
from engine.kernels.mhc_pre import mhc_pre
from engine.kernels.sinkhorn import sinkhorn_ref
torch.manual_seed(0)
D, L = 4096, 8
def timed(fn, reps=50):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s): fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g): fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record(); g.replay(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b) * 1e3 / L)
    return statistics.median(ts)
for T in (1, 16, 64):
    f = [torch.randn(T, D, device="cuda", dtype=torch.bfloat16) for _ in range(L)]
    res = [torch.randn(T, 4, D, device="cuda", dtype=torch.bfloat16) for _ in range(L)]
    post = 2 * torch.sigmoid(torch.randn(T, 4, device="cuda")); comb = sinkhorn_ref(torch.randn(T, 4, 4, device="cuda"), 20, 1e-6)
    fns = [split_bf16(torch.randn(24, 4 * D, device="cuda") * 0.6 / (4 * D) ** 0.5) for _ in range(L)]
    rest = (1 + 0.1 * torch.randn(3, device="cuda"), 0.5 * torch.randn(24, device="cuda"), (1 + 0.05 * torch.randn(D, device="cuda")).to(torch.bfloat16), 20, 1e-6, 1e-6)
    def old():
        for i in range(L):
            h = mhc_post(f[i], res[i], post, comb); mhc_pre(h, *fns[i], *rest)
    def new(tb=None, bd=64):
        def run():
            for i in range(L):
                h, m = mhc_post(f[i], res[i], post, comb, mix=(*fns[i], 1e-6), tokens_per_program=tb, mix_block_d=bd); mhc_pre(h, *fns[i], *rest, mix=m)
        return run
    h0 = mhc_post(f[0], res[0], post, comb); a = mhc_pre(h0, *fns[0], *rest)
    h1, m = mhc_post(f[0], res[0], post, comb, mix=(*fns[0], 1e-6)); b = mhc_pre(h1, *fns[0], *rest, mix=m)
    err = max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))
    row = [f"T={T} eq_h={torch.equal(h0, h1)} maxdiff={err:.2e} old(post+mix+pre)={timed(old):.2f}us"]
    for tb in sorted({1, min(4, T), min(8, T), min(16, T)}):
        for bd in (32, 64, 128):
            row.append(f"tb{tb}/bd{bd}={timed(new(tb, bd)):.2f}")
    print(" ".join(row), flush=True)
