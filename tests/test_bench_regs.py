"""bench/regs.py's two halves on one small kernel: the launch recorded under the interpreter (a
child process), then compiled for sm_90 and read back from ptxas (this process, no GPU)."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# loaded by path, not by putting bench/ on sys.path: its kernels.py would shadow the `kernels`
# package transformers imports in later tests
_spec = importlib.util.spec_from_file_location("bench_regs", ROOT / "bench" / "regs.py")
regs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(regs)

RECORD = f"""
import json, sys, torch
sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / "bench")!r}]
from regs import record_launches
from engine.kernels.mhc_post import mhc_post
f, res = torch.randn(2, 256).to(torch.bfloat16), torch.randn(2, 4, 256).to(torch.bfloat16)
post, comb = torch.rand(2, 4), torch.rand(2, 4, 4)
print(json.dumps(record_launches(lambda: (mhc_post(f, res, post, comb), mhc_post(f, res, post, comb)))))
"""


def test_a_launch_recorded_and_its_registers_read():
    out = subprocess.run([sys.executable, "-c", RECORD], env={**os.environ, "TRITON_INTERPRET": "1"},
                         capture_output=True, text=True, timeout=600, check=True)
    specs = json.loads(out.stdout.strip().splitlines()[-1])
    assert [(s["name"], s["calls"]) for s in specs] == [("_mhc_post_kernel", 2)]
    s = specs[0]
    assert s["sig"]["f_ptr"] == "*bf16" and s["sig"]["D"] == "i32" and s["sig"]["HC"] == "constexpr"
    assert s["const"]["HC"] == 4 and s["const"]["BLOCK_D"] == 256 and s["opts"] == {"num_warps": 4}
    assert 0 in s["div"] and s["sig"]["post_ptr"] == "*fp32"        # 16-byte aligned tensors, as Triton specialises
    r = regs.ptxas_report(s)
    assert 8 <= r["registers"] <= 255 and r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["stack"] == 0
    assert 0 <= r["shared"] < 228 * 1024 and 1 <= r["per_sm"] <= 16      # 4 warps: at most 16 an SM


def test_programs_an_sm_holds():
    """The occupancy arithmetic against hand-worked cases (sm_90: 64K registers, 228 KB)."""
    assert regs.per_sm(54, 73728, 4) == 3          # shared memory: 233472 // 74752
    assert regs.per_sm(106, 53248, 4) == 4         # 112 registers x 128 threads: 4; shared: 4
    assert regs.per_sm(254, 16384, 4) == 2         # registers: 65536 // (256 x 128)
    assert regs.per_sm(16, 0, 4) == 16             # warps: 64 // 4
    assert regs.per_sm(16, 0, 1) == 32             # programs: 32
