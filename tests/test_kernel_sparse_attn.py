"""Sparse flash-decode MQA kernel (engine.kernels.sparse_attn) against its torch reference.

CPU: the Triton interpreter. triton reads TRITON_INTERPRET when it decorates a kernel, its own
library (tl.zeros, tl.cdiv, ...) included, so the variable must be set before triton is first
imported; in a pytest session other modules import it first, and setting it here would leak into
them. So `test_interpreter_suite` re-runs this file in a child pytest with TRITON_INTERPRET=1,
where the CPU tests below run (in the parent they are skipped). Run them directly, with per-test
output, by `TRITON_INTERPRET=1 python -m pytest tests/test_kernel_sparse_attn.py`. The child
patches three triton 3.6 interpreter bugs: loop bounds computed in the kernel fail under
numpy >= 2.4 (triton-lang/triton#9171), a bf16 tl.dot multiplies the uint16 bit patterns (#11584),
and fp32 -> bf16 casts truncate where the GPU rounds to nearest even (doubling the bf16 error).
GPU (`pytest -m gpu`): real shapes, bf16, CUDA-graph capture of the split pair.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import rel_err
from interp import child_env, patch_interpreter

ROOT = Path(__file__).resolve().parents[1]
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
cpu = pytest.mark.skipif(not INTERPRET, reason="runs in the interpreter child (test_interpreter_suite)")


def test_interpreter_suite():
    if INTERPRET:
        pytest.skip("this is the child")
    r = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-m", "not gpu"],
                       cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]


@pytest.fixture(scope="module")
def interp():
    """The kernel module, its kernels decorated for the interpreter (this is the child)."""
    patch_interpreter()
    from engine.kernels import sparse_attn
    return sparse_attn


def _distinct(g, T, n, k, device):
    """[T, k] distinct ids in [0, n) per row (k <= n)."""
    return torch.rand(T, n, generator=g, device=device).argsort(dim=1)[:, :k]


def make_case(T, H, D, Ka, Kb, dtype=torch.float32, device="cpu", seed=0, idx_dtype=torch.int32,
              n_a=None, n_b=None, spread=2.0):
    """Random inputs with ragged validity. n_a[t] valid window keys (the rest -1 at the front, as a
    sequence shorter than the window has), n_b[t] valid compressed ids (-1 padded at the end, as
    fewer candidates than top-k give). Defaults: a full window, random n_b, row 0 with no entries."""
    g = torch.Generator(device).manual_seed(seed)
    Na, Nb = max(4 * Ka, 64), max(4 * Kb, 64)
    n_a = [Ka] * T if n_a is None else n_a
    if n_b is None:
        n_b = torch.randint(0, Kb + 1, (T,), generator=g, device=device).tolist()
        n_b[0] = 0
    idx_a = _distinct(g, T, Na, Ka, device)
    idx_b = _distinct(g, T, Nb, Kb, device)
    col_a, col_b = torch.arange(Ka, device=device), torch.arange(Kb, device=device)
    idx_a = torch.where(col_a >= Ka - torch.tensor(n_a, device=device)[:, None], idx_a, -1)
    idx_b = torch.where(col_b < torch.tensor(n_b, device=device)[:, None], idx_b, -1)
    rand = lambda *s: torch.randn(*s, generator=g, device=device)
    return dict(q=(spread * rand(T, H, D)).to(dtype), kv_a=rand(Na, D).to(dtype), idx_a=idx_a.to(idx_dtype),
                kv_b=rand(Nb, D).to(dtype), idx_b=idx_b.to(idx_dtype), sink=2 * rand(H), scale=D ** -0.5)


def reference(mod, case):
    """fp32 reference on the (possibly bf16) inputs."""
    up = {k: (v.float() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in case.items()}
    return mod.sparse_mqa_ref(**up).float()


def poisoned(case):
    return torch.full_like(case["q"], float("nan"))


def run(mod, case, **kw):
    out = poisoned(case)
    o = mod.sparse_mqa(**case, out=out, **kw)
    assert o is out and not o.isnan().any()
    return o


# ---------------------------------------------------------------------------------------------------
# CPU, interpreter

# Every T meets every H once, and each (T, H) pair a different Kb and split count (the interpreter is
# too slow for the full product). Ka: 8, 16, 12 for T = 1, 2, 5.
GRID = [(1, 1, 0, 1), (1, 3, 40, 4), (1, 8, 7, 2), (1, 16, 33, 3),
        (2, 1, 40, 2), (2, 3, 0, 3), (2, 8, 33, 4), (2, 16, 7, 1),
        (5, 1, 33, 4), (5, 3, 7, 1), (5, 8, 40, 3), (5, 16, 0, 2)]


@cpu
@pytest.mark.parametrize("T,H,Kb,splits", GRID)
def test_fp32_matches_reference(interp, monkeypatch, T, H, Kb, splits):
    """BLOCK_N 16: up to 4 tiles, so the split counts are real (at the real BLOCK_N most would
    clamp to 1 or 2; the tests below run the real one)."""
    monkeypatch.setattr(interp, "BLOCK_N", 16)
    case = make_case(T, H, 128, {1: 8, 2: 16, 5: 12}[T], Kb, seed=100 * T + 10 * H + splits)
    o = run(interp, case, num_splits=splits)
    assert (o - reference(interp, case)).abs().max() <= 1e-4


@cpu
@pytest.mark.parametrize("H,T,splits", [(1, 1, 1), (3, 2, 2), (8, 3, 4), (16, 2, 3)])
def test_bf16_matches_fp32_reference(interp, H, T, splits):
    case = make_case(T, H, 128, 16, 40, dtype=torch.bfloat16, seed=H + T)
    o = run(interp, case, num_splits=splits)
    assert o.dtype == torch.bfloat16
    assert rel_err(o.float(), reference(interp, case)).max() <= 1e-2


@cpu
def test_every_split_count_agrees(interp):
    """1 split .. more splits than tiles (clamped): the same answer up to fp32 rounding."""
    interp_n = interp.BLOCK_N
    case = make_case(1, 8, 128, 16, 40, seed=7)
    ref = reference(interp, case)
    tiles = -(-16 // interp_n) + -(-40 // interp_n)
    for s in range(1, tiles + 3):
        assert (run(interp, case, num_splits=s) - ref).abs().max() <= 1e-4, s


@cpu
def test_small_tiles_many_splits(interp, monkeypatch):
    """BLOCK_N 16: tiles of both lists in one split, splits that start inside list b, a ragged tail."""
    monkeypatch.setattr(interp, "BLOCK_N", 16)
    case = make_case(2, 8, 128, 16, 40, seed=8)
    ref = reference(interp, case)
    for s in (3, 4):
        assert (run(interp, case, num_splits=s) - ref).abs().max() <= 1e-4, s


@cpu
def test_ragged_validity(interp):
    """Short sequences (mostly -1 window), rows without compressed entries, fewer candidates than
    top-k, and a row with no key at all (output 0: the sink takes all the mass)."""
    T, Ka, Kb = 5, 16, 24
    case = make_case(T, 8, 128, Ka, Kb, seed=9, n_a=[0, 1, 3, 16, 9], n_b=[0, 0, 5, 24, 1])
    ref = reference(interp, case)
    for s in (1, 2):
        o = run(interp, case, num_splits=s)
        assert (o - ref).abs().max() <= 1e-4
        assert (o[0] == 0).all()


@cpu
def test_list_b_absent(interp):
    case = make_case(2, 3, 128, 12, 0, seed=10)
    ref = interp.sparse_mqa_ref(**{**case, "kv_b": None, "idx_b": None})
    for s in (1, 2):
        o = run(interp, {**case, "kv_b": None, "idx_b": None}, num_splits=s)
        assert (o - ref).abs().max() <= 1e-4


@cpu
def test_head_groups_and_odd_width(interp, monkeypatch):
    """More heads than HEAD_TILE (several head groups per token), D = 192 (padded to 256)."""
    monkeypatch.setattr(interp, "HEAD_TILE", 8)
    assert interp.head_tiling(20) == (16, 3)
    case = make_case(1, 20, 192, 8, 20, seed=11, idx_dtype=torch.int64)
    ref = reference(interp, case)
    for s in (1, 2):
        assert (run(interp, case, num_splits=s) - ref).abs().max() <= 1e-4


@cpu
def test_strided_q_and_out(interp):
    """q and out as views into wider buffers (the engine's q may be a slice of a fused projection)."""
    case = make_case(2, 8, 128, 8, 20, seed=12)
    wide = torch.randn(2, 8, 256)
    wide[..., :128] = case["q"]
    buf = torch.full((2, 10, 128), float("nan"))
    o = interp.sparse_mqa(**{**case, "q": wide[..., :128]}, num_splits=2, out=buf[:, 1:9])
    assert (o - reference(interp, case)).abs().max() <= 1e-4
    assert buf[:, 0].isnan().all() and buf[:, 9].isnan().all()


@cpu
def test_workspace_reuse(interp):
    """A bucket's workspace (bigger T, more splits) serves smaller calls; the cache hands it back."""
    ws = interp.Workspace.get(4, 8, 128, 4, "cpu")
    assert interp.Workspace.get(4, 8, 128, 4, "cpu") is ws
    case = make_case(3, 8, 128, 16, 40, seed=13)
    o = run(interp, case, num_splits=3, workspace=ws)
    assert (o - reference(interp, case)).abs().max() <= 1e-4
    with pytest.raises(AssertionError):
        run(interp, make_case(5, 8, 128, 16, 40, seed=1), num_splits=2, workspace=ws)     # T 5 > 4


def rope_tables(T, R, device="cpu", seed=3):
    g = torch.Generator(device).manual_seed(seed)
    ang = torch.rand(T, R // 2, generator=g, device=device) * 6.3
    return ang.cos(), ang.sin()


def check_inverse_rope(mod, case, R, splits, **kw):
    """The epilogue's inverse RoPE equals the separate rope_q (inverse) of the plain output, bit for
    bit (same rounding, same pair math), and rope_q_ref of the reference."""
    from engine.kernels.rope_q import rope_q, rope_q_ref
    T = case["q"].shape[0]
    cos, sin = rope_tables(T, R, case["q"].device)
    plain = run(mod, case, num_splits=splits, **kw)
    fused = run(mod, case, num_splits=splits, rope=(cos, sin), **kw)
    assert torch.equal(fused, rope_q(plain, cos, sin, inverse=True)), splits
    ref = mod.sparse_mqa_ref(**case, rope=(cos, sin))
    assert torch.equal(ref, rope_q_ref(mod.sparse_mqa_ref(**case), cos, sin, inverse=True))
    assert not torch.equal(fused, plain)
    return fused, ref


@cpu
@pytest.mark.parametrize("dtype,D,R", [(torch.float32, 128, 64), (torch.bfloat16, 256, 64),
                                       (torch.bfloat16, 64, 16), (torch.float32, 32, 16)])
def test_inverse_rope_epilogue(interp, monkeypatch, dtype, D, R):
    """Single split (the split kernel stores o) and several (the combine does, in 64-channel chunks
    at D = 256 so the rope pairs sit in the last chunk only); D = 32 takes rope_q after."""
    monkeypatch.setattr(interp, "BLOCK_N", 16)
    monkeypatch.setattr(interp, "COMBINE_BLOCK_D", 64)
    case = make_case(3, 8, D, 16, 40, dtype=dtype, seed=D + R)
    for splits in (1, 3):
        fused, ref = check_inverse_rope(interp, case, R, splits)
        assert rel_err(fused.float(), ref.float()).max() <= (1e-4 if dtype == torch.float32 else 1e-2)


@cpu
def test_naive_matches_reference(interp):
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 1e-2)):
        case = make_case(3, 3, 128, 16, 40, dtype=dtype, seed=14)
        o = interp.sparse_mqa_naive(**case, out=poisoned(case))
        assert rel_err(o.float(), reference(interp, case)).max() <= tol


def test_choose_num_splits():
    from engine.kernels import sparse_attn as sa          # host arithmetic only: no interpreter
    sms = 132
    bn, mk = sa.BLOCK_N, sa.MIN_KEYS_PER_SPLIT
    for T in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        for K in (128, 148, 640, 2176, 100000):
            s = sa.choose_num_splits(T, K, sms)
            assert 1 <= s <= sa.MAX_SPLITS
            assert s == 1 or K / s >= mk - bn                      # no split below the minimum (one tile slack)
            tiles = -(-K // bn)
            assert (s - 1) * -(-tiles // s) < tiles                 # every split has tiles
            assert s == 1 or T * s <= 2 * sa.PROGRAMS_PER_SM * sms  # no more programs than needed
    assert sa.choose_num_splits(1, 640, sms) > 1                # T=1 splits
    assert sa.choose_num_splits(256, 640, sms) <= 2
    assert sa.choose_num_splits(256, 640, 128) == 1             # a big batch fills the GPU alone
    assert sa.choose_num_splits(1, mk - 1, sms) == 1            # too few keys to split


# ---------------------------------------------------------------------------------------------------
# GPU (`pytest -m gpu`): the compiled kernels at real shapes

def gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test))


@gpu
@pytest.mark.parametrize("Kb", [0, 20, 512, 2048])
@pytest.mark.parametrize("T", [1, 2, 4, 8, 16, 32, 64, 128, 256])
@pytest.mark.parametrize("H", [8, 16, 64])
def test_gpu_real_shapes(H, T, Kb):
    from engine.kernels import sparse_attn as sa
    case = make_case(T, H, 512, 128, Kb, dtype=torch.bfloat16, device="cuda", seed=T + H + Kb,
                     n_a=[128 - (t * 37) % 128 for t in range(T)], n_b=None)
    ref = reference(sa, case)
    o = run(sa, case)                                              # the chosen split count
    assert rel_err(o.float(), ref).max() <= 1e-2
    o1 = run(sa, case, num_splits=1)
    assert rel_err(o1.float(), ref).max() <= 1e-2


@gpu
@pytest.mark.parametrize("splits", [2, 5, 16])
def test_gpu_forced_splits(splits):
    from engine.kernels import sparse_attn as sa
    case = make_case(3, 64, 512, 128, 2048, dtype=torch.bfloat16, device="cuda", seed=splits)
    assert rel_err(run(sa, case, num_splits=splits).float(), reference(sa, case)).max() <= 1e-2


@gpu
@pytest.mark.parametrize("T,splits", [(1, 1), (1, None), (4, 1), (4, 5), (64, None)])
def test_gpu_inverse_rope(T, splits):
    """Real shape (D 512, rope on the last 64): the epilogue equals rope_q after, bit for bit."""
    from engine.kernels import sparse_attn as sa
    case = make_case(T, 8, 512, 128, 512, dtype=torch.bfloat16, device="cuda", seed=T)
    check_inverse_rope(sa, case, 64, splits)


@gpu
@pytest.mark.parametrize("H", [8, 64])
def test_gpu_naive(H):
    from engine.kernels import sparse_attn as sa
    case = make_case(4, H, 512, 128, 512, dtype=torch.bfloat16, device="cuda", seed=H)
    o = sa.sparse_mqa_naive(**case, out=poisoned(case))
    assert rel_err(o.float(), reference(sa, case)).max() <= 1e-2


@gpu
@pytest.mark.parametrize("T,H,Kb", [(1, 8, 512), (4, 64, 2048), (32, 8, 20)])
def test_gpu_cuda_graph(T, H, Kb):
    """Capture the split pair with a fixed out and workspace; replay on new inputs copied in place
    equals an eager call on them, bit for bit."""
    from engine.kernels import sparse_attn as sa
    case = make_case(T, H, 512, 128, Kb, dtype=torch.bfloat16, device="cuda", seed=1)
    splits = sa.choose_num_splits(T, 128 + Kb, sa.sm_count(torch.device("cuda")), sa.head_tiling(H)[1])
    ws = sa.Workspace.get(T, H, 512, max(splits, 2), "cuda")
    out = torch.full_like(case["q"], float("nan"))
    sa.sparse_mqa(**case, out=out, workspace=ws, num_splits=splits)          # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sa.sparse_mqa(**case, out=out, workspace=ws, num_splits=splits)
    new = make_case(T, H, 512, 128, Kb, dtype=torch.bfloat16, device="cuda", seed=2)
    for k in ("q", "kv_a", "idx_a", "kv_b", "idx_b", "sink"):
        case[k].copy_(new[k])
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    eager = sa.sparse_mqa(**new, num_splits=splits)
    assert torch.equal(out, eager)
    assert rel_err(out.float(), reference(sa, new)).max() <= 1e-2
