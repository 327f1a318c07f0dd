"""Lightning indexer decode kernel (engine.kernels.indexer) against its torch reference.

CPU: the Triton interpreter runs in a child process. TRITON_INTERPRET=1 is read when triton
decorates the kernels, so it must be set before engine.kernels is imported, and setting it here
would leak into every later test module. The child patches two interpreter bugs of triton 3.6:
loop bounds computed in the kernel fail under numpy >= 2.4 (triton-lang/triton#9171), and a
bf16 tl.dot multiplies the uint16 bit patterns (#11584). GPU (`pytest -m gpu`): real shapes.
"""
import os
import sys
from pathlib import Path

import pytest
import torch

from conftest import rel_err
from interp import patch_interpreter, run_child
from engine.kernels import indexer as ix

ROOT = Path(__file__).resolve().parents[1]


def make_case(T, H, D, per_block, max_entries, n_visible, dtype, device="cpu", seed=0, bt_dtype=torch.long):
    """Random q, w, store; each row's blocks are distinct shuffled pool blocks (never block 0),
    plus one unused trailing table column as a real table has."""
    g = torch.Generator(device).manual_seed(seed)
    nb = -(-max_entries // per_block)
    pool = T * nb + 3
    bt = (torch.randperm(pool - 1, generator=g, device=device) + 1)[:T * nb].view(T, nb)
    bt = torch.cat((bt, torch.zeros(T, 1, dtype=bt.dtype, device=device)), 1).to(bt_dtype)
    rand = lambda *shape: torch.randn(*shape, generator=g, device=device)
    return dict(q=rand(T, H, D).to(dtype), w=rand(T, H), idx_k_store=rand(pool * per_block, D).to(dtype),
                block_table=bt, per_block=per_block,
                n_visible=torch.tensor(n_visible, dtype=torch.int32, device=device))


def boundary_gap(scores, n_visible, topk) -> float:
    """Smallest (k-th best - (k+1)-th best) score over rows that really choose (topk < n_visible),
    relative to the row's largest |score|; inf when no row chooses."""
    gap = float("inf")
    for t, nv in enumerate(n_visible.tolist()):
        if topk < nv:
            s = scores[t, :nv].double().topk(topk + 1).values
            gap = min(gap, float((s[-2] - s[-1]) / s.abs().max()))
    return gap


def check_selection(ids, loc, ref_scores, case, topk, tol) -> int:
    """Tie-aware: each row holds min(topk, n_visible) distinct visible ids, none clearly below the
    reference's k-th best score, every one clearly above it; loc is each id's store row, -1 with -1.
    -> the widest band of entries within tol of a k-th best score (1: no near-tie straddles it)."""
    ids, loc, ref = ids.long().cpu(), loc.long().cpu(), ref_scores.double().cpu()
    bt, pb = case["block_table"].long().cpu(), case["per_block"]
    band = 1
    assert ids.shape == loc.shape == (ref.shape[0], topk)
    for t, nv in enumerate(case["n_visible"].tolist()):
        k, some = min(topk, nv), ids[t] >= 0
        got = ids[t][some]
        assert got.numel() == k and got.unique().numel() == k and (got < nv).all(), (t, ids[t])
        assert (ids[t][~some] == -1).all() and (loc[t][~some] == -1).all()
        assert torch.equal(loc[t][some], bt[t, got // pb] * pb + got % pb)
        if k == 0 or k == nv:
            continue
        s = ref[t, :nv]
        kth = s.topk(k).values[-1]
        assert (s[got] >= kth - tol).all(), t
        assert torch.isin((s > kth + tol).nonzero().flatten(), got).all(), t
        band = max(band, int(((s - kth).abs() <= tol).sum()))
    return band


def run_case(case, topk, max_entries, device, **kw):
    """The kernel into poisoned outputs -> (ids, loc, scores), and the reference (ids, loc, scores)."""
    T = case["q"].shape[0]
    ids = torch.full((T, topk), 12345, dtype=torch.int32, device=device)
    loc = torch.full((T, topk), -777, dtype=torch.int32, device=device)
    buf = torch.full((T, max_entries), float("nan"), device=device)
    got = ix.indexer_topk(**case, topk=topk, max_entries=max_entries, out_ids=ids, out_loc=loc, score_buf=buf, **kw)
    assert got[0] is ids and got[1] is loc
    return (ids, loc, buf), ix.indexer_topk_ref(**case, topk=topk, max_entries=max_entries)


def check_scores(scores, ref, n_visible, tol):
    vis = torch.arange(ref.shape[1], device=ref.device) < n_visible[:, None].long()
    assert (scores[~vis] == float("-inf")).all() and (ref[~vis] == float("-inf")).all()
    assert scores[vis].isfinite().all()
    rows = n_visible > 0
    err = rel_err(scores[rows].masked_fill(~vis[rows], 0), ref[rows].masked_fill(~vis[rows], 0))
    assert (err <= tol).all(), err.max()
    return (scores - ref)[vis].abs().max() if vis.any() else torch.tensor(0.0)


# ---------------------------------------------------------------------------------------------------
# Interpreter checks: run in the child (see the module docstring); each raises on failure.

SCORE_CASES = [  # T, H, D, per_block, max_entries, n_visible, dtype, n_split
    (1, 8, 64, 4, 64, [64], torch.bfloat16, None),
    (3, 16, 128, 5, 100, [100, 0, 37], torch.bfloat16, 2),
    (5, 8, 64, 32, 130, [130, 1, 64, 65, 0], torch.float16, 1),
    (4, 16, 64, 3, 200, [7, 200, 150, 63], torch.bfloat16, 4),
    (2, 16, 128, 64, 192, [192, 129], torch.bfloat16, None),
]

TOPK_CASES = [  # T, H, D, per_block, max_entries, n_visible, topk, block-table dtype
    (1, 8, 64, 4, 40, [40], 4, torch.long),
    (3, 16, 128, 5, 100, [100, 0, 3], 8, torch.int32),
    (5, 8, 64, 7, 130, [130, 6, 64, 65, 0], 6, torch.long),
    (4, 16, 64, 3, 6, [6, 2, 0, 5], 8, torch.long),          # fewer entries than topk
    (2, 8, 128, 32, 70, [70, 8], 8, torch.int32),
    (2, 8, 64, 4, 8, [7, 8], 8, torch.long),                 # topk == max_entries: takes a masked slot
]


def interp_scores():
    for i, (T, H, D, pb, N, nv, dtype, n_split) in enumerate(SCORE_CASES):
        case = make_case(T, H, D, pb, N, nv, dtype, seed=i)
        buf = torch.full((T, N), float("nan"))
        out = ix.indexer_scores(**case, max_entries=N, out=buf, n_split=n_split)
        assert out is buf
        check_scores(buf, ix.indexer_scores_ref(**case, max_entries=N), case["n_visible"], 1e-4)
    # the model's head weights: the bf16 weights_proj output, scaled by (d * H)^-1/2 inside the op,
    # exactly as the step scaled it before (up, then multiply, in fp32)
    case = make_case(3, 16, 128, 5, 100, [100, 0, 37], torch.bfloat16, seed=9)
    case["w"], scale = case["w"].bfloat16(), 128 ** -0.5 * 16 ** -0.5
    ref = ix.indexer_scores_ref(**case, max_entries=100, w_scale=scale)
    assert torch.equal(ref, ix.indexer_scores_ref(**{**case, "w": case["w"].float() * scale}, max_entries=100))
    check_scores(ix.indexer_scores(**case, max_entries=100, w_scale=scale), ref, case["n_visible"], 1e-4)


def clear_case(T, H, D, pb, N, nv, topk, bt_dtype, seed):
    """A case whose reference leaves a clear gap at every row's top-k boundary (resampled until so)."""
    for s in range(seed, seed + 20):
        case = make_case(T, H, D, pb, N, nv, torch.bfloat16, seed=s, bt_dtype=bt_dtype)
        scores = ix.indexer_scores_ref(**case, max_entries=N)
        if boundary_gap(scores, case["n_visible"], topk) > 1e-3:
            return case
    raise AssertionError("no seed gave a clear top-k boundary")


def interp_topk(n_split=None):
    for i, (T, H, D, pb, N, nv, topk, bt_dtype) in enumerate(TOPK_CASES):
        case = clear_case(T, H, D, pb, N, nv, topk, bt_dtype, seed=10 * i)
        (ids, loc, scores), (rids, rloc, rscores) = run_case(case, topk, N, "cpu", n_split=n_split)
        assert boundary_gap(rscores, case["n_visible"], topk) > 1e-3     # the sets below are well defined
        check_scores(scores, rscores, case["n_visible"], 1e-4)
        assert check_selection(ids, loc, rscores, case, topk, tol=1e-5 * rscores.nan_to_num(0, 0, 0).abs().max()) == 1
        for t in range(T):                                                # same set, same rows
            pair = lambda a, b: sorted(zip(a[t].tolist(), b[t].tolist()))
            assert pair(ids, loc) == pair(rids, rloc), t


def interp_ties():
    """Integer data: exact scores, many exact ties at the boundary; the Triton top-k keeps the lowest ids."""
    T, H, D, pb, N, topk = 3, 8, 64, 4, 48, 6
    case = make_case(T, H, D, pb, N, [48, 30, 5], torch.bfloat16, seed=3)
    g = torch.Generator().manual_seed(3)
    case["q"] = torch.randint(-1, 2, (T, H, D), generator=g).bfloat16()
    case["w"] = torch.randint(1, 3, (T, H), generator=g).float()
    case["idx_k_store"] = torch.randint(-1, 2, case["idx_k_store"].shape, generator=g).bfloat16()
    case["idx_k_store"][(case["block_table"][1, :N // pb, None] * pb + torch.arange(pb)).flatten()] = 1
    (ids, loc, scores), (_, _, rscores) = run_case(case, topk, N, "cpu")
    assert torch.equal(scores, rscores)                                   # integers: exact
    check_selection(ids, loc, rscores, case, topk, tol=0)
    assert ids[1].tolist() == list(range(topk))                           # row 1: every score equal


def interp_fallback():
    """Rows wider than the register top-k take torch.topk; same outputs up to order."""
    ix.TOPK_MAX_ROW = ix.TOPK_IN_SCORE_MAX_ROW = 1
    interp_topk(n_split=1)


def interp_variants():
    """The top-k in the scores' launch (the row's last program) and in a launch of its own: the same
    ids and rows as the reference, ties included."""
    for fused in (True, False):
        ix.TOPK_IN_SCORE_MAX_ROW = (1 << 20) if fused else 0
        interp_topk()
        interp_topk(n_split=3)
        interp_ties()


def _interpret(check: str):
    run_child(__file__, check)


@pytest.mark.parametrize("check", ["interp_scores", "interp_topk", "interp_ties", "interp_fallback", "interp_variants"])
def test_interpreter(check):
    _interpret(check)


def test_env_not_leaked():
    assert "TRITON_INTERPRET" not in os.environ


# ---------------------------------------------------------------------------------------------------
# GPU: real shapes (H=64 indexer heads, d=128, topk=512, per_block = 128 tokens / ratio 4).

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
H, D, TOPK, PB = 64, 128, 512, 32


def ragged_visible(T, N, seed):
    """Row 0 sees everything, row 1 nothing, row 2 fewer than topk, the rest anywhere in [0, N]."""
    g = torch.Generator().manual_seed(seed)
    nv = torch.randint(0, N + 1, (T,), generator=g)
    nv[:3] = torch.tensor([N, 0, min(N, TOPK // 3)])[:T]
    return nv.tolist()


def gpu_check(T, N, seed=0):
    case = make_case(T, H, D, PB, N, ragged_visible(T, N, seed), torch.bfloat16, "cuda", seed)
    (ids, loc, scores), (_, _, rscores) = run_case(case, TOPK, N, "cuda")
    err = check_scores(scores, rscores, case["n_visible"], 1e-2)
    band = check_selection(ids, loc, rscores, case, TOPK, tol=2 * float(err) + 1e-6)
    assert band <= 3, band                        # near-ties at the boundary are rare: the check has teeth


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("N", [256, 2048, 8192])
@pytest.mark.parametrize("T", [1, 8, 64, 256])
def test_gpu_real_shapes(T, N):
    gpu_check(T, N)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("T,N", [(1, 2048), (64, 2048), (8, 4096)])
def test_gpu_select_variants(T, N, fused, monkeypatch):
    """The top-k in the scores' launch and in a launch of its own, whichever is the default."""
    monkeypatch.setattr(ix, "TOPK_IN_SCORE_MAX_ROW", 1 << 20 if fused else 0)
    gpu_check(T, N)


@pytest.mark.gpu
@needs_cuda
def test_gpu_wide_rows_fallback():
    gpu_check(8, 20000)                           # 20000 entries: wider than the register top-k


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T,N", [(1, 8192), (64, 2048), (256, 8192)])
def test_gpu_cuda_graph_replay(T, N):
    cases = [make_case(T, H, D, PB, N, ragged_visible(T, N, s), torch.bfloat16, "cuda", s) for s in (1, 2)]
    static = {k: v.clone() if torch.is_tensor(v) else v for k, v in cases[0].items()}
    ids, loc = (torch.empty(T, TOPK, dtype=torch.int32, device="cuda") for _ in range(2))
    buf = torch.empty(T, N, device="cuda")
    run = lambda: ix.indexer_topk(**static, topk=TOPK, max_entries=N, out_ids=ids, out_loc=loc, score_buf=buf)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()                                     # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for case in (cases[1], cases[0]):
        for k, v in case.items():
            if torch.is_tensor(v):
                static[k].copy_(v)
        graph.replay()
        e_buf = torch.empty_like(buf)
        e_ids, e_loc = ix.indexer_topk(**case, topk=TOPK, max_entries=N, score_buf=e_buf)
        torch.cuda.synchronize()
        assert torch.equal(buf, e_buf) and torch.equal(ids, e_ids) and torch.equal(loc, e_loc)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    patch_interpreter()
    globals()[sys.argv[1]]()
