"""How every bench script measures: medians by triton's do_bench (warm-up first, L2 cleared
before each repetition, so weights come from HBM as in decode where each layer's are new),
CUDA-graph replay (how decode runs its kernels: no Python launch cost in the number), and the
machine's peaks measured in the same run (copy bandwidth counting bytes read + written; cuBLAS
bf16 GEMM at 8192^3)."""
import torch
from triton.testing import do_bench


def median_ms(fn, **kw) -> float:
    return do_bench(fn, return_mode="median", **kw)


def graphed(fn):
    """Capture fn (after a warm-up on a side stream that compiles it) and return the replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def graph_us(fn, **kw) -> float:
    """Median us of fn under CUDA-graph replay."""
    return median_ms(graphed(fn), **kw) * 1e3


def measured_peaks():
    """-> (copy bandwidth B/s, bf16 GEMM FLOP/s), measured now."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    bw = 2 * x.numel() / (median_ms(lambda: y.copy_(x)) * 1e-3)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    flops = 2 * 8192 ** 3 / (median_ms(lambda: a @ b) * 1e-3)
    del x, y, a, b
    torch.cuda.empty_cache()
    return bw, flops
