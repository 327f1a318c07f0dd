"""engine.simulate: one rank of TP=N alone at a config's dims, random weights in the real packed
formats, collectives counted and modelled; the --simulate-tp flags; bench/prefill.py and
bench/serving.py --simulate-tp smoke runs. CPU, the SMALL dims (engine.realdims)."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model import formats as F
from engine.model.config import ModelConfig
from engine.model.linear import Linear
from engine.numerics import fp8_block_dequant
from engine.parallel import latency, state
from engine.realdims import SMALL, experts_modules
from engine.simulate import build_rank, sim_config

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("small")
    (d / "config.json").write_text(json.dumps(SMALL))
    return d


def test_rank_generates_in_the_real_formats_and_counts_its_collectives(small_dir):
    llm = LLM(small_dir, simulate_tp=2, num_layers=3, device="cpu", max_num_seqs=2, kv_cache_memory=1 << 27)
    try:
        model, group = llm.model, state.group()
        assert state.tp_size() == 2 and group.modelled and llm.numerics == "reference"
        assert [model.cfg.layer_kind(i) for i in range(3)] == ["swa", "csa", "hca"]
        assert model.head.weight.shape[0] == SMALL["vocab_size"] // 2          # rank 0's vocab slice
        fp8 = [m for m in model.modules() if isinstance(m, Linear) and m.fmt == "fp8" and m.weight is not None]
        assert fp8
        for m in fp8:   # on the e4m3 grid: the FP8 packing (pack_fp8, packed projections) is exact
            w = m.weight.float()
            assert torch.equal(fp8_block_dequant(*F.fp8_block_quant(w)), w)
        before = dict(group.calls)
        outs = llm.generate([[0, 5, 6, 7, 8] * 4, [0, 9, 10]], SamplingParams(max_tokens=3, temperature=0,
                                                                              ignore_eos=True))
        assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3]
        assert all(0 <= t < SMALL["vocab_size"] for o in outs for t in o.outputs[0].token_ids)
        assert outs[0].outputs[0].text is not None      # the bundled tokenizer was kept
        # 2 all-reduces per block per step (attention, MoE), one all-gather of the head per step
        steps = group.calls["all_gather"] - before["all_gather"]
        assert steps >= 3 and group.calls["all_reduce"] - before["all_reduce"] >= 2 * 3 * steps
        assert group.modelled_us > 0
        for _, m in experts_modules(model):   # the random experts pack for the fused MoE kernel
            assert m.pack() and m.packed.fmt == "mxfp4"
    finally:
        llm.shutdown()
    assert state.tp_size() == 1 and state.group() is None


def test_rank_is_seeded():
    cfg = sim_config(None, 1)   # the real dims, one block: built on meta, only the small parts compared
    assert cfg.dim == 4096 and cfg.n_layers == 1 and cfg.n_routed_experts == 256
    small = ModelConfig.from_dict({**SMALL, "num_hidden_layers": 1, "compress_ratios": [0]})
    weights = []
    for _ in range(2):
        m = build_rank(small, 2, torch.device("cpu"), torch.float32, "reference", seed=3)
        weights.append(m.layers[0].attn.wq_a.weight.clone())
        state.shutdown()
    assert torch.equal(*weights)


def test_simulated_group_models_the_cost():
    g = state.SimulatedGroup(0, 8, modelled=True)
    x = torch.ones(4, 4096, dtype=torch.bfloat16)
    assert g.all_reduce(x) is x and g.all_gather_last(torch.ones(2, 16)).shape == (2, 128)
    assert g.all_gather(x[:2]).shape == (16, 4096) and torch.equal(g.reduce_scatter(torch.arange(16.0)), torch.tensor([0.0, 1.0]))
    assert g.calls == {"all_reduce": 1, "all_gather": 2, "reduce_scatter": 1}
    want = (latency.all_reduce_us(x.numel() * 2, 8) + latency.all_gather_us(2 * 128 * 4, 8)
            + latency.all_gather_us(16 * 4096 * 2, 8) + latency.reduce_scatter_us(16 * 4, 8))
    # an all-reduce is a reduce-scatter and an all-gather of the same bytes: one alpha less
    assert latency.all_reduce_us(1 << 20, 8) == pytest.approx(
        latency.reduce_scatter_us(1 << 20, 8) + latency.all_gather_us(1 << 20, 8) - latency.ALPHA_US)
    assert g.modelled_us == pytest.approx(want)
    assert latency.all_reduce_us(1 << 20, 1) == 0
    sys.path.append(str(ROOT / "bench"))
    from decode_rows import allreduce_us   # the decode rows: 8 us + 2(n-1)/n bytes / 300 GB/s a call
    assert allreduce_us(4, 43, 8) == pytest.approx(87 * (8.0 + 2 * 7 / 8 * 4 * 4096 * 2 / 300e3))
    from levers import lever_off           # the old assumption, read at call time by the simulated group
    with lever_off("nccl_beta"):
        assert latency.all_reduce_us(1 << 20, 8) == pytest.approx(8.0 + 2 * 7 / 8 * (1 << 20) / 150e3)
    assert latency.all_reduce_us(1 << 20, 8) == pytest.approx(8.0 + 2 * 7 / 8 * (1 << 20) / 300e3)


def test_bad_simulations_are_refused(small_dir):
    with pytest.raises(ValueError, match="power of two"):
        LLM(small_dir, simulate_tp=3, device="cpu")
    with pytest.raises(ValueError, match="does not split over tp = 8"):   # o_groups 4
        LLM(small_dir, simulate_tp=8, device="cpu")
    with pytest.raises(ValueError, match="needs simulate_tp"):
        LLM(small_dir, num_layers=2, device="cpu")
    with pytest.raises(ValueError, match="tp must be 1"):
        LLM(small_dir, simulate_tp=2, tp=2, device="cpu")
    with pytest.raises(ValueError, match="num_layers"):
        LLM(small_dir, simulate_tp=2, num_layers=9, device="cpu")
    assert state.tp_size() == 1


def test_flags_parse_and_reject_bad_values():
    from engine import generate, serve

    a = serve.parse_args(["--simulate-tp", "8", "--num-layers", "4", "--no-simulate-collectives"])
    assert (a.simulate_tp, a.num_layers, a.simulate_collectives) == (8, 4, False)
    assert serve.parse_args([]).simulate_tp is None
    io = ["--input", "in.jsonl", "--output", "out.jsonl"]
    assert generate.parse_args(io + ["--simulate-tp", "2"]).simulate_collectives is True
    for bad in (["--simulate-tp", "0"], ["--simulate-tp", "6"], ["--num-layers", "2"],
                ["--simulate-tp", "8", "--tp", "2"], ["--simulate-tp", "8", "--num-layers", "0"]):
        with pytest.raises(SystemExit):
            serve.parse_args(bad)
        with pytest.raises(SystemExit):
            generate.parse_args(io + bad)


def test_generate_runs_token_id_rows(small_dir, tmp_path):
    from engine import generate

    rows = tmp_path / "in.jsonl"
    rows.write_text(json.dumps({"prompt": [0, 4, 5, 6]}) + "\n" + json.dumps({"prompt": [0, True]}) + "\n")
    out = tmp_path / "out.jsonl"
    assert generate.main(["--model", str(small_dir), "--simulate-tp", "2", "--num-layers", "1", "--device", "cpu",
                          "--input", str(rows), "--output", str(out), "--max-tokens", "2", "--ignore-eos"]) == 0
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(got) == 1 and len(got[0]["token_ids"]) == 2 and state.tp_size() == 1


def test_bench_prefill_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_prefill", ROOT / "bench" / "prefill.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "prefill.json"
    assert bench.main(["--device", "cpu", "--num-layers", "1", "--workloads", "24x1,8x2", "--reps", "1",
                       "--chunk-size", "16", "--json", str(out), "--ab", "moe_rows_bf16"]) == 0
    res = json.loads(out.read_text())
    assert res["run"]["simulate_tp"] == 2 and res["run"]["active_params"] > 0
    assert [(r["workload"], r["tokens"], r["variant"]) for r in res["rows"]] == [
        ("24x1", 24, "default"), ("24x1", 24, "off: moe_rows_bf16"), ("8x2", 16, "default"),
        ("8x2", 16, "off: moe_rows_bf16")]                  # each lever's before and after in one run
    assert res["rows"][0]["steps"] == 2                     # 24 tokens in chunks of 16
    assert all(r["tok_s"] > 0 and r["ttft_ms"] > 0 and r["roofline_ms"] > 0 for r in res["rows"])
    assert state.tp_size() == 1
    with pytest.raises(SystemExit):                         # a lever this tree does not have
        bench.main(["--device", "cpu", "--ab", "no_such_lever"])


def test_bench_serving_simulated_smoke(small_dir, tmp_path):
    for dep in ("openai", "fastapi", "uvicorn"):
        pytest.importorskip(dep)
    out = tmp_path / "serving.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "serving.py"), "--device", "cpu", "--model",
                        str(small_dir), "--simulate-tp", "2", "--num-layers", "1", "--input-len", "8",
                        "--output-len", "2", "--concurrency", "1", "--num-prompts", "1", "--warmup", "0",
                        "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(out.read_text())
    assert res["run"]["simulate_tp"] == 2 and "--simulate-tp 2" in res["run"]["server_cmd"]
    assert res["rows"][0]["completed"] == 1 and res["rows"][0]["total_output_tokens"] == 2
