"""Batched, varlen prefill and mixed steps: several sequences' chunks (and decode rows) in one
model call give what each sequence gives alone, within the scheduler's token budget."""
import pytest
import torch

from conftest import rel_err, small_pool_llm
from engine import LLM, SamplingParams

TOL = 1e-4
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _ids(vocab, n, seed):
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _llm(tiny_ckpt, **kw):
    return LLM(tiny_ckpt("tiny", 0), device="cpu", dtype=torch.float32, numerics="plain", **kw)


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return _llm(tiny_ckpt, max_num_seqs=16)


class Calls:
    """Record each model call's step description (the runner's execute) and each sampled row's
    logits keyed by (request, sample, tokens so far)."""

    def __init__(self, llm):
        self.runner, self.steps, self.logits = llm.engine.runner, [], {}
        self.execute = self.runner.execute
        self.runner.execute = lambda step, *a: (self.steps.append(step), self.execute(step, *a))[1]
        self.runner.logits_hook = self.hook

    def hook(self, seqs, logits):
        for s, row in zip(seqs, logits):
            self.logits[(s.request_id, s.index, len(s.output_ids))] = row.clone()

    def close(self):
        self.runner.execute, self.runner.logits_hook = self.execute, None

    def prefills(self):
        return [s for s in self.steps if s["starts"] is not None]

    def of(self, rid):
        return [self.logits[k] for k in sorted(k for k in self.logits if k[0] == rid)]


def _alone(llm, prompts, params=GREEDY):
    """Each prompt on its own: its tokens and its sampled rows' logits."""
    out = []
    for p in prompts:
        calls = Calls(llm)
        res = llm.generate([p], params)[0]
        calls.close()
        out.append((res.token_ids, calls.of(res.request_id)))
    return out


def _same(outs, calls, alone):
    for o, (tokens, logits) in zip(outs, alone):
        assert o.token_ids == tokens
        mine = calls.of(o.request_id)
        assert len(mine) == len(logits)
        assert max(rel_err(a, b).item() for a, b in zip(mine, logits)) <= TOL


def test_sixteen_prompts_prefill_in_one_call(llm):
    """16 prompts of 1..61 tokens (across the window of 8 and the ratio-4 and ratio-16 windows):
    one varlen prefill call for all of them, then decode-only steps (the graph path's
    description: starts None), and each prompt's tokens and logits as when it runs alone."""
    V = llm.model.cfg.vocab_size
    prompts = [_ids(V, n, 100 + n) for n in (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 24, 33, 40, 47, 61)]
    alone = _alone(llm, prompts)
    calls = Calls(llm)
    outs = llm.generate(prompts, GREEDY)
    calls.close()
    prefills = calls.prefills()
    assert len(prefills) == 1 and len(prefills[0]["ids"]) == 16
    assert [len(r) for r in prefills[0]["ids"]] == [len(p) for p in prompts]
    assert len(calls.steps) == GREEDY.max_tokens            # then one decode call per token
    assert all(len(s["ids"]) == 16 and all(len(r) == 1 for r in s["ids"]) for s in calls.steps[1:])
    _same(outs, calls, alone)


def test_budget_splits_prefills_and_mixes_decode_rows(tiny_ckpt):
    """A budget of 24 tokens and chunks of at most 10: every call's prefill tokens stay within the
    budget (its decode rows within the budget too but for a chunk that finishes its prompt),
    several sequences share calls, decode rows ride in the prefill calls (mixed steps), same tokens."""
    llm = _llm(tiny_ckpt, max_num_seqs=6, chunk_size=10, max_num_batched_tokens=24)
    V = llm.model.cfg.vocab_size
    prompts = [_ids(V, n, 200 + n) for n in (3, 30, 11, 5, 22, 9)]
    alone = _alone(llm, prompts)
    calls, plans, schedule = Calls(llm), [], llm.engine.scheduler.schedule

    def recorded():
        plan = schedule()
        plans.append((len(plan.decode), sum(n for _, _, n in plan.prefill)))
        return plan
    llm.engine.scheduler.schedule = recorded
    outs = llm.generate(prompts, GREEDY)
    del llm.engine.scheduler.schedule
    calls.close()
    sizes = [sum(len(r) for r in s["ids"]) for s in calls.prefills()]
    assert max(p for _, p in plans) <= 24 and max(d + p for d, p in plans) <= 24 + 5
    assert sorted(sizes) == sorted(d + p for d, p in plans if p)
    assert max(max(len(r) for r in s["ids"]) for s in calls.prefills()) <= 10
    assert len(calls.prefills()) < len(prompts) + 2          # one at a time would take 9 chunks
    mixed = [s for s in calls.prefills() if any(len(r) == 1 and p[0] > 0 for r, p in zip(s["ids"], s["positions"]))]
    assert mixed, "no decode row rode in a prefill call"
    _same(outs, calls, alone)


def test_decode_keeps_going_while_a_long_prompt_prefills(tiny_ckpt):
    """A running sequence gets a token every step while a 45-token prompt prefills in chunks of 6:
    one model call per step, the decode row in it."""
    llm = _llm(tiny_ckpt, max_num_seqs=2, chunk_size=6)
    V = llm.model.cfg.vocab_size
    short, long = _ids(V, 5, 7), _ids(V, 45, 8)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    alone = _alone(llm, [short, long], params)
    eng = llm.engine
    calls = Calls(llm)
    a = eng.add_request(short, params)
    eng.step()                                        # a's prefill and first token
    b = eng.add_request(long, params)
    seq_a = eng.requests[a].seqs[0]
    counts, done = [], {}
    while len(done) < 2:
        before = len(seq_a.output_ids)
        n_calls = len(calls.steps)
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        assert len(calls.steps) == n_calls + 1        # one model call per step
        if not seq_a.finished:
            counts.append(len(seq_a.output_ids) - before)
    calls.close()
    assert len(counts) >= 8 and set(counts) == {1}    # 45 / 6 -> 8 chunks, a token each step
    assert sum(1 for s in calls.prefills() if len(s["ids"]) == 2) >= 8   # a's decode row rode along
    _same([done[a], done[b]], calls, alone)


def test_prompt_logprobs_across_a_batched_prefill(tiny_ckpt):
    """Prompt logprobs (every position of each chunk, in order) of several prompts prefilled
    together in chunks, n=2 siblings sharing one list, equal the one-at-a-time ones."""
    llm = _llm(tiny_ckpt, max_num_seqs=8, chunk_size=6)
    V = llm.model.cfg.vocab_size
    prompts = [_ids(V, n, 300 + n) for n in (4, 13, 1, 20)]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=3, n=2)
    alone = [llm.generate([p], params)[0] for p in prompts]
    calls = Calls(llm)
    outs = llm.generate(prompts, params)
    calls.close()
    assert max(len(s["ids"]) for s in calls.prefills()) >= 4
    for o, ref in zip(outs, alone):
        assert len(o.prompt_logprobs) == len(o.prompt_token_ids) and o.prompt_logprobs[0] is None
        # ranks count the vocabulary's values above the token's: in this random model's flat
        # distributions, neighbours an fp32 ulp apart may swap places
        assert max((abs(a - b) for a, b in zip(o.prompt_ranks[1:], ref.prompt_ranks[1:])), default=0) <= 3
        for mine, theirs in zip(o.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
            assert mine.keys() == theirs.keys()
            assert max(abs(mine[t] - theirs[t]) for t in mine) <= 1e-4
        assert [c.token_ids for c in o.outputs] == [c.token_ids for c in ref.outputs]


def test_abort_mid_prefill_in_a_batch(tiny_ckpt):
    """Aborting one of three sequences prefilling together: the others finish as alone, the
    aborted one's slot and blocks come back."""
    llm = _llm(tiny_ckpt, max_num_seqs=3, chunk_size=8)
    V = llm.model.cfg.vocab_size
    prompts = [_ids(V, n, 400 + n) for n in (30, 25, 40)]
    alone = _alone(llm, prompts)
    eng = llm.engine
    rids = [eng.add_request(p, GREEDY) for p in prompts]
    eng.step()
    assert all(eng.requests[r].seqs[0].num_computed == 8 for r in rids)   # all three mid-prefill
    assert eng.abort(rids[1])
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.token_ids
    assert [done[rids[0]], done[rids[2]]] == [alone[0][0], alone[2][0]]
    assert len(llm.cache.free_slots) == 3 and llm.cache.can_allocate(llm.cache.num_blocks - 1)


def test_preemption_with_batched_prefill(tiny_ckpt):
    """A pool of 4 usable blocks (64 tokens each) for four 50-token prompts growing to 70: all
    four prefill in one call, decode runs the pool dry, the latest arrivals are preempted and
    recomputed, and every sequence ends with its alone tokens; nothing leaks."""
    small = small_pool_llm(tiny_ckpt("tiny", 0), max_num_seqs=4, blocks=5)
    V = small.model.cfg.vocab_size
    prompts = [_ids(V, 50, 500 + i) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    alone = [small.generate([p], params)[0].token_ids for p in prompts]
    preempted = []
    orig = small.engine.scheduler.preempt
    small.engine.scheduler.preempt = lambda s: (preempted.append(s.request_id), orig(s))
    calls = Calls(small)
    outs = small.generate(prompts, params)
    calls.close()
    assert preempted, "the pool never ran out: the test does not exercise preemption"
    assert len(calls.prefills()[0]["ids"]) == 4
    assert [o.token_ids for o in outs] == alone
    assert small.cache.can_allocate(small.cache.num_blocks - 1), "blocks leaked"


def test_budget_below_max_num_seqs_is_rejected(tiny_ckpt):
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        _llm(tiny_ckpt, max_num_seqs=8, max_num_batched_tokens=4)


def test_scheduler_budget_and_prompt_logprob_room(tiny_ckpt):
    """The scheduler alone: decode rows count against the budget; chunks that record prompt
    logprobs share at most chunk_size tokens a step (their [V] logits rows), the others the rest."""
    from engine.sequence import Sequence

    llm = _llm(tiny_ckpt, max_num_seqs=8, chunk_size=16, max_num_batched_tokens=40)
    sched = llm.engine.scheduler
    plain, lp = SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, prompt_logprobs=0)
    seqs = [Sequence(f"r{i}", 0, list(range(2, 2 + n)), p)
            for i, (n, p) in enumerate([(12, lp), (30, lp), (30, plain), (30, plain)])]
    for s in seqs:
        s.prompt_logprobs = [None] if s.params.prompt_logprobs is not None else None
        sched.add(s)
    plan = sched.schedule()
    assert [(s.request_id, a, n) for s, a, n in plan.prefill] == [("r0", 0, 12), ("r1", 0, 4), ("r2", 0, 16),
                                                                  ("r3", 0, 8)]
    for s, a, n in plan.prefill:
        s.num_computed = a + n
    seqs[0].output_ids.append(5)                       # r0 decodes next: one token of the budget
    plan = sched.schedule()
    assert plan.decode == [seqs[0]]
    assert [(s.request_id, a, n) for s, a, n in plan.prefill] == [("r1", 4, 16), ("r2", 16, 14), ("r3", 8, 9)]
    for s in seqs:
        sched.finish(s, "abort")
    assert len(llm.cache.free_slots) == 8 and llm.cache.can_allocate(llm.cache.num_blocks - 1)


def test_a_prompt_that_fits_the_budget_is_not_cut_by_decode_rows(tiny_ckpt):
    """With d decode rows in the step, a prompt of up to the whole budget still prefills in one
    step (a chunk may pass the budget by the decode rows' count to finish its prompt; the step's
    prefill tokens stay within it): no tail of d tokens left for a step of its own. A longer
    prompt is cut at the budget less the decode rows; prompt-logprob chunks take no slack."""
    from engine.sequence import Sequence

    llm = _llm(tiny_ckpt, max_num_seqs=8, max_num_batched_tokens=40)
    sched = llm.engine.scheduler
    runs = [Sequence(f"d{i}", 0, [2, 3, 4], SamplingParams(max_tokens=8)) for i in range(3)]
    for s in runs:
        sched.add(s)
    for s, a, n in sched.schedule().prefill:
        s.num_computed = a + n
        s.output_ids.append(5)                              # each decodes from now on
    whole, longer = (Sequence("w", 0, list(range(2, 42)), SamplingParams(max_tokens=2)),
                     Sequence("x", 0, list(range(2, 44)), SamplingParams(max_tokens=2)))
    sched.add(whole)
    plan = sched.schedule()
    assert len(plan.decode) == 3 and [(s.request_id, a, n) for s, a, n in plan.prefill] == [("w", 0, 40)]
    whole.num_computed = 40
    sched.add(longer)
    plan = sched.schedule()                                  # (w, prefilled, samples nothing here)
    assert len(plan.decode) == 3 and [(s.request_id, a, n) for s, a, n in plan.prefill] == [("x", 0, 37)]
    lp = Sequence("p", 0, list(range(2, 42)), SamplingParams(max_tokens=2, prompt_logprobs=0))
    lp.prompt_logprobs = [None]
    for s in (longer, whole):
        sched.finish(s, "abort")
    sched.add(lp)
    assert [(s.request_id, a, n) for s, a, n in sched.schedule().prefill] == [("p", 0, 37)]
    for s in runs + [lp]:
        sched.finish(s, "abort")
    assert len(llm.cache.free_slots) == 8


def test_default_chunk_is_the_budget(tiny_ckpt):
    """Without chunk_size a prompt may take the whole step budget (one step for a prompt that fits),
    and prompt-logprob chunks still share at most PROMPT_LOGITS_TOKENS of it."""
    from engine.scheduler import PROMPT_LOGITS_TOKENS
    from engine.sequence import Sequence

    llm = _llm(tiny_ckpt, max_num_seqs=2, max_num_batched_tokens=600)
    sched = llm.engine.scheduler
    assert sched.chunk_size == 600 and sched.logit_tokens == PROMPT_LOGITS_TOKENS == 512
    long, lp = Sequence("a", 0, list(range(2, 552)), SamplingParams(max_tokens=2)), \
        Sequence("b", 0, list(range(2, 552)), SamplingParams(max_tokens=2, prompt_logprobs=0))
    lp.prompt_logprobs = [None]
    sched.add(long)
    sched.add(lp)
    plan = sched.schedule()
    assert [(s.request_id, a, n) for s, a, n in plan.prefill] == [("a", 0, 550), ("b", 0, 50)]
    for s in (long, lp):
        sched.finish(s, "abort")
    with pytest.raises(ValueError, match="chunk_size"):
        _llm(tiny_ckpt, chunk_size=0)


def test_debug_step_trace(tiny_ckpt, caplog):
    """--log-level debug: one line a step with its decode rows and prefill chunks."""
    import logging

    llm = _llm(tiny_ckpt, max_num_seqs=2)
    with caplog.at_level(logging.DEBUG, logger="engine.core"):
        llm.generate([[1, 5, 6, 7], [1, 8, 9]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    lines = [r.getMessage() for r in caplog.records if r.name == "engine.core" and r.getMessage().startswith("step:")]
    assert lines[0] == "step: 0 decode rows, 2 prefill chunks (7 tokens: [4, 3]), 0 waiting; first"
    assert lines[1].startswith("step: 2 decode rows, 0 prefill chunks") and "ms after the last" in lines[1]
