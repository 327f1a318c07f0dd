#!/bin/bash
# `pytest -m gpu` in five file groups run side by side: the GPU test files compile many Triton
# kernels (CPU-bound) and each engine they build takes a 2 GiB cache, so on the H200 machine
# (16 cores) the suite takes ~2 minutes instead of >7 serially. Logs: $LOGS (default /tmp/gpu-logs);
# T: seconds per group (default 500). Exit status: non-zero if any group failed.
LOGS=${LOGS:-/tmp/gpu-logs}
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1
run() {
    name=$1; shift
    timeout "${T:-500}" python -m pytest -m gpu -q --durations=8 "$@" > "$LOGS/$name.log" 2>&1
    rc=$?
    echo "== $name rc=$rc"; grep -E "FAILED|ERROR|passed|failed" "$LOGS/$name.log" | tail -12
    return $rc
}
run gemm tests/test_kernel_gemm.py & a=$!
run moe tests/test_kernel_fused_moe.py tests/test_kernel_swiglu.py tests/test_kernel_indexer.py & b=$!
run glue tests/test_kernel_glue.py tests/test_kernel_sparse_attn.py tests/test_kernel_proj.py tests/test_sampler.py & c=$!
run model tests/test_gpu_model_kernels.py & d=$!
run graphs tests/test_gpu_graphs.py tests/test_gpu_prefill.py tests/test_gpu_overlap.py & e=$!
status=0
for p in $a $b $c $d $e; do wait $p || status=1; done
exit $status
