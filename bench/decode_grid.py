"""This tree's engine/realdims.py (the real dims, random weights rounded onto the FP4/FP8 grids)
and engine/parallel/latency.py (the collectives' cost model), for the decode bench.

Loaded by path, not through `engine`: a --baseline run puts an older tree's engine first on the
path, and the grid rounding, dims and cost model must still be this tree's. Both files import
only torch (or nothing).
"""
import importlib.util
from pathlib import Path

ENGINE = Path(__file__).resolve().parent.parent / "engine"


def load_engine_file(rel: str, name: str):
    """engine/<rel> of this tree as a standalone module called `name`."""
    spec = importlib.util.spec_from_file_location(name, ENGINE / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_dims = load_engine_file("realdims.py", "_bench_realdims")
latency = load_engine_file("parallel/latency.py", "_bench_latency")
REAL, RATIOS, real_dict, init_random = _dims.REAL, _dims.RATIOS, _dims.real_dict, _dims.init_random
experts_modules, unpacked_experts = _dims.experts_modules, _dims.unpacked_experts
round_experts_mxfp4, round_experts_nvfp4, round_fp8_linears = (
    _dims.round_experts_mxfp4, _dims.round_experts_nvfp4, _dims.round_fp8_linears)
