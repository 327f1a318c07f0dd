"""Compressor.prefill (varlen, a fixed number of torch ops per step) against prefill_ref (the same
a row at a time): states and every store row, fp32 on the CPU, over two chained prefill steps whose
rows start mid-window, complete no window, one, or several."""
import types

import pytest
import torch

from engine.model.compressor import Compressor
from engine.model.kv_cache import StepInputs
from engine.model.rope import inv_freq

D, R, DIM = 128, 64, 24

# per ratio: two steps of (start, len) per row; row 2 is a one-token row (the decode op's, not ours)
CASES = {
    4: [[(0, 2), (3, 9), (6, 1), (5, 3), (0, 17), (2, 2)],
        [(2, 5), (12, 4), (7, 1), (8, 2), (17, 6), (4, 11)]],
    128: [[(0, 130), (100, 30), (40, 1), (127, 300), (200, 56), (5, 3)],
          [(130, 4), (130, 126), (41, 1), (427, 2), (256, 140), (8, 250)]],
}


def _comp(ratio, rotate, g):
    cfg = types.SimpleNamespace(ratio=lambda layer: ratio, rope_dim=R, norm_eps=1e-6, dim=DIM)
    comp = Compressor(cfg, 0, D, rotate=rotate)
    coff = 2 if ratio == 4 else 1
    comp.ape.data = torch.randn(ratio, coff * D, generator=g) * 0.5
    comp.norm.weight.data = 1 + 0.1 * torch.randn(D, generator=g)
    return comp


def _inputs(step, slots, table, bt):
    starts, lens = [s for s, _ in step], [n for _, n in step]
    pos = torch.cat([torch.arange(s, s + n) for s, n in step])[None]
    return StepInputs(ids=torch.zeros_like(pos), positions=pos, slots=slots, block_table=table, block_tokens=bt,
                      max_len=max(s + n for s, n in step), starts=starts, lens=lens)


@pytest.mark.parametrize("sim", [None, "fp8", "fp4"])
@pytest.mark.parametrize("ratio", [4, 128])
def test_varlen_prefill_equals_rows(ratio, sim):
    g = torch.Generator().manual_seed(ratio + len(sim or ""))
    comp = _comp(ratio, sim == "fp4", g)
    coff = 2 if ratio == 4 else 1
    B, n_slots, blocks, bt = len(CASES[ratio][0]), 9, 40, 2 * ratio
    st = (n_slots, coff * ratio, coff * D)
    kst, sst = torch.randn(st, generator=g), torch.randn(st, generator=g)   # stale junk where empty
    store = torch.full((blocks * (bt // ratio), D), float("nan"))
    ref = [kst.clone(), sst.clone(), store.clone()]
    slots = torch.randperm(n_slots, generator=g)[:B]
    table = (1 + torch.randperm(blocks - 1, generator=g)[:B * 6]).view(B, 6)
    inv = inv_freq(R, 10000.0, None)
    emitted = []
    for step in CASES[ratio]:
        inp, inp_ref = _inputs(step, slots, table, bt), _inputs(step, slots, table, bt)
        T = sum(n for _, n in step)
        kv, score = torch.randn(1, T, coff * D, generator=g), torch.randn(1, T, coff * D, generator=g)
        rows = inp.multi_rows()
        comp.prefill(kv, score, inp, rows, kst, sst, store, inv, torch.float32, sim)
        comp.prefill_ref(kv, score, inp_ref, rows, *ref, inv, torch.float32, sim)
        for a, b in zip((kst, sst, store), ref):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0, equal_nan=True)
        emitted.append([(s + n) // ratio - s // ratio for s, n in step])
    per_row = [e for step in emitted for e in step]
    assert 0 in per_row and 1 in per_row and max(per_row) >= 3          # the cases cover what they claim
    assert (~store.isnan().all(-1)).sum() >= 8


def test_prefill_ops_do_not_grow_with_rows():
    """Once the step's plan is built, a step of 2 rows and one of 5 issue the same torch ops (views aside)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += not func.is_view      # views launch nothing
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    comp, inv, counts = _comp(4, False, g), inv_freq(R, 10000.0, None), []
    for step in ([(3, 9), (0, 17)], [(3, 9), (0, 17), (5, 6), (8, 30), (1, 2)]):
        B = len(step)
        kst, sst = torch.randn(9, 8, 2 * D), torch.randn(9, 8, 2 * D)
        store = torch.zeros(80 * 2, D)
        inp = _inputs(step, torch.arange(B), (1 + torch.arange(B * 6)).view(B, 6), 8)
        T = sum(n for _, n in step)
        kv, score = torch.randn(1, T, 2 * D), torch.randn(1, T, 2 * D)
        comp.prefill(kv, score, inp, inp.multi_rows(), kst, sst, store, inv, torch.float32, None)  # builds the plan
        Count.n = 0
        with Count():
            comp.prefill(kv, score, inp, inp.multi_rows(), kst, sst, store, inv, torch.float32, None)
        counts.append(Count.n)
    assert counts[0] == counts[1], counts
