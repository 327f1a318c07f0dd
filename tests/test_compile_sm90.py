"""The kernels compile for the H200 (sm_90), not only run under the interpreter.

The interpreter runs a kernel as Python, so code Triton's compiler rejects (a constexpr default it
cannot type, a variable redefined at another shape inside a branch) passes every CPU test and
fails on the GPU at its first launch; both happened (bench/RESULTS.md, eleventh session). Here the
launches of a selection of the interpreter cases (the glue cases of tests/test_kernel_glue.py and
the other kernel files' interp_* checks) are recorded in a child process, then each distinct
launch is compiled for sm_90 in this one (no GPU needed: bench/regs.py's two halves) and must
assemble without spilling.
"""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_regs", ROOT / "bench" / "regs.py")
regs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(regs)

# one case per kernel and variant that matters to the compiler (bf16, as the GPU runs them)
CASES = ("mhc_pre-T1-bfloat16", "mhc_pre-T3-bfloat16", "mhc_post-T3-bfloat16", "mhc_post_mix-T3-bfloat16",
         "sinkhorn-T7", "compressor-r4-bfloat16", "compressor-r16-bfloat16", "rms_norm-T1-D64-bfloat16",
         "rope_q-bfloat16", "rope-T3-bfloat16", "act_sim-fp8-b128-T1", "act_sim-fp4-b32-T1",
         "route-T1-E16-k3-topk", "route-T3-E8-k4-hashdup", "mhc_head-T3-bfloat16", "kv_prep-T3-csa",
         "kv_prep-T1-hca", "step_tables-B3", "step_tables-B7", "embed-T1-hc4-bfloat16",
         "mhc_post_pre-T3-bfloat16", "compress_finish-bfloat16-sim2", "compress_finish-bfloat16-sim1",
         "compress_pool-r4-split", "compress_pool-r128")
# (test module, interp_* check) of the other kernel files (the default kernel set's)
CHECKS = (("test_kernel_proj", "interp_proj"), ("test_kernel_proj", "interp_swiglu_w2"), ("test_kernel_fused_moe", "interp_mxfp4"),
          ("test_kernel_fused_moe", "interp_shared"), ("test_kernel_fused_moe", "interp_sum_in_down"),
          ("test_kernel_fused_moe", "interp_align"), ("test_kernel_fused_moe", "interp_shared_in_down"),
          ("test_kernel_gemm", "interp_bf16"), ("test_kernel_indexer", "interp_scores"),
          ("test_kernel_indexer", "interp_variants"), ("test_kernel_swiglu", "interp_swiglu"))

RECORD = f"""
import importlib.util, json, sys
sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / "tests")!r}]
from interp import patch_interpreter
patch_interpreter()
spec = importlib.util.spec_from_file_location("bench_regs", {str(ROOT / "bench" / "regs.py")!r})
regs = importlib.util.module_from_spec(spec); spec.loader.exec_module(regs)
import test_kernel_glue as t
cases = [(fn, kw) for name, (fn, kw) in t._cpu_cases().items() if any(name.startswith(c) for c in {CASES!r})]
import importlib
checks = [getattr(importlib.import_module(m), f) for m, f in {CHECKS!r}]
import torch, test_kernel_sparse_attn as sat
from engine.kernels import sparse_attn as sa
def attention():     # bf16, one split and three (the combine), with and without the inverse-RoPE epilogue
    c = sat.make_case(2, 8, 64, 8, 40, dtype=torch.bfloat16)
    for splits in (1, 3):
        sa.sparse_mqa(**c, num_splits=splits)
        sa.sparse_mqa(**c, num_splits=splits, rope=(torch.rand(2, 8), torch.rand(2, 8)))
checks.append(attention)
glue = regs.record_launches(lambda: [fn(**kw) for fn, kw in cases])
other = regs.record_launches(lambda: [fn() for fn in checks])
print(json.dumps(dict(glue=glue, checks=other), default=str))
"""


# kernels whose first tensor is fp32 in a bf16 model too (scores, sums, split partials)
FP32_FIRST = {"_topk_kernel", "_sum_kernel", "_combine_kernel", "_finish_kernel", "_pool_kernel"}


def gpu_variant(spec) -> bool:
    """Would the GPU launch this? Kernels run for bf16 models there (engine.kernels.runs_here); the
    interp_* checks also run fp32 models (their activations, the first tensor, fp32): variants
    only the interpreter runs. (The fused MoE's F32 switch is the interpreter's own math, which
    bench/regs.py puts back to the GPU's.)"""
    flat = [t for v in spec["sig"].values() for t in (v if isinstance(v, (list, tuple)) else [v])]
    first = next(t for t in flat if t.startswith("*"))
    return first != "*fp32" or spec["name"] in FP32_FIRST


def test_kernels_compile_for_sm90():
    out = subprocess.run([sys.executable, "-c", RECORD], env={**os.environ, "TRITON_INTERPRET": "1"},
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rec = json.loads(out.stdout.strip().splitlines()[-1])
    specs = rec["glue"] + [s for s in rec["checks"] if gpu_variant(s)]
    names = {s["name"] for s in specs}
    assert {"_mhc_pre_kernel", "_mhc_post_kernel", "_compress_kernel", "_sinkhorn_kernel", "_proj_kernel",
            "_gate_up_kernel", "_down_kernel", "_bf16_gemm_kernel", "_topk_kernel", "_split_kernel",
            "_combine_kernel", "_router_kernel", "_align_kernel", "_kv_prep_kernel",
            "_step_tables_kernel", "_embed_kernel", "_score_kernel", "_mhc_post_pre_kernel", "_finish_kernel",
            "_pool_kernel"} <= names, names
    failed = []
    for s in specs:
        try:
            r = regs.ptxas_report(s)
        except Exception as e:     # the compiler's own error, with the kernel line it points at
            failed.append(f"{s['name']} {s['const']}: {type(e).__name__}: {str(e)[-1500:]}")
            continue
        if r.get("spill_stores") or r.get("spill_loads"):
            failed.append(f"{s['name']} {s['const']}: spills {r}")
    assert not failed, "\n\n".join(failed)
