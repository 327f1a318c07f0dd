"""weights/make_tiny.py: official-format tiny checkpoints (names, dtypes, shapes, shards, config)."""

import hashlib
import json
import re
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from engine.model import formats as F
from weights import make_tiny as MT

TOKENIZER_SHA256 = "8f9f37ca37fdc4f5fd36d5cf4d3b0e8392edb4e894fd10cc0d70b4957c8633cf"


def expected_inventory(cfg):
    """name -> (shape, safetensors dtype), written straight from spec §5 (not from make_tiny)."""
    D, V, hc = cfg["hidden_size"], cfg["vocab_size"], cfg["hc_mult"]
    H, Dh, ql = cfg["num_attention_heads"], cfg["head_dim"], cfg["q_lora_rank"]
    G, ol, E = cfg["o_groups"], cfg["o_lora_rank"], cfg["n_routed_experts"]
    I, ih, idd = cfg["moe_intermediate_size"], cfg["index_n_heads"], cfg["index_head_dim"]
    inv = {}

    def fp8(name, o, i):
        inv[name + ".weight"] = ((o, i), "F8_E4M3")
        inv[name + ".scale"] = ((-(-o // 128), -(-i // 128)), "F8_E8M0")

    def fp4(name, o, i):
        inv[name + ".weight"] = ((o, i // 2), "I8")
        inv[name + ".scale"] = ((o, i // 32), "F8_E8M0")

    def compressor(p, ratio, d):
        coff = 2 if ratio == 4 else 1
        inv[p + ".ape"] = ((ratio, coff * d), "F32")
        inv[p + ".norm.weight"] = ((d,), "BF16")
        inv[p + ".wkv.weight"] = ((coff * d, D), "BF16")
        inv[p + ".wgate.weight"] = ((coff * d, D), "BF16")

    def block(p, ratio, hashed):
        for n in ("attn_norm", "ffn_norm"):
            inv[f"{p}.{n}.weight"] = ((D,), "BF16")
        for u in ("attn", "ffn"):
            inv[f"{p}.hc_{u}_fn"] = (((2 + hc) * hc, hc * D), "F32")
            inv[f"{p}.hc_{u}_base"] = (((2 + hc) * hc,), "F32")
            inv[f"{p}.hc_{u}_scale"] = ((3,), "F32")
        inv[f"{p}.attn.attn_sink"] = ((H,), "F32")
        inv[f"{p}.attn.q_norm.weight"] = ((ql,), "BF16")
        inv[f"{p}.attn.kv_norm.weight"] = ((Dh,), "BF16")
        fp8(f"{p}.attn.wq_a", ql, D)
        fp8(f"{p}.attn.wq_b", H * Dh, ql)
        fp8(f"{p}.attn.wkv", Dh, D)
        fp8(f"{p}.attn.wo_a", G * ol, H * Dh // G)
        fp8(f"{p}.attn.wo_b", D, G * ol)
        if ratio != 0:
            compressor(f"{p}.attn.compressor", ratio, Dh)
        if ratio == 4:
            fp8(f"{p}.attn.indexer.wq_b", ih * idd, ql)
            inv[f"{p}.attn.indexer.weights_proj.weight"] = ((ih, D), "BF16")
            compressor(f"{p}.attn.indexer.compressor", 4, idd)
        inv[f"{p}.ffn.gate.weight"] = ((E, D), "BF16")
        if hashed:
            inv[f"{p}.ffn.gate.tid2eid"] = ((V, cfg["num_experts_per_tok"]), "I64")
        else:
            inv[f"{p}.ffn.gate.bias"] = ((E,), "F32")
        for e in range(E):
            fp4(f"{p}.ffn.experts.{e}.w1", I, D)
            fp4(f"{p}.ffn.experts.{e}.w3", I, D)
            fp4(f"{p}.ffn.experts.{e}.w2", D, I)
        fp8(f"{p}.ffn.shared_experts.w1", I, D)
        fp8(f"{p}.ffn.shared_experts.w3", I, D)
        fp8(f"{p}.ffn.shared_experts.w2", D, I)

    inv["embed.weight"] = ((V, D), "BF16")
    inv["head.weight"] = ((V, D), "BF16")
    inv["norm.weight"] = ((D,), "BF16")
    inv["hc_head_fn"] = ((hc, hc * D), "F32")
    inv["hc_head_base"] = ((hc,), "F32")
    inv["hc_head_scale"] = ((1,), "F32")
    for layer in range(cfg["num_hidden_layers"]):
        block(f"layers.{layer}", cfg["compress_ratios"][layer], layer < cfg["num_hash_layers"])
    block("mtp.0", 0, hashed=False)
    fp8("mtp.0.e_proj", D, D)
    fp8("mtp.0.h_proj", D, D)
    for n in ("enorm", "hnorm", "norm"):
        inv[f"mtp.0.{n}.weight"] = ((D,), "BF16")
    inv["mtp.0.hc_head_fn"] = ((hc, hc * D), "F32")
    inv["mtp.0.hc_head_base"] = ((hc,), "F32")
    inv["mtp.0.hc_head_scale"] = ((1,), "F32")
    return inv


def read_header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        hdr = json.loads(f.read(n))
    hdr.pop("__metadata__", None)
    return hdr


def file_bytes(d):
    return {p.name: p.read_bytes() for p in sorted(Path(d).iterdir())}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {p: MT.make_tiny(root / p, preset=p, seed=0) for p in ("tiny", "flash")}


@pytest.mark.parametrize("preset", ["tiny", "flash"])
def test_inventory_and_index(built, preset):
    d = built[preset]
    cfg = json.loads((d / "config.json").read_text())
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shards = sorted(d.glob("model-*.safetensors"))
    assert len(shards) >= 2
    m = len(shards)
    assert [s.name for s in shards] == [f"model-{i:05d}-of-{m:05d}.safetensors" for i in range(1, m + 1)]

    found, total = {}, 0
    for s in shards:
        for name, info in read_header(s).items():
            assert name not in found, f"{name} in two shards"
            found[name] = (tuple(info["shape"]), info["dtype"])
            assert index["weight_map"][name] == s.name
            total += info["data_offsets"][1] - info["data_offsets"][0]
    assert set(index["weight_map"]) == set(found)
    assert index["metadata"]["total_size"] == total

    want = expected_inventory(cfg)
    assert sorted(set(found) - set(want)) == [] and sorted(set(want) - set(found)) == []
    bad = {n: (found[n], want[n]) for n in want if found[n] != want[n]}
    assert not bad


@pytest.mark.parametrize("preset", ["tiny", "flash"])
def test_presence_rules(built, preset):
    d = built[preset]
    cfg = json.loads((d / "config.json").read_text())
    names = set(json.loads((d / "model.safetensors.index.json").read_text())["weight_map"])
    ratios, n_hash = cfg["compress_ratios"], cfg["num_hash_layers"]
    for layer, r in enumerate(ratios[:-1]):
        p = f"layers.{layer}."
        assert (p + "ffn.gate.tid2eid" in names) == (layer < n_hash)
        assert (p + "ffn.gate.bias" in names) == (layer >= n_hash)
        assert (p + "attn.compressor.wkv.weight" in names) == (r != 0)
        assert (p + "attn.indexer.wq_b.weight" in names) == (r == 4)
    assert "mtp.0.e_proj.weight" in names and "mtp.0.ffn.gate.bias" in names
    assert not any(n.startswith("model.") for n in names)
    assert not any(n.startswith("mtp.0.attn.compressor") for n in names)


def test_tensor_values(built):
    d = built["tiny"]
    cfg = json.loads((d / "config.json").read_text())
    E, k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]

    def get(name):
        with safe_open(str(d / index[name]), framework="pt") as f:
            return f.get_tensor(name)

    tid = get("layers.0.ffn.gate.tid2eid")
    assert tid.dtype == torch.int64 and int(tid.min()) >= 0 and int(tid.max()) < E
    assert (tid.sort(dim=1).values.diff(dim=1) != 0).all()  # distinct experts per row
    assert not torch.equal(tid, get("layers.1.ffn.gate.tid2eid"))
    for name in ("layers.1.attn.wq_b", "mtp.0.h_proj", "layers.2.ffn.shared_experts.w2"):
        w, s = get(name + ".weight"), get(name + ".scale")
        back = F.fp8_block_dequant(w, s, name=name)
        assert torch.isfinite(back).all() and back.abs().max() > 0
        q2, s2 = F.fp8_block_quant(back)  # stored weights are exactly on the grid
        assert torch.equal(F.fp8_block_dequant(q2, s2), back)
    w, s = get("layers.3.ffn.experts.5.w2.weight"), get("layers.3.ffn.experts.5.w2.scale")
    back = F.mxfp4_dequant(w, s)
    assert back.shape == (cfg["hidden_size"], cfg["moe_intermediate_size"])
    assert torch.equal(F.mxfp4_dequant(*F.mxfp4_quant(back)), back)
    fn = get("layers.0.hc_attn_fn")
    assert 0.005 < fn.std() < 0.1
    assert get("layers.0.attn_norm.weight").float().mean().sub(1).abs() < 0.05
    assert get("head.weight").dtype == torch.bfloat16


@pytest.mark.parametrize("preset", ["tiny", "flash"])
def test_config_roundtrip(built, preset):
    d = built[preset]
    cfg = json.loads((d / "config.json").read_text())
    assert cfg == MT.build_config(preset)
    for key, val in MT.PRESETS[preset].items():
        assert cfg[key] == val
    assert cfg["model_type"] == "deepseek_v4" and cfg["architectures"] == ["DeepseekV4ForCausalLM"]
    assert cfg["num_key_value_heads"] == 1 and cfg["num_nextn_predict_layers"] == 1
    assert len(cfg["compress_ratios"]) == cfg["num_hidden_layers"] + 1 and cfg["compress_ratios"][-1] == 0
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    assert cfg["rope_scaling"]["type"] == "yarn" and cfg["expert_dtype"] == "fp4"
    gen = json.loads((d / "generation_config.json").read_text())
    assert gen["bos_token_id"] == 0 and gen["eos_token_id"] == 1


def test_tokenizer_copied(built):
    d = built["tiny"]
    assert hashlib.sha256((d / "tokenizer.json").read_bytes()).hexdigest() == TOKENIZER_SHA256
    tc = json.loads((d / "tokenizer_config.json").read_text())
    assert tc["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_same_seed_same_bytes_via_cli(built, tmp_path, capsys):
    MT.main([str(tmp_path / "again"), "--preset", "tiny", "--seed", "0"])
    printed = capsys.readouterr().out
    assert len(re.findall(r"^wrote model-\d{5}-of-\d{5}\.safetensors", printed, re.M)) >= 2
    assert file_bytes(tmp_path / "again") == file_bytes(built["tiny"])


def test_different_seed_differs(built, tmp_path):
    other = file_bytes(MT.make_tiny(tmp_path / "s1", seed=1))
    base = file_bytes(built["tiny"])
    assert other.keys() == base.keys()
    assert other["config.json"] == base["config.json"]
    for name in base:
        if name.endswith(".safetensors"):
            assert other[name] != base[name], name


def test_bad_preset_and_config():
    with pytest.raises(ValueError, match="unknown preset"):
        MT.build_config("huge")
    cfg = MT.build_config("tiny")
    cfg["compress_ratios"] = cfg["compress_ratios"][:-1]
    with pytest.raises(ValueError, match="compress_ratios"):
        MT.check_config(cfg)
