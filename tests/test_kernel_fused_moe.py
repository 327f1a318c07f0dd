"""Fused W4A16 MoE kernel (engine.kernels.fused_moe) against Experts.forward on the dequantized experts.

CPU: the kernels run under the Triton interpreter in child processes (this file run as a script
with a check name): TRITON_INTERPRET=1 is read when triton decorates the kernels, so setting it here
would leak into every later test module. The child patches the triton 3.6 interpreter's loop bounds
under numpy >= 2.4 (triton-lang/triton#9171); the kernels themselves do their math in fp32 there.
Packing, dequantization and the torch routing run in this process.
GPU (`pytest -m gpu`): per-rank shapes of V4-Flash (TP=8: 256 experts x I=256; EP: 32 experts x
I=2048; hidden 4096, top-6), batches 1..256, both formats, CUDA-graph replay against eager.

Tolerances: the kernel keeps gate/up in fp32 where the bf16 reference rounds them (each pair's
down-projection output it rounds to the model dtype, as the reference's F.linear does), so a bf16 run is checked against the reference in fp32 on the same bf16 inputs (<= 1e-2 per row,
relative to the row's max) and, looser, against the bf16 reference itself; fp32 runs <= 1e-4.
"""
import os
import sys
from contextlib import contextmanager

import pytest
import torch

from conftest import rel_err
from interp import finished, patch_interpreter, started
from engine.kernels import fused_moe as fm
from engine.kernels import moe_align as ma
from engine.kernels.swiglu import swiglu_act_ref
from engine.model import formats as F

LUT = torch.tensor(F.E2M1_VALUES)


# ----------------------------------------------------------------------------- data

def ckpt(fmt, E, R, C, device="cpu", seed=0, lo=120, hi=126):
    """One projection in checkpoint layout: random codes, scales in a realistic range."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(0, 256, (E, R, C // 2), dtype=torch.uint8, generator=g)
    if fmt == "mxfp4":
        s = torch.randint(lo, hi + 1, (E, R, C // 32), dtype=torch.uint8, generator=g)
        return w.to(device), s.view(torch.float8_e8m0fnu).to(device)
    s = (torch.rand(E, R, C // 16, generator=g) * 6 + 0.05).to(torch.float8_e4m3fn)
    return w.to(device), s.to(device), (torch.rand(E, generator=g) * 2e-2 + 1e-3).to(device)


def ref_dequant(fmt, proj):
    """Checkpoint-level dequant, independent of the packer: e2m1 * block scale (* global scale)."""
    w = proj[0].cpu().view(torch.uint8)
    codes = torch.stack((w & 0xF, w >> 4), -1).reshape(*w.shape[:-1], -1).long()
    vals = LUT[codes].double()
    if fmt == "mxfp4":
        s = torch.exp2(proj[1].cpu().view(torch.uint8).double() - 127)
        return vals * s.repeat_interleave(32, -1)
    s = proj[1].cpu().double().repeat_interleave(16, -1)
    return vals * s * proj[2].cpu().double()[:, None, None]


def experts(fmt, E, D, I, device="cpu", seed=0):
    projs = [ckpt(fmt, E, I, D, device, seed), ckpt(fmt, E, I, D, device, seed + 1), ckpt(fmt, E, D, I, device, seed + 2)]
    p = fm.pack_experts(*projs, fmt)
    return p, fm.dequant_experts(p)


def route(T, k, E, kind="random", device="cpu", seed=0):
    """(weights [T,k] fp32, ids [T,k] int64). skew: expert 0 never chosen, expert 1 in every token's
    slot 0; invalid: some ids are -1 or E (experts of another EP rank)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    if kind == "skew":
        ids = torch.stack([torch.cat((torch.tensor([1]), 2 + torch.randperm(E - 2, generator=g)[:k - 1])) for _ in range(T)])
    if kind == "invalid":
        ids[::2, 0] = -1
        ids[1::3, -1] = E
    w = torch.rand(T, k, generator=g) + 0.1
    return w.to(device), ids.to(device)


@contextmanager
def poisoned_empty():
    """Every torch.empty inside comes back full of NaN (floats) or a plausible wrong int."""
    real = torch.empty

    def empty(*a, **kw):
        t = real(*a, **kw)
        return t.fill_(float("nan") if t.is_floating_point() else 77)

    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = real


def check(packed, weights, T, k, dtype=torch.bfloat16, limit=10.0, kind="random", device="cpu", seed=0,
          tol=None, **kw):
    g = torch.Generator().manual_seed(seed + 1000)
    x = torch.randn(T, packed.D, generator=g).to(device=device, dtype=dtype)
    w, ids = route(T, k, packed.E, kind, device, seed)
    with poisoned_empty():
        out = fm.fused_moe(x, w, ids, packed, limit, **kw)
    assert out.shape == (T, packed.D) and out.dtype == torch.float32 and bool(torch.isfinite(out).all())
    ref = fm.fused_moe_ref(x.float(), w, ids, packed, limit, weights)
    err = rel_err(out, ref).max().item()
    assert err <= (tol or (1e-2 if dtype == torch.bfloat16 else 1e-4)), (T, k, kind, err)
    if dtype == torch.bfloat16:
        bf = fm.fused_moe_ref(x, w, ids, packed, limit, weights)
        assert rel_err(out, bf).max().item() <= 3e-2
    return out


# ----------------------------------------------------------------------------- torch side (this process)

@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_pack_is_lossless(fmt):
    E, D, I = 3, 256, 128
    projs = [ckpt(fmt, E, I, D, seed=1), ckpt(fmt, E, I, D, seed=2), ckpt(fmt, E, D, I, seed=3)]
    if fmt == "mxfp4":    # an expert of tiny scales and one of huge ones: the per-expert shift absorbs both
        projs[0][1].view(torch.uint8)[0] = torch.randint(0, 12, projs[0][1][0].shape, dtype=torch.uint8)
        projs[0][1].view(torch.uint8)[1] = torch.randint(242, 255, projs[0][1][1].shape, dtype=torch.uint8)
    else:                 # e4m3 subnormals, the smallest and largest scales, and a zero scale
        sb = projs[2][1].view(torch.uint8)
        sb[0, 0, :8] = torch.tensor([1, 2, 3, 5, 7, 8, 0x7E, 0])
    deq = fm.dequant_experts(fm.pack_experts(*projs, fmt))
    for got, proj in zip(deq, projs):
        want = ref_dequant(fmt, proj)
        assert torch.equal(got.double(), want.float().double()), (got.double() - want).abs().max()


def test_pack_checks_input():
    w, s = ckpt("mxfp4", 1, 128, 128)
    s.view(torch.uint8)[0, 0, 0] = 255
    with pytest.raises(ValueError, match="NaN"):
        fm.pack_experts((w, s), (w, s), (w, s), "mxfp4")
    w, s, s2 = ckpt("nvfp4", 1, 128, 128)
    s.view(torch.uint8)[0, 0, 0] = 0xB8                     # -1.0
    with pytest.raises(ValueError, match=">= 0"):
        fm.pack_experts((w, s, s2), (w, s, s2), (w, s, s2), "nvfp4")
    w, s = ckpt("mxfp4", 1, 128, 64)
    with pytest.raises(ValueError, match="multiples of 128"):
        fm.pack_experts((w, s), (w, s), (w, s), "mxfp4")


@pytest.mark.parametrize("T,k,E,bm,kind", [(1, 6, 256, 16, "random"), (200, 2, 8, 64, "skew"),
                                           (37, 3, 5, 16, "invalid"), (3000, 6, 32, 32, "random")])
def test_align_ref(T, k, E, bm, kind):
    _, ids = route(T, k, E, kind)
    sorted_ids, bexp = ma.moe_align_ref(ids, E, bm)
    P, B = ma.align_bounds(T * k, E, bm)
    assert sorted_ids.shape == (P,) and bexp.shape == (B,)
    flat, live = ids.reshape(-1), ((ids >= 0) & (ids < E)).reshape(-1)
    real = sorted_ids[sorted_ids < T * k].long()
    assert sorted(real.tolist()) == torch.nonzero(live).flatten().tolist()     # each live pair once
    for b in range(B):
        rows = sorted_ids[b * bm:(b + 1) * bm]
        rows = rows[rows < T * k].long()
        if bexp[b] < 0:
            assert rows.numel() == 0
        else:
            assert rows.numel() > 0 and bool((flat[rows] == bexp[b]).all())
            assert torch.equal(rows, rows.sort().values)                    # pair order inside an expert


def test_config_fills_the_gpu():
    bm, split = fm.moe_config(1, 6, 256, 256, 4096, 132)      # TP=8 decode: 24 tiles would idle the H200
    assert bm == 16 and split * 6 * (256 // 64) >= 132
    assert fm.moe_config(256, 6, 32, 2048, 4096, 132) == (64, 1)


def test_env_not_leaked():
    assert "TRITON_INTERPRET" not in os.environ


# ----------------------------------------------------------------------------- interpreter (child process)

SMALL = dict(E=8, D=256, I=128)


def _small(fmt):
    p, w = experts(fmt, **SMALL)
    ma.ALIGN_MAX = 0          # the torch routing (interp_align proves it equal); the interpreted sort is slow
    return p, w


def interp_align():
    ma.ALIGN_MAX = 4096
    for T, k, E, bm, kind in [(1, 6, 256, 16, "random"), (3, 2, 8, 16, "invalid"), (16, 6, 8, 16, "skew"),
                              (64, 2, 8, 32, "random"), (200, 2, 8, 64, "skew")]:
        _, ids = route(T, k, E, kind)
        with poisoned_empty():
            got = ma.moe_align(ids, E, bm)
        want = ma.moe_align_ref(ids, E, bm)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (T, k, E, bm, kind)


def _interp_batches(fmt):
    p, w = _small(fmt)
    for T in (1, 3, 16, 64, 200):
        check(p, w, T, 2, seed=T)
    for T in (3, 16):
        check(p, w, T, 2, torch.float32, seed=T)
    one = check(p, w, 3, 1, seed=11)             # one slot a token: the sum is that pair's output,
    assert torch.equal(one, one.bfloat16().float())   # rounded to the model dtype as F.linear's


def interp_mxfp4():
    _interp_batches("mxfp4")


def interp_nvfp4():
    _interp_batches("nvfp4")


def interp_uneven():
    for fmt in ("mxfp4", "nvfp4"):
        p, w = _small(fmt)
        check(p, w, 64, 3, kind="skew", seed=1)                  # expert 0 idle, expert 1 in every token
        check(p, w, 40, 2, kind="invalid", seed=2)               # ids of another rank contribute nothing
    check(p, w, 5, 6, torch.float32, limit=0.0, seed=3)          # no clamp
    check(p, w, 5, 6, torch.float32, limit=0.3, seed=4)          # clamps bite on both sides


def interp_split():
    p, w = _small("mxfp4")
    one = check(p, w, 9, 2, torch.float32, seed=5, split_k=1, block_m=32)
    two = check(p, w, 9, 2, torch.float32, seed=5, split_k=2, block_m=32)
    assert rel_err(one, two).max() <= 1e-6
    assert torch.equal(two, check(p, w, 9, 2, torch.float32, seed=5, split_k=2, block_m=32))


def interp_shared():
    """The shared expert's output added in the sum kernel: exactly routed + shared, in that order."""
    p, w = _small("mxfp4")
    for T, dt in ((3, torch.bfloat16), (5, torch.float32)):
        g = torch.Generator().manual_seed(T)
        x = torch.randn(T, p.D, generator=g).to(dt)
        sh = torch.randn(T, p.D, generator=g).to(dt)
        wt, ids = route(T, 2, p.E, seed=T)
        routed = fm.fused_moe(x, wt, ids, p, 10.0)
        got = fm.fused_moe(x, wt, ids, p, 10.0, shared=sh)
        assert torch.equal(got, routed + sh.float())
        ref = fm.fused_moe_ref(x.float(), wt, ids, p, 10.0, w, shared=sh)
        assert rel_err(got, ref).max().item() <= (1e-2 if dt == torch.bfloat16 else 1e-4)


def shared_expert_case(D, T, dt, fp8, limit=10.0, IS=256, device="cpu", seed=0):
    """The shared expert's (g, u [T,IS], w2 [D,IS], limit, fp8) in dt: fused_moe's shared_expert."""
    g = torch.Generator().manual_seed(seed)
    gu = [(torch.randn(T, IS, generator=g) * 2).to(device=device, dtype=dt) for _ in range(2)]
    w2 = (torch.randn(D, IS, generator=g) / IS ** 0.5).to(device=device, dtype=dt)
    return (*gu, w2, limit, fp8)


def shared_in_down(p, T, k, dt, fp8, seed, limit=10.0):
    """fused_moe with the shared expert made in its down kernel: alone (routing weights 0) it is the
    shared expert made apart (swiglu + F.linear) within the dtype's rounding; with the routed
    experts it is exactly fused_moe(shared=that output), with the slot sum in the down kernel and
    in _sum_kernel alike."""
    g = torch.Generator().manual_seed(seed)
    dev = p.w13.device
    x = torch.randn(T, p.D, generator=g).to(device=dev, dtype=dt)
    wt, ids = route(T, k, p.E, "invalid" if seed % 2 else "random", dev, seed)
    se = shared_expert_case(p.D, T, dt, fp8, limit, device=dev, seed=seed)
    with poisoned_empty():
        alone = fm.fused_moe(x, wt * 0, ids, p, 10.0, shared_expert=se)
    ref = torch.nn.functional.linear(swiglu_act_ref(*se[:2], limit, fp8, dt), se[2]).float()
    err = rel_err(alone, ref).max().item()
    assert err <= (1e-2 if dt == torch.bfloat16 else 1e-4), (T, dt, fp8, err)
    assert torch.equal(alone, alone.to(dt).float())       # rounded once to the model dtype, as F.linear
    want = fm.fused_moe(x, wt, ids, p, 10.0, shared=alone.to(dt))
    keep = fm.SUM_IN_DOWN_MAX_T
    try:
        for cut in (1 << 30, -1):           # the sum in the down kernel, then apart
            fm.SUM_IN_DOWN_MAX_T = cut
            with poisoned_empty():
                got = fm.fused_moe(x, wt, ids, p, 10.0, shared_expert=se)
            assert torch.equal(got, want), (T, k, dt, cut)
    finally:
        fm.SUM_IN_DOWN_MAX_T = keep


def interp_shared_in_down():
    p, _ = _small("mxfp4")
    for T, k, dt, fp8 in ((1, 6, torch.bfloat16, True), (3, 2, torch.float32, False), (16, 2, torch.bfloat16, False),
                          (5, 3, torch.bfloat16, True), (40, 2, torch.bfloat16, True)):
        shared_in_down(p, T, k, dt, fp8, seed=T)
    shared_in_down(p, 2, 2, torch.float32, True, seed=7, limit=0.3)            # the clamps bite


def sum_both_ways(p, T, k, dt, seed, shared=True):
    """fused_moe with the slot sum in the down kernel's last programs and in _sum_kernel: the same bits."""
    g = torch.Generator().manual_seed(seed)
    dev = p.w13.device
    x = torch.randn(T, p.D, generator=g).to(device=dev, dtype=dt)
    sh = torch.randn(T, p.D, generator=g).to(device=dev, dtype=dt) if shared else None
    wt, ids = route(T, k, p.E, "invalid" if seed % 2 else "random", dev, seed)
    keep = fm.SUM_IN_DOWN_MAX_T
    try:
        outs = []
        for limit in (1 << 30, -1):           # in the down kernel, then apart
            fm.SUM_IN_DOWN_MAX_T = limit
            with poisoned_empty():
                outs.append(fm.fused_moe(x, wt, ids, p, 10.0, shared=sh))
    finally:
        fm.SUM_IN_DOWN_MAX_T = keep
    assert torch.equal(outs[0], outs[1]), (T, k, dt)


def interp_sum_in_down():
    p, _ = _small("mxfp4")
    for T, k, dt in ((1, 6, torch.bfloat16), (5, 2, torch.float32), (9, 3, torch.bfloat16)):
        sum_both_ways(p, T, k, dt, seed=T)


CHECKS = ["interp_align", "interp_mxfp4", "interp_nvfp4", "interp_uneven", "interp_split", "interp_shared",
          "interp_sum_in_down", "interp_shared_in_down"]


@pytest.fixture(scope="module")
def children():
    """All interpreter checks start at once and are awaited per test."""
    with started(__file__, CHECKS) as procs:
        yield procs


@pytest.mark.parametrize("check_name", CHECKS)
def test_interpreter(children, check_name):
    finished(children[check_name], timeout=900)


# ----------------------------------------------------------------------------- GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
LAYOUTS = {"tp": dict(E=256, D=4096, I=256), "ep": dict(E=32, D=4096, I=2048)}
_cache = {}


def gpu_experts(fmt, layout):
    if (fmt, layout) not in _cache:
        _cache.clear()                        # one set at a time: the fp32 reference weights are GBs
        torch.cuda.empty_cache()
        _cache[fmt, layout] = experts(fmt, **LAYOUTS[layout], device="cuda")
    return _cache[fmt, layout]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 2, 8, 64, 256])
@pytest.mark.parametrize("layout", ["tp", "ep"])
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_gpu_real_shapes(fmt, layout, T):
    check(*gpu_experts(fmt, layout), T, 6, device="cuda", seed=T)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_gpu_fp32_path_and_uneven(fmt):
    p, w = gpu_experts(fmt, "tp")
    check(p, w, 3, 6, torch.float32, device="cuda")
    check(p, w, 256, 6, kind="skew", device="cuda", seed=1)
    check(p, w, 64, 6, kind="invalid", device="cuda", seed=2)
    check(p, w, 1, 6, device="cuda", seed=3, split_k=1)
    for T in (1, 8, 64):          # the slot sum in the down kernel == _sum_kernel's
        sum_both_ways(p, T, 6, torch.bfloat16, seed=T)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_gpu_shared_in_down(fmt):
    """The shared expert in the down kernel at one rank's real shapes (D 4096, IS 256)."""
    p, _ = gpu_experts(fmt, "tp")
    for T, fp8 in ((1, True), (8, False), (64, True)):
        shared_in_down(p, T, 6, torch.bfloat16, fp8, seed=T)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_gpu_asm_decode_equals_plain_ops(fmt):
    p, _ = gpu_experts(fmt, "ep")
    x = torch.randn(64, p.D, device="cuda").bfloat16()
    w, ids = route(64, 6, p.E, device="cuda")
    a = fm.fused_moe(x, w, ids, p, 10.0)
    assert torch.equal(a, fm.fused_moe(x, w, ids, p, 10.0, use_asm=False))
    assert torch.equal(a, fm.fused_moe(x, w, ids, p, 10.0))                        # deterministic


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 64, 256])
@pytest.mark.parametrize("layout", ["tp", "ep"])
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_gpu_cuda_graph_replay(fmt, layout, T):
    p, _ = gpu_experts(fmt, layout)
    cases = [(torch.randn(T, p.D, device="cuda").bfloat16(), *route(T, 6, p.E, "random", "cuda", s)) for s in (1, 2)]
    static = [t.clone() for t in cases[0]]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fm.fused_moe(*static[:1], static[1], static[2], p, 10.0)                  # compile, size the tickets
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fm.fused_moe(static[0], static[1], static[2], p, 10.0)
    for case in (cases[1], cases[0], cases[1]):
        for s, c in zip(static, case):
            s.copy_(c)
        graph.replay()
        assert torch.equal(out, fm.fused_moe(*case, p, 10.0))


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    patch_interpreter()
    globals()[sys.argv[1]]()
