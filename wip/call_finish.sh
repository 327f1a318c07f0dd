#!/bin/bash
# Apply first: git apply wip/compress-finish.patch (then run: device tool, carry nothing extra)
# call 1: the finish kernel's GPU tests, the 8k prefill A/B (finish_kernel) with per-variant profiles,
# the decode step (the compressor kernel refactored) at C=1,16,64.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; lscpu | grep "Model name"; date -u
git log --oneline -1 2>/dev/null
t0=$(date +%s)
timeout 200 python -m pytest -m gpu -q -x tests/test_kernel_glue.py -k "compressor or compress_finish or kv_prep" 2>&1 | tail -4
echo "glue tests $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout 260 python bench/prefill.py --workloads 8192x1 --reps 3 --ab finish_kernel --by-kernel 30 \
    --json $OUT/prefill-finish-ab.json 2>&1 | grep -v "^INFO" | tail -90
echo "prefill $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout 170 python bench/decode.py --layers 43 --contexts 8192 --batches 1,16,64 --average 32 \
    --out $OUT/decode-head.json 2>&1 | grep -v "^INFO" | tail -25
echo "decode $(( $(date +%s) - t0 )) s"
