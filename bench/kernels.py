"""Kernel microbenchmarks at real decode dims, each next to its torch reference in the same run (CUDA).

    python bench/kernels.py [--quick] [--only fp8_gemm,mhc_mix] [--M 1 16 256]

Every row: do_bench medians in us under CUDA-graph replay (bench/timing.py: warm-up, L2 cleared
before each repetition, no Python launch cost, as decode runs them) of the kernel and of its
reference, then bytes / the measured copy bandwidth and FLOPs / the measured bf16 GEMM
rate. Both peaks are measured at the start of this run; the roofline time is the larger of the two
quotients and %roof is roofline / measured. fp8 rows count FLOPs against the bf16 peak (H200 fp8
dense is twice that), so their %peak reads high by design.
References: fp8 GEMMs -> cuBLAS bf16 on the dequantised weights (what a bf16 engine would run);
mhc_mix -> the model's fp32 torch _mix; bf16_gemm -> cuBLAS bf16.

Adding a kernel: write `@bench("name") def rows(ctx): yield Row(...)` in the marked section below
(ctx.time(fn) gives a median in us, ctx.Ms the batch sizes to sweep); main() runs BENCHES in order.
--quick keeps every bench under a few seconds: fewer M values and the production variant only.
"""
import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.timing import graph_us, measured_peaks  # noqa: E402
from engine.kernels import bf16_gemm as bg  # noqa: E402
from engine.kernels import fp8_gemm as fg  # noqa: E402
from engine.model.formats import fp8_block_dequant  # noqa: E402
from engine.model.mhc import _mix  # noqa: E402

BENCHES = {}                 # name -> rows(ctx) generator, in registration order


def bench(name):
    def register(fn):
        BENCHES[name] = fn
        return fn
    return register


@dataclass
class Row:
    kernel: str
    case: str
    M: int
    us: float
    ref_us: float
    bytes: float
    flops: float


@dataclass
class Ctx:
    quick: bool
    Ms: list
    bw: float = 0.0          # B/s, copy, bytes read + written
    peak: float = 0.0        # FLOP/s, cuBLAS bf16 8192^3

    @staticmethod
    def time(fn) -> float:
        return graph_us(fn)                                                    # us, graph replay

    def measure_peaks(self):
        self.bw, self.peak = measured_peaks()


# ----------------------------------------------------------------------------- fp8 GEMMs

FP8_SHAPES = {  # name -> N, K, groups, production mode (act_quant: DeepSeek runs wo_a in bf16)
    "wq_a": (1024, 4096, 1, True), "wq_b": (32768, 1024, 1, True), "wkv": (512, 4096, 1, True),
    "wo_a": (1024, 4096, 8, False), "wo_b": (4096, 8192, 1, True), "idx_wq_b": (8192, 1024, 1, True),
    "shared_w13": (2048, 4096, 1, True), "shared_w2": (4096, 2048, 1, True),
}


def random_fp8(NG, K):
    """Random e4m3 weights and E8M0 block scales (2^-10 .. 2^-4), made on the GPU."""
    w = (torch.randn(NG, K, device="cuda") * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.randint(117, 124, (-(-NG // 128), K // 128), device="cuda", dtype=torch.uint8)
    return w, s.view(torch.float8_e8m0fnu)


def fp8_ref_call(x, wb, G, N, K):
    """cuBLAS bf16 on the dequantised weight: one GEMM, or one batched GEMM over the groups."""
    if G == 1:
        return lambda: F.linear(x, wb)
    xg, wg = x.view(-1, G, K).transpose(0, 1), wb.view(G, N, K).transpose(1, 2)
    return lambda: torch.bmm(xg, wg)


@bench("fp8_gemm")
def fp8_rows(ctx):
    for name, (N, K, G, prod) in FP8_SHAPES.items():
        w, s = random_fp8(G * N, K)
        wb = fp8_block_dequant(w, s).bfloat16()
        for M in ctx.Ms:
            x = torch.randn(M, G * K, device="cuda").bfloat16()
            y = torch.empty(M, G * N, device="cuda", dtype=torch.bfloat16)
            ws = fg.SplitKWorkspace.sized_for([fg.fp8_gemm_need(M, N, K, G)], "cuda")
            ref_us = ctx.time(fp8_ref_call(x, wb, G, N, K))
            for act in ((prod,) if ctx.quick else (True, False)):
                us = ctx.time(lambda: fg.fp8_gemm(x, w, s, act_quant=act, groups=G, out=y, workspace=ws))
                p = fg.fp8_gemm_plan(M, N, K, G, "cuda")
                case = f"{name} {G}x{N}x{K} {'a8' if act else 'w8a16'} split{p.split.split}"
                nbytes = G * N * K + s.numel() + 2 * M * G * (K + N)
                yield Row("fp8_gemm", case, M, us, ref_us, nbytes, 2 * M * G * N * K)
        del w, s, wb


# ----------------------------------------------------------------------------- bf16 GEMMs

@bench("mhc_mix")
def mhc_rows(ctx):
    K = 16384
    for N, what in ((24, "hc_pre"), (4, "hc_head")):
        fn = torch.randn(N, K, device="cuda") * 0.01
        hi, lo = bg.split_bf16(fn)
        for M in ctx.Ms:
            h = torch.randn(M, 4, K // 4, device="cuda").bfloat16()
            out = torch.empty(M, N, device="cuda")
            ref_us = ctx.time(lambda: _mix(h, fn, norm_eps=1e-6))
            for lo_, tag in ((lo, "hi+lo"),) if ctx.quick else ((lo, "hi+lo"), (None, "hi")):
                # the planned split (None), then forced ones: a skinny N splits K many ways, and
                # the last split's serial sum of the partials is the latency to trade against
                for split in (None,) if ctx.quick else (None, 4, 8, 16, 32):
                    ws = fg.SplitKWorkspace.sized_for([bg.mhc_mix_need(M, N, K, split_k=split)], "cuda")
                    us = ctx.time(lambda: bg.mhc_mix(h, hi, lo_, 1e-6, out=out, workspace=ws, split_k=split))
                    nbytes = 2 * M * K + 2 * N * K * (2 if lo_ is not None else 1) + 4 * M * N
                    flops = 2 * M * N * K * (2 if lo_ is not None else 1)
                    yield Row("mhc_mix", f"{what} {N}x{K} {tag} split {split or 'auto'}", M, us, ref_us, nbytes, flops)


@bench("bf16_gemm")
def bf16_rows(ctx):
    for N, K in ((4096, 4096),) if ctx.quick else ((4096, 4096), (64, 4096), (8192, 1024)):
        b = torch.randn(N, K, device="cuda").bfloat16()
        for M in ctx.Ms:
            a = torch.randn(M, K, device="cuda").bfloat16()
            out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            ws = fg.SplitKWorkspace.sized_for([bg.bf16_gemm_need(M, N, K)], "cuda")
            ref_us = ctx.time(lambda: F.linear(a, b))
            us = ctx.time(lambda: bg.bf16_gemm(a, b, out=out, workspace=ws))
            yield Row("bf16_gemm", f"{N}x{K} bf16 out", M, us, ref_us, 2 * (N * K + M * K + M * N), 2 * M * N * K)


# ----------------------------------------------------------------------------- more kernels here
# (indexer, fused glue, ...): @bench("name") def rows(ctx): yield Row(kernel, case, M, us, ref_us,
# bytes, flops) -- bytes and flops are the kernel's essential traffic and math, not the reference's.


# ----------------------------------------------------------------------------- report

HEADER = (f"{'kernel':<10} {'case':<36} {'M':>4} {'us':>8} {'ref us':>8} {'x ref':>6} "
          f"{'GB/s':>7} {'%bw':>5} {'TFLOP/s':>8} {'%peak':>6} {'roof us':>8} {'%roof':>6}")


def fmt(r: Row, ctx: Ctx) -> str:
    roof = max(r.bytes / ctx.bw, r.flops / ctx.peak) * 1e6
    gbs, tfl = r.bytes / (r.us * 1e-6) / 1e9, r.flops / (r.us * 1e-6) / 1e12
    return (f"{r.kernel:<10} {r.case:<36} {r.M:>4} {r.us:>8.2f} {r.ref_us:>8.2f} {r.ref_us / r.us:>6.2f} "
            f"{gbs:>7.0f} {100 * gbs * 1e9 / ctx.bw:>5.0f} {tfl:>8.1f} {100 * tfl * 1e12 / ctx.peak:>6.1f} "
            f"{roof:>8.2f} {100 * roof / r.us:>6.0f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="M in (1, 64), production variants only")
    ap.add_argument("--only", default=None, help=f"comma list of {list(BENCHES)}")
    ap.add_argument("--M", type=int, nargs="+", default=None)
    args = ap.parse_args()
    Ms = args.M or ([1, 64] if args.quick else [1, 4, 16, 32, 64, 128, 256])
    ctx = Ctx(args.quick, Ms)
    ctx.measure_peaks()
    print(f"{torch.cuda.get_device_name()}: copy {ctx.bw / 1e12:.2f} TB/s (read + write), "
          f"bf16 GEMM 8192^3 {ctx.peak / 1e12:.0f} TFLOP/s, {fg.num_sms(torch.device('cuda'))} SMs")
    print(HEADER)
    names = args.only.split(",") if args.only else list(BENCHES)
    for name in names:
        for row in BENCHES[name](ctx):
            print(fmt(row, ctx), flush=True)


if __name__ == "__main__":
    main()
