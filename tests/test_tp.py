"""Tensor parallelism on CPU (gloo): TP=2 and TP=4 reproduce TP=1."""
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import rel_err
from engine import LLM, SamplingParams
from engine.model import load_model
from engine.model.shards import split_dim
from engine.parallel import sequence, state

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
ROOT = Path(__file__).resolve().parents[1]


def _run(path, tp, prompts, params=GREEDY, outputs=False, **kw):
    llm = LLM(path, tp=tp, device="cpu", dtype=torch.float32, max_num_seqs=4, numerics="plain", tp_timeout=60, **kw)
    seen = {}

    def hook(seqs, logits):
        for s, row in zip(seqs, logits):
            seen[(s.request_id, len(s.output_ids))] = row.clone()

    llm.engine.runner.logits_hook = hook
    try:
        outs = llm.generate(prompts, params)
    finally:
        llm.shutdown()
    return ([o.token_ids for o in outs], seen) + ((outs,) if outputs else ())


def _prompts(vocab):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in (37, 11)]


@pytest.mark.parametrize("preset,tp", [("tiny", 2), ("tiny", 4), ("flash", 2), ("nvfp4", 2)])
def test_tp_reproduces_tp1(tiny_ckpt, preset, tp):
    path = tiny_ckpt(preset, 0)
    prompts = _prompts(129280)
    want_tokens, want = _run(path, 1, prompts)
    got_tokens, got = _run(path, tp, prompts)
    assert got_tokens == want_tokens
    assert set(got) == set(want)
    err = max(rel_err(got[k], want[k]).item() for k in want)
    print(f"{preset} tp={tp}: max rel err of logits vs tp=1 {err:.2e}")
    assert err <= 1e-4


def _counting(monkeypatch, module, name):
    """Count the calls of module.name (the step calls it through the module)."""
    seen, fn = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: seen.append(1) or fn(*a, **k))
    return seen


@pytest.mark.parametrize("preset,tp", [("tiny", 2), ("flash", 4)])
def test_sequence_parallel_prefill_reproduces_tp1(tiny_ckpt, monkeypatch, preset, tp):
    """Sequence-parallel prefill (parallel/sequence.py, its threshold lowered so these prompts
    split: the workers take rank 0's) gives tp=1's tokens and logits: one step of both prompts
    (49 tokens, so the last rank keeps padding rows), prompt logprobs (every prompt token's logit
    row gathered from the rank that keeps it) and, at tp = 4, steps of chunks of 16 beside decode rows.
    The compressors' projections split by channel (sequence.ChannelSplit, turned on) in those steps."""
    path = tiny_ckpt(preset, 0)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 129280, (n,), generator=g).tolist() for n in (37, 12)]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=2),
              SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)]
    want_tokens, want, want_outs = _run(path, 1, prompts, params, outputs=True)
    monkeypatch.setattr(sequence, "SP_MIN_T", 8)
    monkeypatch.setattr(sequence, "CHANNEL_SPLIT", True)     # whatever the default (bench/levers.py: channel_split)
    splits = _counting(monkeypatch, sequence, "scatter")
    channel_gathers = _counting(monkeypatch, sequence.ChannelSplit, "gather")
    got_tokens, got, got_outs = _run(path, tp, prompts, params, outputs=True)
    assert splits, "no step was split"
    assert channel_gathers, "no compressor's channels were split"
    assert got_tokens == want_tokens and set(got) == set(want)
    assert max(rel_err(got[k], want[k]).item() for k in want) <= 1e-4
    a, b = got_outs[0].prompt_logprobs, want_outs[0].prompt_logprobs     # None, then {token: logprob} per token
    assert len(a) == len(b) == 37 and a[0] is None is b[0]
    for da, db in zip(a[1:], b[1:]):
        assert sorted(da) == sorted(db) and all(abs(da[t] - db[t]) <= 1e-4 * max(1.0, abs(db[t])) for t in db)
    if tp == 4:
        chunked, _ = _run(path, tp, prompts, params, chunk_size=16)
        assert chunked == want_tokens


@pytest.mark.parametrize("numerics", ["plain", "reference"])
def test_sequence_parallel_path_at_tp1_is_exact(tiny_ckpt, monkeypatch, numerics):
    """The sequence-parallel step at tp=1 (a split of one rank forced on every prefill step) is
    the unsplit step bit for bit: in reference numerics this checks that the FP8 rounding made
    again after the gather (step.opened) is the one mhc_pre makes."""
    path = tiny_ckpt("flash", 0)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, 129280, (n,), generator=g).tolist() for n in (37, 12, 5)]
    kw = dict(tp=1, device="cpu", dtype=torch.float32, max_num_seqs=4, numerics=numerics)

    def run():
        llm = LLM(path, **kw)
        seen = []
        llm.engine.runner.logits_hook = lambda seqs, logits: seen.append(logits.clone())
        try:
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        finally:
            llm.shutdown()
        return [o.token_ids for o in outs], seen

    want_tokens, want = run()
    monkeypatch.setattr(sequence, "split", lambda T: sequence.SeqSplit(T, 1, 0))
    monkeypatch.setattr(sequence, "CHANNEL_SPLIT", True)      # the lever's path, whatever the default
    splits = _counting(monkeypatch, sequence, "gather")
    got_tokens, got = run()
    assert splits and got_tokens == want_tokens and len(got) == len(want)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_tp_async_scheduling_gives_the_synchronous_tokens(tiny_ckpt):
    """Async scheduling at tp=2: every rank gathers the pending tokens from rank 0's sampled ids
    (shared after each step), so greedy and seeded sampling give tp=1's synchronous tokens, through
    prefill-only steps (chunks of 8: nothing sampled), mixed steps and more prompts than slots."""
    path = tiny_ckpt("tiny", 0)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 129280, (n,), generator=g).tolist() for n in (37, 11, 20, 5, 9, 30)]
    for params in (GREEDY, [SamplingParams(temperature=0.8, seed=i, max_tokens=4 + i, ignore_eos=True)
                            for i in range(len(prompts))]):
        want, _ = _run(path, 1, prompts, params, async_scheduling=False, chunk_size=8)
        got, _ = _run(path, 2, prompts, params, async_scheduling=True, chunk_size=8)
        assert got == want


TORCHRUN = """
import json, sys
import torch
from engine import LLM, SamplingParams
llm = LLM(sys.argv[1], tp=2, device="cpu", dtype=torch.float32, max_num_seqs=4, numerics="plain", tp_timeout=60,
          async_scheduling=sys.argv[2] == "async")   # ranks > 0 serve rank 0's steps in here, then exit
outs = llm.generate(json.loads(sys.argv[3]), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
print("TOKENS", json.dumps([o.token_ids for o in outs]), flush=True)
llm.shutdown()
"""


def test_torchrun_ranks_serve_rank0s_steps(tiny_ckpt, tmp_path):
    """Under torchrun every rank builds its engine in LLM(); rank 0 then sends each step to the
    others (as to spawned ranks), synchronous and async scheduling alike: tp=1's tokens."""
    path = tiny_ckpt("tiny", 0)
    prompts = _prompts(129280)
    want, _ = _run(path, 1, prompts)
    script = tmp_path / "torchrun_generate.py"
    script.write_text(TORCHRUN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(ROOT), os.environ.get("PYTHONPATH", "")))}
    for mode in ("sync", "async"):
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                              str(script), str(path), mode, json.dumps(prompts)],
                             env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        got = [line for line in out.stdout.splitlines() if line.startswith("TOKENS ")]
        assert len(got) == 1 and json.loads(got[0][len("TOKENS "):]) == want, (mode, out.stdout[-2000:])


def _expected_shape(name, full_shape, tp):
    official = re.sub(r"experts\.(w[123])$", r"experts.0.\1.weight", name)
    dim = split_dim(official if official.endswith((".weight", "attn_sink")) or "experts" in official
                    else name)
    if "experts.w" in name and not name.endswith("weight"):
        dim = {"w1": 1, "w3": 1, "w2": 2}[name[-2:]]   # stacked [E, out, in]: one more leading dim
    shape = list(full_shape)
    if dim is not None:
        shape[dim] //= tp
    return shape


def test_rank_holds_only_its_shards(tiny_ckpt):
    path = tiny_ckpt("tiny", 0)
    full = dict((k, v.shape) for k, v in load_model(path).named_parameters())
    full_bytes = sum(v.numel() * 4 for v in load_model(path).parameters())
    try:
        state._rank, state._size = 1, 4          # loading needs no collective: pose as rank 1 of 4
        part = load_model(path)
        local = dict((k, v.shape) for k, v in part.named_parameters())
        part_bytes = sum(v.numel() * 4 for v in part.parameters())
    finally:
        state._rank, state._size = 0, 1
    assert local.keys() == full.keys()
    for k in full:
        assert list(local[k]) == _expected_shape(k, full[k], 4), k
    print(f"rank bytes {part_bytes / 2**20:.1f} MiB of {full_bytes / 2**20:.1f} MiB")
    assert part_bytes < 0.4 * full_bytes


def test_dead_worker_is_reported(tiny_ckpt):
    llm = LLM(tiny_ckpt("tiny", 0), tp=2, device="cpu", dtype=torch.float32, numerics="plain", tp_timeout=15)
    try:
        llm.workers.procs[0].kill()
        llm.workers.procs[0].join()
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="rank 1"):
            llm.generate([[5, 6, 7]], GREEDY)
        assert time.monotonic() - t0 < 30
    finally:
        llm.shutdown()


def test_tp_split_of_fp8_blocks_is_refused_at_start(tiny_ckpt):
    """tiny's moe_intermediate_size 128 at tp=2 leaves 64-wide slices of 128-wide FP8 blocks:
    reference numerics cannot round them, so LLM refuses before any rank starts (it used to
    crash inside fp8_sim at the first step); plain numerics run it."""
    from engine.model.config import ConfigError, ModelConfig

    path = tiny_ckpt("tiny", 0)
    with pytest.raises(ConfigError, match=r"moe_intermediate_size.*tp = 2.*64-wide slice of 128"):
        LLM(path, tp=2, device="cpu", dtype=torch.float32, numerics="reference", tp_timeout=15)
    cfg = ModelConfig.from_file(path)
    cfg.check_tp(2, "plain")
    cfg.check_tp(1, "reference")
    with pytest.raises(ConfigError, match="num_attention_heads.*does not split over tp = 3"):
        cfg.check_tp(3, "plain")
    wide = dataclasses.replace(cfg, moe_inter_dim=512, o_lora_rank=32)   # experts fine, wo_b 4x32/2 = 64 not
    with pytest.raises(ConfigError, match=r"o_lora_rank.*64-wide slice of 128"):
        wide.check_tp(2, "reference")
    dataclasses.replace(cfg, moe_inter_dim=512).check_tp(4, "reference")


def test_collectives_refuse_a_missing_group_and_simulate_an_explicit_one():
    from engine.parallel import comm

    try:
        state._rank, state._size = 0, 2         # a misconfigured rank: tp 2, no group
        with pytest.raises(RuntimeError, match="no process group"):
            comm.all_reduce(torch.ones(3))
        with pytest.raises(RuntimeError, match="no process group"):
            comm.all_gather_last(torch.ones(3))
        g = state.init_simulated(1, 4)
        assert state.tp_rank() == 1 and state.tp_size() == 4 and state.group() is g
        x = torch.arange(6.0).view(2, 3)
        assert comm.all_reduce(x) is x
        assert torch.equal(comm.all_gather_last(x), x.repeat(1, 4))
    finally:
        state.shutdown()
    assert state.tp_size() == 1 and state.group() is None
