"""Fused projections (engine.kernels.proj_gemm) against their torch reference.

CPU: the interpreter in a child process (tests/interp.py). Each case packs a group the way the
model does (FP8 rows, rows whose input is rounded to e4m3, bf16 and fp32 outputs) and checks
every projection against the reference: <= 1e-4 of the row's max-abs for fp32 outputs (both
accumulate exact products in fp32), <= 1e-2 for bf16 outputs (one rounding). The reference itself
is pinned to the plain math (fp8_sim'd x @ dequantised W) in test_ref_is_the_projections.
GPU (`pytest -m gpu`): the model's real groups at M = 1..256, and graph replay == eager.
"""
import os
import sys

import pytest
import torch

from conftest import rel_err
from interp import patch_interpreter, run_child
from engine.kernels import proj_gemm as pg
from engine.model.projections import W2_PLAN
from engine.model.formats import fp8_block_quant
from engine.numerics import fp8_block_dequant, fp8_codes_ref, fp8_sim_ref as fp8_sim


def segment(name, out, K, fp8, act, lo, device="cpu", seed=0, dtype=torch.bfloat16):
    """A projection as pack_proj takes it: FP8 ones are random e4m3 + E8M0 scales with the dense
    weight their exact dequantisation."""
    g = torch.Generator(device).manual_seed(seed)
    w = torch.randn(out, K, generator=g, device=device) * K ** -0.5
    if fp8:
        q, s = fp8_block_quant(w * torch.exp2(torch.randint(-3, 2, (out, 1), generator=g, device=device).float()))
        return name, fp8_block_dequant(q, s).to(dtype), (q, s), act, lo
    return name, w.to(dtype), None, act, lo


def group(kind, K, device="cpu", dtype=torch.bfloat16, fp8=True, act=True, sizes=None):
    """The model's groups: "x" (attention input: wq_a, wkv, weights_proj | compressors), "q" (the
    q latent: wq_b, idx.wq_b), "ffn" (w1, w3 | gate), "one" (a lone FP8 projection), "dense" (a
    lone bf16 one)."""
    s = sizes or {}
    spec = {
        "x": [("wq_a", s.get("q_lora", 256), fp8, act, True), ("wkv", s.get("head_dim", 128), fp8, act, True),
              ("idx.weights_proj", s.get("idx_heads", 8), False, False, True),
              ("comp.wkv", s.get("comp", 256), False, False, False), ("comp.wgate", s.get("comp", 256), False, False, False),
              ("idx.comp.wkv", s.get("idx_comp", 72), False, False, False),
              ("idx.comp.wgate", s.get("idx_comp", 72), False, False, False)],
        "q": [("wq_b", s.get("wq_b", 256), fp8, act, True), ("idx.wq_b", s.get("idx_wq_b", 128), fp8, act, True)],
        "ffn": [("w1", s.get("inter", 128), fp8, act, True), ("w3", s.get("inter", 128), fp8, act, True),
                ("gate", s.get("experts", 8), False, False, False)],
        "one": [("w", s.get("out", 384), fp8, act, True)],
        "dense": [("w", s.get("out", 384), False, False, True)],      # a lone bf16 projection (wo_a)
    }[kind]
    segs = [segment(n, o, K, f, a, lo, device, seed=i, dtype=dtype) for i, (n, o, f, a, lo) in enumerate(spec) if o]
    if not fp8:        # FP8-format weights held dense (a dequantised copy): still act-rounded
        segs = [(n, w, None, a, lo) for n, w, _, a, lo in segs]
    return segs, pg.pack_proj(segs, K, dtype, device)


def rand_x(M, K, dtype=torch.bfloat16, device="cpu", seed=1):
    g = torch.Generator(device).manual_seed(seed)
    x = torch.randn(M, K, generator=g, device=device)
    return (x * torch.exp2(torch.randint(-4, 4, (M, 1), generator=g, device=device).float())).to(dtype)


def check_group(ys, refs):
    assert ys.keys() == refs.keys()
    for name, y in ys.items():
        ref = refs[name]
        assert y.shape == ref.shape and y.dtype == ref.dtype and y.is_contiguous(), (name, y.shape, ref.shape)
        assert y.isfinite().all(), name
        tol = 1e-4 if y.dtype == torch.float32 else 1e-2
        err = rel_err(y, ref).max().item()
        assert err <= tol, (name, err)


def test_ref_is_the_projections():
    """The reference computes each projection as the model's unfused step did: fp8_sim(x) @ W^T for
    act rows, x @ W^T for the rest; lo outputs in x's dtype, hi in fp32."""
    K = 256
    for fp8 in (True, False):
        segs, p = group("x", K, fp8=fp8)
        x = rand_x(3, K)
        ys = pg.proj_gemm_ref(x, p)
        for name, w, _, act, lo in segs:
            want = (fp8_sim(x, 128) if act else x).float() @ w.float().T
            assert torch.allclose(ys[name].float(), want.to(ys[name].dtype).float(), rtol=0, atol=0), name
            assert ys[name].dtype == (torch.bfloat16 if lo else torch.float32)
    assert p.n8 == 0 and p.n_act == 384 and p.n_lo == 448 and p.N % pg.ROW_ALIGN == 0


def test_ref_norm_is_rms_norm_first():
    from engine.kernels.rms_norm import rms_norm_ref
    _, p = group("q", 256)
    x, nw = rand_x(4, 256), 1 + 0.3 * rand_x(1, 256, seed=5)[0]
    ys, want = pg.proj_gemm_ref(x, p, (nw, 1e-6)), pg.proj_gemm_ref(rms_norm_ref(x, nw, 1e-6), p)
    assert all(torch.equal(ys[k], want[k]) for k in want)


def test_pack_layout():
    segs, p = group("x", 256)
    assert (p.n8, p.n_act, p.n_lo) == (384, 384, 448)
    assert p.outs["idx.weights_proj"][:3] == (384, 384, 8)          # padded to ROW_ALIGN after it
    assert p.outs["comp.wkv"][:3] == (448, 0, 256)
    assert p.w8.shape == (384, 256) and p.wd.shape[0] == p.N - 384
    with pytest.raises(AssertionError, match="region order"):
        pg.pack_proj(segs[::-1], 256, torch.bfloat16, "cpu")


# ---------------------------------------------------------------------------------------------------
# Interpreter checks, in the child.

CASES = [  # kind, M, K, fp8 rows, act rounding, x dtype
    ("x", 1, 256, True, True, torch.bfloat16),
    ("x", 5, 256, True, False, torch.bfloat16),       # plain numerics: FP8 rows, no rounding
    ("x", 3, 384, False, True, torch.bfloat16),       # FP8 weights held dense, still rounded
    ("q", 17, 128, True, True, torch.bfloat16),       # two M tiles
    ("ffn", 2, 256, False, False, torch.float32),     # an fp32 model
    ("one", 1, 512, True, True, torch.bfloat16),
    ("dense", 2, 256, True, True, torch.bfloat16),     # a lone bf16 projection (wo_a)
]


def check_rows(x, p, refs):
    """rows: the named projections on those rows of their weight only (a split step's share of the
    compressors' channels) -> exactly those columns of the whole projection, in the rows' order;
    names: only those projections."""
    n = p.outs["comp.wkv"][2]
    rows = {"comp.wkv": torch.tensor([3, 0, n - 1], device=x.device),
            "idx.comp.wgate": torch.arange(8, 40, device=x.device)}
    want = {k: v[..., rows[k]] if k in rows else v for k, v in refs.items()}
    check_group(pg.proj_gemm(x, p, rows=rows), want)
    check_group(pg.proj_gemm_ref(x, p, rows=rows), want)
    names = ("wkv", "comp.wgate")              # only those projections (the router's own tokens)
    check_group(pg.proj_gemm(x, p, names=names), {k: refs[k] for k in names})
    check_group(pg.proj_gemm_ref(x, p, names=names), {k: refs[k] for k in names})


def interp_proj():
    for i, (kind, M, K, fp8, act, dt) in enumerate(CASES):
        _, p = group(kind, K, dtype=dt, fp8=fp8, act=act)
        x = rand_x(M, K, dt, seed=i)
        refs = pg.proj_gemm_ref(x, p)
        for split_k in (1, None, 3):
            check_group(pg.proj_gemm(x, p, split_k=split_k), refs)
        y = pg.proj_gemm(x.view(1, M, K), p)                        # leading dims kept
        assert all(t.shape[:2] == (1, M) for t in y.values())
        # the larger-M plans at a small M: x rounded once beforehand (pre_act); one GEMM per projection
        check_group(pg.proj_gemm(x, p, pre_act=True, block_m=128, num_stages=2, split_k=1), refs)
        check_group(pg.proj_gemm(x, p, unfused=True), refs)
        if kind == "x":
            check_rows(x, p, refs)
        # x's rounding made by its producer (mhc_pre's act_out): the same values the tiles round to
        xa = fp8_sim(x, 128)
        for kw in (dict(split_k=1), dict(split_k=3), dict(unfused=True)):
            want = pg.proj_gemm(x, p, **kw)
            assert all(torch.equal(want[k], v) for k, v in pg.proj_gemm(x, p, xa=xa, **kw).items()), (kind, kw)
            # and as e4m3 codes + scales (mhc_pre's act_q), which the FP8 rows dot directly
            got = pg.proj_gemm(x, p, xa=xa, xq=fp8_codes_ref(x, 128), **kw)
            assert all(torch.equal(want[k], v) for k, v in got.items()), (kind, kw, "xq")
    # the q latent group reads rms_norm(latent): normed inside the kernel, every split too
    for i, (M, K, act, dt) in enumerate([(1, 256, True, torch.bfloat16), (17, 384, True, torch.bfloat16),
                                        (3, 256, False, torch.float32)]):
        _, p = group("q", K, dtype=dt, act=act)
        x, nw = rand_x(M, K, dt, seed=10 + i), (1 + 0.3 * rand_x(1, K, dt, seed=20 + i)[0])
        refs = pg.proj_gemm_ref(x, p, (nw, 1e-6))
        for split_k in (1, None, 2):
            check_group(pg.proj_gemm(x, p, norm=(nw, 1e-6), split_k=split_k), refs)
        check_group(pg.proj_gemm(x, p, norm=(nw, 1e-6), unfused=True), refs)


def check_swiglu(p, M, K, limit, dtype=torch.bfloat16, device="cpu", seed=0, **kw):
    """The w2 group on SwiGLU(g, u) made in its K loop == the SwiGLU kernel then the group (the
    same bits: the same rounding to x's dtype, then the same FP8 rows), and the reference."""
    from engine.kernels.swiglu import swiglu_act
    g, u = rand_x(M, K, dtype, device, seed=seed), rand_x(M, K, dtype, device, seed=seed + 1)
    got = pg.proj_gemm(g, p, swiglu=(u, limit), **kw)
    want = pg.proj_gemm(swiglu_act(g, u, limit, False, dtype), p, **kw)
    assert all(torch.equal(got[k], want[k]) for k in want), (M, limit, kw)
    check_group(got, pg.proj_gemm_ref(g, p, swiglu=(u, limit)))
    return got


def interp_swiglu_w2():
    for act in (True, False):
        _, p = group("one", 256, act=act, sizes=dict(out=256))
        for M, limit in ((1, 0.0), (3, 2.0), (17, 2.0)):
            for split_k in (1, 2):
                check_swiglu(p, M, 256, limit, split_k=split_k)
        check_swiglu(p, 3, 256, 2.0, block_n=64, split_k=1)  # the step's plan (projections.W2_PLAN)
        check_swiglu(p, 2, 256, 2.0, unfused=True)          # prefill's path: the SwiGLU kernel first


@pytest.mark.parametrize("check_name", ["interp_proj", "interp_swiglu_w2"])
def test_interpreter(check_name):
    run_child(__file__, check_name)


# ---------------------------------------------------------------------------------------------------
# GPU: the groups at one TP=8 rank's real dims.

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
REAL = {  # kind -> (K, sizes)
    "x_csa": ("x", 4096, dict(q_lora=1024, head_dim=512, idx_heads=64, comp=1024, idx_comp=256)),
    "q": ("q", 1024, dict(wq_b=4096, idx_wq_b=8192)),
    "ffn": ("ffn", 4096, dict(inter=256, experts=256)),
    "wo_a": ("dense", 4096, dict(out=1024)),
    "wo_b": ("one", 1024, dict(out=4096)),
    "w2": ("one", 256, dict(out=4096)),
}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("M", [1, 5, 16, 64, 256, 1000, 2048])
@pytest.mark.parametrize("name", list(REAL))
def test_gpu_real_groups(name, M):
    kind, K, sizes = REAL[name]
    _, p = group(kind, K, "cuda", sizes=sizes)
    x = rand_x(M, K, device="cuda", seed=M) * 0.1
    refs = pg.proj_gemm_ref(x, p)
    for split_k in (None, 1):
        check_group(pg.proj_gemm(x, p, split_k=split_k), refs)
    check_group(pg.proj_gemm(x, p, pre_act=M < pg.LARGE_M, unfused=False), refs)   # the other way to round x
    check_group(pg.proj_gemm(x, p, unfused=M < pg.UNFUSED_M), refs)                # the other path
    if kind == "x":
        check_rows(x, p, refs)
    if kind != "q":     # x rounded by its producer (mhc_pre): the same bits as rounding it per tile
        want, got = pg.proj_gemm(x, p), pg.proj_gemm(x, p, xa=fp8_sim(x, 128))
        assert all(torch.equal(want[k], got[k]) for k in want)
        # and as its e4m3 codes + scales (act_q; taken at M tiles <= 16): the FP8 dot, the same bits
        got = pg.proj_gemm(x, p, xa=fp8_sim(x, 128), xq=fp8_codes_ref(x, 128))
        assert all(torch.equal(want[k], got[k]) for k in want)
    if kind == "q":     # the step's q group: the latent's RMSNorm inside the kernel
        nw = 1 + 0.3 * rand_x(1, K, device="cuda", seed=3)[0]
        refs = pg.proj_gemm_ref(x, p, (nw, 1e-6))
        for split_k in (None, 1):
            check_group(pg.proj_gemm(x, p, norm=(nw, 1e-6), split_k=split_k), refs)
        check_group(pg.proj_gemm(x, p, norm=(nw, 1e-6), unfused=M < pg.UNFUSED_M), refs)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("M", [1, 5, 16, 64])
def test_gpu_w2_swiglu(M):
    """The shared expert's w2 (one rank: 4096 x 256, FP8) on its SwiGLU made in the K loop == the
    SwiGLU kernel then the same group, bit for bit, at the step's sizes; graph replay == eager."""
    K, sizes = REAL["w2"][1:]
    _, p = group("one", K, "cuda", sizes=sizes)
    for limit in (0.0, 1.0):
        check_swiglu(p, M, K, limit, device="cuda", seed=M)
    g, u = (rand_x(M, K, device="cuda", seed=s) for s in (30, 31))
    for plan in ({}, W2_PLAN):
        check_swiglu(p, M, K, 1.0, device="cuda", seed=M, **plan)
        eager = pg.proj_gemm(g, p, swiglu=(u, 1.0), workspace="aux", **plan)["w"]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = pg.proj_gemm(g, p, swiglu=(u, 1.0), workspace="aux", **plan)["w"]
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name,M", [("x_csa", 1), ("q", 16), ("ffn", 64)])
def test_gpu_cuda_graph(name, M):
    kind, K, sizes = REAL[name]
    _, p = group(kind, K, "cuda", sizes=sizes)
    x = torch.zeros(M, K, dtype=torch.bfloat16, device="cuda")
    out = {}

    def run():
        out.update(pg.proj_gemm(x, p))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for seed in (7, 8):
        x.copy_(rand_x(M, K, device="cuda", seed=seed))
        expect = {k: v.clone() for k, v in pg.proj_gemm(x, p).items()}
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            for k, v in out.items():
                assert torch.equal(v, expect[k]), k
        check_group(out, pg.proj_gemm_ref(x, p))


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    patch_interpreter()
    globals()[sys.argv[1]]()
