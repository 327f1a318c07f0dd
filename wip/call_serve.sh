#!/bin/bash
# The serving bench of one simulated TP=8 rank (ISL 8192, OSL 128), one level a run against one
# server, so that a level cut by the call's limit keeps the JSON of the levels before it. Needs
# .whl carried (see wip/README.md). The server's start takes ~300 s on a slow host (2026-12-07).
SITE=/tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE .whl/*.whl || exit 1
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep "Model name"; date -u
python -m engine.serve --simulate-tp 8 --max-num-seqs 64 --host 127.0.0.1 --port 8011 > $OUT/server.log 2>&1 &
t0=$(date +%s)
until curl -sf http://127.0.0.1:8011/health > /dev/null; do
    sleep 2; [ $(( $(date +%s) - t0 )) -gt 360 ] && { echo "server not ready"; tail -20 $OUT/server.log; exit 1; }
done
echo "server ready after $(( $(date +%s) - t0 )) s"
for lvl in "1 8" "16 64" "64 128"; do
    set -- $lvl
    timeout ${LEVEL_T:-200} python bench/serving.py --base-url http://127.0.0.1:8011 --input-len 8192 --output-len 128 \
        --concurrency $1 --num-prompts $2 --warmup $([ $1 = 1 ] && echo 1 || echo 0) \
        --json $OUT/serving-simtp8-c$1.json 2>&1 | tail -4
done
grep -iE "built|captur|warm-up" $OUT/server.log | head -5
