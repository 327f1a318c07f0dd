"""engine.warmup: synthetic requests that meet the kernels' variants before real ones do (CPU, tiny model)."""
import pytest
import torch

from engine import LLM, SamplingParams


def _llm(tiny_ckpt, **kw):
    return LLM(tiny_ckpt("tiny", 0), device="cpu", dtype=torch.float32, numerics="plain", **kw)


def test_warm_up_runs_mixed_steps_and_leaves_nothing(tiny_ckpt):
    llm = _llm(tiny_ckpt, max_num_seqs=8, max_num_batched_tokens=256)
    core, cache = llm.engine, llm.cache
    prompts = [[1, 5, 6, 7, 8], [1] + list(range(20, 60))]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    before = [o.token_ids for o in llm.generate(prompts, params)]
    blocks, slots, stats = len(cache.free_blocks), sorted(cache.free_slots), dict(core.stats)

    steps = []
    schedule = core.scheduler.schedule

    def traced():
        plan = schedule()
        steps.append((len(plan.decode), [n for _, _, n in plan.prefill]))
        return plan
    core.scheduler.schedule = traced
    secs = llm.warm_up()
    del core.scheduler.schedule
    assert secs > 0
    # the budget-sized prompt alone, then every other length prefilled beside decode rows
    assert steps[0] == (0, [256])
    mixed = [(d, c) for d, c in steps if d and c]
    assert sorted(c[0] for _, c in mixed) == [2, 13, 16, 100]          # LENGTHS that fit 256 tokens
    assert [d for d, _ in mixed] == [1, 2, 3, 4]
    # nothing left behind: no request, blocks, slots or counts, and the same greedy tokens after
    assert not core.has_unfinished() and not core.requests
    assert len(cache.free_blocks) == blocks and sorted(cache.free_slots) == slots and core.stats == stats
    assert [o.token_ids for o in llm.generate(prompts, params)] == before


def test_warm_up_needs_an_idle_engine(tiny_ckpt):
    llm = _llm(tiny_ckpt, max_num_seqs=2)
    llm.engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="idle"):
        llm.warm_up()
