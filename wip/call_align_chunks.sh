#!/bin/bash
# The device call that would land wip/align-chunks.patch (apply it first: git apply --3way
# wip/align-chunks.patch). ~7 minutes: the chunked pair sort's GPU tests and the fused MoE's, its
# time against moe_align_ref and by chunk size at the 8k step's 49,152 pairs, the 8k prefill A/B
# (launches and kernel time per variant), the prefill GPU tests (the sort in the whole model).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep "Model name"; date -u
timeout 240 python -m pytest -m gpu -q tests/test_kernel_fused_moe.py -k "align or graph_replay" 2>&1 | tail -3
python - <<'PY'
import torch, sys
sys.path.insert(0, "tests")
from engine.kernels import moe_align as ma
from test_kernel_fused_moe import route
_, ids = route(8192, 6, 256, "random", "cuda", 0)
def med(f, n=50):
    f(); torch.cuda.synchronize(); ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); f(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b) * 1e3)
    return sorted(ts)[n // 2]
print(f"moe_align_ref 49,152 pairs: {med(lambda: ma.moe_align_ref(ids, 256, 64)):.1f} us (CUDA events, host launches included)")
for c in (1024, 2048, 4096):
    print(f"moe_align_chunks chunk {c}: {med(lambda: ma.moe_align_chunks(ids, 256, 64, c)):.1f} us")
PY
timeout 200 python bench/prefill.py --workloads 8192x1 --reps 3 --ab align_chunks --by-kernel 12 \
    --json $OUT/prefill-align-ab.json 2>&1 | grep -v "^INFO" | tail -40
timeout 150 python -m pytest -m gpu -q tests/test_gpu_prefill.py 2>&1 | tail -3
