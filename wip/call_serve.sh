#!/bin/bash
# The pool kernel's GPU tests (fixed), then the serving bench of one simulated TP=8 rank (ISL 8192,
# OSL 128, C = 1, 16, 64). Needs .whl carried (fastapi, uvicorn, pydantic, openai + httpx2, tokenizer).
export PYTHONUNBUFFERED=1
PYTHONPATH=$PWD timeout 100 python -m pytest -m gpu -q tests/test_kernel_glue.py -k "compress_pool" 2>&1 | tail -3
SITE=/tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE .whl/*.whl || exit 1
export PYTHONPATH=$SITE:$PWD
date -u
timeout ${SERVE_T:-400} python bench/serving.py --simulate-tp 8 --input-len 8192 --output-len 128 --concurrency 1,16,64 \
    --warmup 1 --server-timeout 300 --server-log $OUT/server.log --json $OUT/serving-simtp8.json 2>&1 | tail -30
echo "serving rc=$?"; date -u; grep -iE "ready|built|captur|warm|took" $OUT/server.log | head -12
