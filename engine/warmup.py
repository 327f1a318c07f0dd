"""Warm-up: meet the kernels' compile-time variants before the first request does.

Triton compiles a kernel the first time a process launches it with a new specialisation: a tile
plan chosen by token count (kernels/*_plan), a power-of-two width, or an integer argument that is
1 or a multiple of 16 for the first time. The decode graphs compile theirs when they are captured
at start; eager steps (prefill chunks, mixed steps) compile on first use, and on a fresh machine
that stalled the first requests for seconds: one 16-request load after one warm request compiled
19 more variants, a 6 s first mixed step and a 9 s first short chunk (bench/RESULTS.md).

The warm-up runs synthetic requests through the engine's own scheduler, runner and sampler: one
prompt of the whole step budget (the prefill plans, the widest entry tables), then prompts whose
token counts land in each plan's buckets and integer classes, each prefilled while the earlier
ones decode (mixed steps with 1, 2, ... decode rows and chunks of every size class). It leaves no
request, cache block or count behind. A variant it misses (a rarer shape) still compiles on first
use; Triton's disk cache (~/.triton/cache) keeps every compiled variant for the next start.
"""
import logging
import time

from .sampler import SamplingParams

log = logging.getLogger(__name__)

# prompt lengths after the budget-sized one: the projections' cuBLAS path (>= 1024 tokens), their
# larger-M kernel plan (256..1023), the mid plans (17..255), small steps (<= 16: a multiple of 16,
# others, 1-token tails), each with the decode rows of the prompts before it added
LENGTHS = (1100, 300, 100, 16, 13, 2)


def warm_up(core, lengths=LENGTHS) -> float:
    """Run the warm-up requests on an idle EngineCore -> seconds taken."""
    if core.has_unfinished():
        raise RuntimeError("warm_up needs an idle engine")
    t0 = time.perf_counter()
    sched, vocab = core.scheduler, core.model.cfg.vocab_size
    longest = min(sched.max_num_batched_tokens, core.max_model_len - 2 * len(lengths) - 4)
    todo = [n for n in dict.fromkeys((longest, *lengths)) if 0 < n <= longest]
    # every request decodes until the last one has prefilled beside it
    params = SamplingParams(max_tokens=4 * len(todo) + 4, temperature=0, ignore_eos=True)
    stats = dict(core.stats)
    for i, n in enumerate(todo):
        rid = f"warm-up-{i}"
        try:
            core.add_request([(7919 * j + 1) % vocab for j in range(n)], params, request_id=rid)
        except ValueError as e:       # a prompt this cache cannot hold: skip it
            log.info("warm-up: skipped a %d-token prompt: %s", n, e)
            continue
        while core.has_unfinished() and not any(o.request_id == rid and o.token_ids for o in core.step()):
            pass
    while core.has_unfinished():
        core.step()
    core.stats.update(stats)
    secs = time.perf_counter() - t0
    log.info("warm-up: %d requests (%s prompt tokens) in %.1f s", len(todo), ",".join(map(str, todo)), secs)
    return secs
