"""bench/decode.py's CUDA-free parts: random experts rounded onto the FP4 grids pack for the fused
MoE (the bench refuses to time the torch fallback), the JSON rows, the --baseline child command."""
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
# appended, not prepended: bench/kernels.py must never shadow an installed `kernels` package
# (transformers >= 5.25 imports HF's `kernels` when it is installed)
sys.path.append(str(ROOT / "bench"))

from decode_grid import round_experts_mxfp4, round_experts_nvfp4, unpacked_experts  # noqa: E402
from decode_rows import make_row, side_by_side  # noqa: E402
from engine.model import formats as F  # noqa: E402
from engine.model.moe import Experts  # noqa: E402


def _model(seed=0, E=4, I=128, D=256):
    cfg = types.SimpleNamespace(n_routed_experts=E, moe_inter_dim=I, dim=D, swiglu_limit=10.0, expert_dtype="fp4")
    model = torch.nn.ModuleDict({"a": Experts(cfg, dtype=torch.bfloat16), "b": Experts(cfg, dtype=torch.bfloat16)})
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model


def test_random_experts_do_not_pack_until_rounded_to_mxfp4():
    model = _model()
    assert not model["a"].pack() and unpacked_experts(model) == ["a", "b"]
    before = model["b"].w2.clone()
    assert round_experts_mxfp4(model, F.mxfp4_quant, F.mxfp4_dequant, chunk=3) == 6
    rel = ((model["b"].w2.float() - before.float()).norm() / before.float().norm()).item()
    assert 0 < rel < 0.2                                       # rounded, not replaced
    w = model["a"].w1[2].float()
    assert torch.equal(F.mxfp4_dequant(*F.mxfp4_quant(w)), w)  # on the grid: a second rounding is exact
    assert model["a"].pack() and model["b"].pack()
    assert unpacked_experts(model) == [] and model["a"].packed.fmt == "mxfp4"


def test_random_experts_rounded_to_nvfp4_pack_their_codes():
    model = _model(seed=1)
    assert round_experts_nvfp4(model, F.nvfp4_quant, F.nvfp4_dequant) == 6
    parts = model["a"].nvfp4_parts
    assert [tuple(t.shape) for t in parts[2]] == [(4, 256, 64), (4, 256, 8), (4,)]
    assert model["a"].pack() and model["b"].pack() and unpacked_experts(model) == []
    assert model["a"].packed.fmt == "nvfp4"


def test_rows_and_side_by_side():
    kw = dict(ctx=8192, batch=4, kernel_set="default", layers=4, tp=8, nbytes=4.8e9, bandwidth=4.8e12,
              breakdown={"moe": 0.5, "glue": 0.2, "kernels": 400})
    old = make_row(variant="c478b5a", eager_s=3e-3, graph_s=2e-3, **kw)
    new = make_row(variant="HEAD", eager_s=2e-3, graph_s=1e-3, **kw)
    for k in ("ctx", "batch", "variant", "graph_ms", "kernels", "kernels_per_layer", "achieved_tbs", "roofline_ms",
              "eager_ms", "tok_s", "tok_s_with_allreduce", "bytes", "breakdown"):
        assert k in new, k
    assert new["kernels"] == 400 and new["kernels_per_layer"] == 100 and new["graph_ms"] == pytest.approx(1.0)
    assert new["roofline_ms"] == pytest.approx(1.0) and new["achieved_tbs"] == pytest.approx(4.8)
    lines = side_by_side([old, new])
    assert len(lines) == 3 and "c478b5a" in lines[1] and "HEAD" in lines[2] and "x2.00 vs c478b5a" in lines[2]
    # a batch the first variant did not run (--compiled's 1 and 64 beside ours at 16): compared with
    # the row that is there, and labelled so
    comp = make_row(variant="compiled", eager_s=3e-3, graph_s=4e-3, **kw)
    lone = make_row(variant="HEAD", eager_s=2e-3, graph_s=1e-3, **{**kw, "batch": 16})
    lines = side_by_side([comp, new, lone])
    assert "x4.00 vs compiled" in lines[2] and lines[3].split()[:3] == ["HEAD", "8192", "16"] and " vs " not in lines[3]
    other = make_row(variant="HEAD", eager_s=2e-3, graph_s=2e-3, **{**kw, "kernel_set": "none"})
    lines = side_by_side([new, other])
    assert "x0.50 vs HEAD" in lines[2] and "[none]" in lines[2]
    assert "x2.00 vs HEAD [none]" in side_by_side([other, new])[2]


def test_baseline_child_runs_this_script_on_the_other_tree(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))   # decode.py puts bench/ first: undo it after the test
    import decode

    args = decode.parse_args(["--quick", "--baseline", str(tmp_path), "--experts", "nvfp4"])
    cmd = decode.child_command(args, "c478b5a", "/tmp/rows.json")
    assert cmd[1] == str(Path(decode.__file__).resolve()) and "--baseline" not in cmd
    assert cmd[cmd.index("--variant") + 1] == "c478b5a" and cmd[cmd.index("--layers") + 1] == "4"
    assert cmd[cmd.index("--experts") + 1] == "nvfp4"
    with pytest.raises(SystemExit, match="no engine"):
        decode.run_baseline(args)
    assert decode.tree_label(tmp_path) == tmp_path.name


def test_levers_flip_a_constant_that_exists():
    """Every --ab lever names a module constant the engine has and a value other than its default:
    a lever set to the value it already has would time the same graph twice and report noise."""
    from importlib import import_module

    from levers import LEVERS, lever_off

    for name, (module, attr, flipped) in LEVERS.items():
        mod = import_module(module)
        default = getattr(mod, attr)
        assert flipped != default, f"lever {name}: {module}.{attr} is already {default!r}"
        with lever_off(name):
            assert getattr(mod, attr) == flipped
        assert getattr(mod, attr) == default
