"""engine.staging: a decode step staged incrementally into the decode graphs' static buffers
equals step_inputs built from scratch, step after step, as sequences join, finish and are
preempted, async scheduling on and off. On the CPU the graphs are never captured: replay runs
the same padded batch eagerly on the static buffers."""
import pytest
import torch

from engine import LLM, SamplingParams
from engine.graphs import DecodeGraphs
from engine.runner import step_inputs


def _ids(vocab, n, seed):
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _small(tiny_ckpt, blocks: int, seqs: int = 3):
    ckpt = tiny_ckpt("tiny", 0)
    probe = LLM(ckpt, device="cpu", dtype=torch.float32, max_num_seqs=seqs, numerics="plain")
    budget = probe.cache.slot_bytes() * probe.cache.max_num_seqs + probe.cache.block_bytes() * blocks
    return LLM(ckpt, device="cpu", dtype=torch.float32, max_num_seqs=seqs, kv_cache_memory=budget,
               numerics="plain", async_scheduling=False)


def _with_graphs(llm):
    eng = llm.engine
    graphs = DecodeGraphs(llm.model, eng.cache, eng.scheduler.max_num_seqs, llm.max_model_len, eng.cache.pad_slot)
    eng.runner.graphs = graphs
    checked = []
    replay = graphs.replay

    def check(b, n):
        """The staged buffers against step_inputs of the same rows, before the model reads them."""
        s = graphs.static
        got = (s.ids[:b].clone(), s.positions[:b].clone(), s.slots[:b].clone(), s.block_table[:b].clone())
        checked.append(got)
        return replay(b, n)
    graphs.replay = check
    return graphs, checked


# 3 rows (buckets 1, 2, 3: never padded) in a pool too small for them all: preemption;
# 6 rows (buckets 1, 2, 4, 6) in a roomy pool: batches that shrink into padded buckets
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("max_seqs,blocks", [(3, 5), (6, 64)])
def test_staged_inputs_equal_step_inputs(tiny_ckpt, overlap, max_seqs, blocks):
    llm = _small(tiny_ckpt, blocks, max_seqs)
    eng, runner = llm.engine, llm.engine.runner
    graphs, checked = _with_graphs(llm)
    expected, kinds, sizes = [], set(), set()

    def decode(seqs, prev=None):
        step = runner.decode_step(seqs)
        b = graphs.bucket(len(seqs))
        want = step_inputs(step, "cpu", eng.cache.block_tokens, rows=b, width=graphs.max_blocks,
                           pad_slot=eng.cache.pad_slot, prev=prev)
        expected.append((want.ids, want.positions, want.slots, want.block_table))
        sizes.add(len(seqs))
        kinds.add(all(s.pending and s.pending_row == i for i, s in enumerate(seqs)) if prev is not None else None)
        return orig(seqs, prev)
    orig, runner.decode = runner.decode, decode
    preempted = []
    pre = eng.scheduler.preempt
    eng.scheduler.preempt = lambda s: (preempted.append(s.pending), pre(s))
    V = llm.model.cfg.vocab_size
    lengths = (30, 26, 5, 28) if max_seqs == 3 else (30, 26, 5, 28, 9, 17, 3)
    prompts = [_ids(V, 40 if max_seqs == 3 else 40 - 3 * i, 60 + i) for i in range(len(lengths))]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in lengths]
    params[3] = SamplingParams(temperature=0.9, seed=3, max_tokens=28, ignore_eos=True, frequency_penalty=0.5)
    eng.async_scheduling = overlap
    outs = llm.generate(prompts, params)
    while eng.has_unfinished():
        eng.step()
    assert bool(preempted) == (max_seqs == 3), "the small pool must preempt (and only it)"
    assert len(checked) == len(expected) > 20
    if overlap:   # both ways of feeding pending tokens: one copy (an unchanged batch), a gather
        assert {True, False} <= kinds
    for got, want in zip(checked, expected):
        for g, w in zip(got, want):
            assert torch.equal(g, w)
    assert [len(o.token_ids) for o in outs] == list(lengths)
    if max_seqs == 6:
        assert len(sizes - set(graphs.buckets)) >= 2, "no step was padded to its bucket"


def test_staged_graph_path_gives_the_eager_tokens(tiny_ckpt):
    """The whole engine through the staged (uncaptured) graph path: the eager path's tokens."""
    llm = _small(tiny_ckpt, 64)
    V = llm.model.cfg.vocab_size
    prompts = [_ids(V, 20 + 3 * i, 70 + i) for i in range(3)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (12, 7, 15)]
    want = [o.token_ids for o in llm.generate(prompts, params)]
    _with_graphs(llm)
    for overlap in (False, True):
        llm.engine.async_scheduling = overlap
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
        while llm.engine.has_unfinished():
            llm.engine.step()
