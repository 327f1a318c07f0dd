"""GEMM kernels (engine.kernels.fp8_gemm, engine.kernels.bf16_gemm) against their torch references.

CPU: the Triton interpreter runs in a child process, as in test_kernel_indexer (TRITON_INTERPRET=1 is
read when triton decorates the kernels, so setting it here would leak into later test modules). The
child patches the same two triton 3.6 interpreter bugs (in-kernel loop bounds under numpy >= 2.4,
#9171; bf16 tl.dot on the uint16 bit patterns, #11584). fp8 x fp8 tl.dot runs in the interpreter
(it widens e4m3 exactly to fp16 and multiplies in fp32), but its fp32 -> e4m3 cast rounds half up;
the kernel therefore rounds to the e4m3 grid itself first when interpreting (SW_ROUND), which makes
the cast exact, and the GPU tests cover the hardware cast (cvt.rn.satfinite).
Tolerances: rel_err (per row, vs the reference's max-abs) <= 1e-4 where both compute exact products
in fp32 (fp32 output), <= 1e-2 for bf16 outputs. GPU (`pytest -m gpu`): real shapes, CUDA graphs.
"""
import os
import sys
from pathlib import Path

import pytest
import torch

from conftest import rel_err
from interp import patch_interpreter, run_child
from engine.kernels import bf16_gemm as bg
from engine.kernels import fp8_gemm as fg
from engine.model.formats import e8m0_to_float, fp8_block_quant
from engine.numerics import fp8_sim_ref as fp8_sim

ROOT = Path(__file__).resolve().parents[1]


def make_fp8(N, K, device="cpu", seed=0, fp32_scale=False):
    """Random W [N, K] quantised to e4m3 + E8M0 block scales (spread over a few binades)."""
    g = torch.Generator(device).manual_seed(seed)
    w = torch.randn(N, K, generator=g, device=device)
    w = w * torch.exp2(torch.randint(-8, 2, (N, 1), generator=g, device=device).float())
    q, s = fp8_block_quant(w)
    return q, (e8m0_to_float(s) if fp32_scale else s)


def rand_x(M, K, dtype=torch.bfloat16, device="cpu", seed=1):
    g = torch.Generator(device).manual_seed(seed)
    x = torch.randn(M, K, generator=g, device=device)
    return (x * torch.exp2(torch.randint(-4, 4, (M, 1), generator=g, device=device).float())).to(dtype)


def check(y, ref, tol):
    assert y.shape == ref.shape and y.dtype == ref.dtype and y.isfinite().all()
    err = rel_err(y, ref)
    assert (err <= tol).all(), float(err.max())


def poisoned(shape, dtype, device="cpu"):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def tol_for(dtype):
    return 1e-4 if dtype == torch.float32 else 1e-2


# ---------------------------------------------------------------------------------------------------
# Interpreter checks: run in the child (see the module docstring); each raises on failure.

FP8_CASES = [  # M, N, K, groups, x dtype, fp32 scales
    (1, 256, 256, 1, torch.bfloat16, False),
    (3, 200, 384, 1, torch.bfloat16, False),     # ragged N: last scale row covers 72 rows
    (16, 128, 512, 1, torch.bfloat16, True),
    (3, 256, 256, 2, torch.bfloat16, False),     # grouped (wo_a layout)
    (16, 192, 128, 1, torch.float32, False),     # one K block: split-K has nothing to split
]


def interp_fp8():
    for i, (M, N, K, G, xdt, f32s) in enumerate(FP8_CASES):
        w, s = make_fp8(G * N, K, seed=i, fp32_scale=f32s)
        x = rand_x(M, G * K, xdt, seed=i)
        for act in (True, False):
            for split_k in (1, None, 3):
                for od in (torch.float32, torch.bfloat16):
                    kw = dict(act_quant=act, groups=G, split_k=split_k)
                    y = fg.fp8_gemm(x, w, s, out=poisoned((M, G * N), od), **kw)
                    check(y, fg.fp8_gemm_ref(x, w, s, out_dtype=od, **kw), tol_for(od))


def edge_rows(K):
    """Rows that probe the activation quantiser: amax exactly 448 * 2^k and its neighbours, e4m3
    ties (even and odd), subnormal codes, huge and tiny rows, an all-zero row."""
    base = torch.linspace(-1, 1, K)
    rows = [base * 1.75, base * 1.75 * 2 ** -6, torch.nextafter(base * 1.75, torch.tensor(9.0)),
            base * 1.7421875, torch.zeros(K), base * 3e4, base * 1e-6]
    ties = torch.tensor([1.0625, 1.1875, 0.5 + 2 ** -5, 2 ** -10, 3 * 2 ** -11, 448.0, 7 * 2 ** -10, 1.75])
    rows.append(ties.repeat(K // ties.numel()))
    return torch.stack(rows)


def interp_fp8_quant_exact():
    """Identity weight: y must be fp8_sim(x) bit for bit (act_quant) or x itself (W8A16)."""
    K = 256
    w, s = fp8_block_quant(torch.eye(K))
    for x in (edge_rows(K), rand_x(16, K, torch.float32, seed=5), rand_x(3, K, seed=6)):
        for split_k in (1, 2):
            y = fg.fp8_gemm(x, w, s, act_quant=True, out=poisoned(x.shape, torch.float32), split_k=split_k)
            assert torch.equal(y, fp8_sim(x, 128).float()), (y - fp8_sim(x, 128).float()).abs().max()
            y = fg.fp8_gemm(x, w, s, act_quant=False, out=poisoned(x.shape, torch.float32), split_k=split_k)
            assert torch.equal(y, x.float())


def interp_workspace():
    """One workspace serves GEMMs of different shapes in turn; tickets come back to zero; too small raises."""
    shapes = [(1, 256, 512), (3, 128, 384), (16, 256, 256)]
    ws = fg.SplitKWorkspace.sized_for([fg.fp8_gemm_need(M, N, K, split_k=3) for M, N, K in shapes]
                                      + [bg.mhc_mix_need(3, 24, 512, split_k=4)], "cpu")
    for i, (M, N, K) in enumerate(shapes * 2):
        w, s = make_fp8(N, K, seed=i)
        x = rand_x(M, K, seed=i)
        y = fg.fp8_gemm(x, w, s, workspace=ws, split_k=3)
        check(y, fg.fp8_gemm_ref(x, w, s), 1e-2)
        assert not ws.tickets.any()
        h, fn = torch.randn(3, 4, 128).bfloat16(), torch.randn(24, 512)
        check(bg.mhc_mix(h, *bg.split_bf16(fn), workspace=ws, split_k=4), bg.mhc_mix_ref(h, fn), 1e-4)
        assert not ws.tickets.any()
    small = fg.SplitKWorkspace(8, 1, "cpu")
    w, s = make_fp8(256, 512)
    with pytest.raises(ValueError, match="too small"):
        fg.fp8_gemm(rand_x(3, 512), w, s, workspace=small, split_k=2)


MHC_CASES = [  # M, hc, D, N
    (1, 4, 128, 24), (3, 4, 96, 24), (16, 4, 80, 4),   # D=80: K=320, a ragged last K block
]


def interp_mhc():
    for i, (M, hc, D, N) in enumerate(MHC_CASES):
        g = torch.Generator().manual_seed(i)
        h = (torch.randn(M, hc, D, generator=g) * 3).bfloat16()
        fn = torch.randn(N, hc * D, generator=g) * 0.05
        hi, lo = bg.split_bf16(fn)
        ref, ref_hi = bg.mhc_mix_ref(h, fn, 1e-6), bg.mhc_mix_ref(h, hi.float(), 1e-6)
        for split_k in (1, None, 3):
            out = poisoned((M, N), torch.float32)
            assert bg.mhc_mix(h, hi, lo, 1e-6, out=out, split_k=split_k) is out
            check(out, ref, 1e-4)                                        # hi + lo: fp32-grade
            check(bg.mhc_mix(h, hi, None, 1e-6, split_k=split_k), ref_hi, 1e-4)  # on bf16 fn
        h3 = h.view(1, M, hc, D)                                         # leading dims kept
        assert bg.mhc_mix(h3, hi, lo, 1e-6).shape == (1, M, N)


BF16_CASES = [  # batch (None: 2-D), M, N, K, b shared over the batch
    (None, 1, 64, 200, True), (2, 3, 40, 128, False), (3, 16, 130, 256, True),
]


def interp_bf16():
    for i, (B, M, N, K, shared) in enumerate(BF16_CASES):
        g = torch.Generator().manual_seed(i)
        lead = (B,) if B else ()
        a = torch.randn(*lead, M, K, generator=g).bfloat16()
        b = torch.randn(*(lead if not shared else ()), N, K, generator=g).bfloat16()
        for split_k in (1, None, 2):
            for od in (torch.float32, torch.bfloat16):
                out = poisoned((*lead, M, N), od)
                assert bg.bf16_gemm(a, b, out=out, split_k=split_k) is out
                check(out.view(-1, N), bg.bf16_gemm_ref(a, b, out_dtype=od).view(-1, N), tol_for(od))


def _interpret(check_name: str):
    run_child(__file__, check_name)


@pytest.mark.parametrize("check_name", ["interp_fp8", "interp_fp8_quant_exact", "interp_workspace",
                                        "interp_mhc", "interp_bf16"])
def test_interpreter(check_name):
    _interpret(check_name)


def test_env_not_leaked():
    assert "TRITON_INTERPRET" not in os.environ


def test_plans():
    """Decode shapes at M=1 fill the SMs; splits never exceed the K blocks nor come out empty."""
    for N, K in [(32768, 1024), (4096, 8192), (1024, 4096), (512, 4096), (2048, 4096)]:
        for M in (1, 16, 64, 256):
            p = fg.fp8_gemm_plan(M, N, K, device="cpu")
            n_kb = K // 128
            assert 1 <= p.split.split <= n_kb and (p.split.split - 1) * p.split.kb_per_split < n_kb
            if M == 1:
                assert p.grid[0] * p.grid[1] * p.grid[2] >= 132, (N, K, p)


# ---------------------------------------------------------------------------------------------------
# GPU: real decode shapes (N, K, groups, act_quant) at M = batch 1..256.

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
FP8_SHAPES = {
    "wq_a": (1024, 4096, 1), "wq_b": (32768, 1024, 1), "wkv": (512, 4096, 1), "wo_b": (4096, 8192, 1),
    "wo_a": (1024, 4096, 8), "idx_wq_b": (8192, 1024, 1), "shared_w13": (2048, 4096, 1),
    "shared_w2": (4096, 2048, 1),
}
GPU_M = [1, 5, 16, 64, 128, 256]


@pytest.fixture(scope="module")
def gpu_weights():
    cache = {}

    def get(name):
        if name not in cache:
            N, K, G = FP8_SHAPES[name]
            cache[name] = make_fp8(G * N, K, "cuda", seed=len(cache))
        return cache[name]
    return get


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("act", [True, False])
@pytest.mark.parametrize("M", GPU_M)
@pytest.mark.parametrize("name", list(FP8_SHAPES))
def test_gpu_fp8_real_shapes(gpu_weights, name, M, act):
    N, K, G = FP8_SHAPES[name]
    w, s = gpu_weights(name)
    x = rand_x(M, G * K, device="cuda", seed=M) * 0.1
    ref = fg.fp8_gemm_ref(x, w, s, act_quant=act, groups=G)
    for split_k in (None, 1):
        y = fg.fp8_gemm(x, w, s, act_quant=act, groups=G, split_k=split_k,
                        out=poisoned((M, G * N), torch.bfloat16, "cuda"))
        check(y, ref, 1e-2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("M", [1, 16, 256])
@pytest.mark.parametrize("N", [24, 4])
def test_gpu_mhc_mix(M, N):
    g = torch.Generator("cuda").manual_seed(M + N)
    h = torch.randn(M, 4, 4096, generator=g, device="cuda").bfloat16()
    fn = torch.randn(N, 16384, generator=g, device="cuda") * 0.01
    hi, lo = bg.split_bf16(fn)
    # Truth in fp64; hi alone is the GEMM of the bf16-rounded fn, judged on those weights. The
    # planned split (what the model runs: a skinny N always splits K) must be fp32-grade. The
    # forced single split exists to test that code path: one program accumulating 128 K blocks
    # in fp32 is measurably worse where a row's 4 outputs cancel (H200, 2026-12-03: 1.9e-4 of
    # the row's max-abs at M=256, N=4, against 3.3e-5 planned and < 5e-5 for cuBLAS fp32).
    for w, lo_ in ((fn, lo), (hi.float(), None)):
        truth = bg.mhc_mix_ref(h.double(), w.double(), 1e-6)
        for split_k, bar in ((None, 1e-4), (1, 5e-4)):
            y = bg.mhc_mix(h, hi, lo_, 1e-6, split_k=split_k).double()
            print(f"M={M} N={N} lo={lo_ is not None} split_k={split_k}: err {rel_err(y, truth).max().item():.2e}")
            check(y, truth, bar)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("B,M,N,K", [(None, 1, 4096, 4096), (None, 256, 512, 4096), (8, 16, 64, 128), (4, 1, 2048, 512)])
def test_gpu_bf16_gemm(B, M, N, K):
    g = torch.Generator("cuda").manual_seed(M)
    lead = (B,) if B else ()
    a = torch.randn(*lead, M, K, generator=g, device="cuda").bfloat16()
    b = torch.randn(*lead, N, K, generator=g, device="cuda").bfloat16()
    for od in (torch.float32, torch.bfloat16):
        y = bg.bf16_gemm(a, b, out_dtype=od)
        check(y.view(-1, N), bg.bf16_gemm_ref(a, b, out_dtype=od).view(-1, N), 1e-2)


def graph_vs_eager(run, inputs, fresh, outs, n_replay=3):
    """Capture run() over static inputs; replay with fresh data; each output must equal eager's bitwise."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()                                     # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for data in fresh:
        for t, d in zip(inputs, data):
            t.copy_(d)
        run()                                                     # eager, same workspace
        expect = [o.clone() for o in outs]
        for o in outs:
            o.fill_(float("nan"))
        for _ in range(n_replay):                                 # tickets reset: replays agree
            graph.replay()
            torch.cuda.synchronize()
            for o, e in zip(outs, expect):
                assert torch.equal(o, e)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name,M", [("wq_a", 1), ("wo_b", 1), ("wq_b", 1), ("wkv", 16), ("wo_a", 64), ("shared_w2", 256)])
def test_gpu_fp8_cuda_graph(gpu_weights, name, M):
    N, K, G = FP8_SHAPES[name]
    w, s = gpu_weights(name)
    ws = fg.SplitKWorkspace.sized_for([fg.fp8_gemm_need(M, N, K, G)], "cuda")
    x = torch.zeros(M, G * K, dtype=torch.bfloat16, device="cuda")
    y_q, y_w = (torch.empty(M, G * N, dtype=torch.bfloat16, device="cuda") for _ in range(2))

    def run():
        fg.fp8_gemm(x, w, s, act_quant=True, groups=G, out=y_q, workspace=ws)
        fg.fp8_gemm(x, w, s, act_quant=False, groups=G, out=y_w, workspace=ws)
    fresh = [(rand_x(M, G * K, device="cuda", seed=k),) for k in (7, 8)]
    graph_vs_eager(run, [x], fresh, [y_q, y_w])
    check(y_q, fg.fp8_gemm_ref(x, w, s, groups=G), 1e-2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("M", [1, 64])
def test_gpu_mhc_cuda_graph(M):
    fn = torch.randn(24, 16384, device="cuda") * 0.01
    hi, lo = bg.split_bf16(fn)
    ws = fg.SplitKWorkspace.sized_for([bg.mhc_mix_need(M, 24, 16384)], "cuda")
    h = torch.zeros(M, 4, 4096, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(M, 24, device="cuda")
    fresh = [(torch.randn(M, 4, 4096, device="cuda").bfloat16(),) for _ in range(2)]
    graph_vs_eager(lambda: bg.mhc_mix(h, hi, lo, 1e-6, out=out, workspace=ws), [h], fresh, [out])
    check(out, bg.mhc_mix_ref(h, fn, 1e-6), 1e-4)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    patch_interpreter()
    globals()[sys.argv[1]]()
