#!/bin/bash
# The device call that would land wip/prefill-glue.patch (apply it first: git apply --3way
# wip/prefill-glue.patch). ~8 minutes on an H100 host: the compressor kernels' GPU tests (the decode
# kernel's finish refactored, the prefill finish and pool kernels), the 8k prefill with each lever
# off and both (TTFT, kernel time and launches a step per variant), the decode step at C = 1, 16, 64.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; lscpu | grep "Model name"; date -u
t0=$(date +%s)
timeout 200 python -m pytest -m gpu -q tests/test_kernel_glue.py \
    -k "compressor or compress_finish or compress_pool or kv_prep" 2>&1 | tail -4
echo "glue tests $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout 280 python bench/prefill.py --workloads 8192x1 --reps 3 --ab finish_kernel,pool_kernel,finish_kernel+pool_kernel \
    --by-kernel 25 --json $OUT/prefill-glue-ab.json 2>&1 | grep -v "^INFO" | tail -130
echo "prefill $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout 170 python bench/decode.py --layers 43 --contexts 8192 --batches 1,16,64 --average 32 \
    --out $OUT/decode-head.json 2>&1 | grep -v "^INFO" | tail -25
echo "decode $(( $(date +%s) - t0 )) s"
