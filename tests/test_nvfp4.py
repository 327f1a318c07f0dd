"""NVFP4 (modelopt) formats, loading, the MXFP4 -> NVFP4 converter and the `nvfp4` tiny preset.

modelopt's `NVFP4QTensor` is the reference for quantization and dequantization; an
independent per-element decoder written from the format's definition checks the nibble
order. The converter must be lossless on MXFP4 experts, so converted checkpoints give
exactly the source's logits and greedy tokens.
"""
import json
import re
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.model import CheckpointError, load_model
from engine.model import formats as F
from engine.model.loader import Checkpoint, hf_to_official
from weights import to_nvfp4

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
EXP = "layers.2.ffn.experts.3"  # a routed expert of a score-routed layer of `tiny`
BAD = "layers.0.ffn.experts.0"  # broken here: the loader meets it early, so failures are quick


@pytest.fixture(scope="module")
def NVFP4QTensor():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # modelopt warns about the transformers version
        from modelopt.torch.quantization.qtensor import NVFP4QTensor
    return NVFP4QTensor


def _modelopt_dequant(Q, packed, ws, ws2, shape):
    return Q(torch.Size(shape), torch.float32, packed).dequantize(
        dtype=torch.float32, scale=ws, double_scale=ws2, block_sizes={-1: 16})


def _weights(seed, shape=(48, 256), dtype=torch.float32):
    """Random weights over a wide dynamic range, with an all-zero block and exact ties."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = shape
    spread = torch.exp2(torch.randint(-12, 4, (rows, cols // 16), generator=g).float()).repeat_interleave(16, 1)
    w = torch.randn(shape, generator=g) * spread
    w[0, :16] = 0.0
    w[1, :16] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 2)  # block amax 6: ties stay ties
    w[2, 5] = -0.0
    return w.to(dtype)


# ----------------------------------------------------------------------------- formats


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quant_bit_identical_to_modelopt(NVFP4QTensor, seed, dtype):
    w = _weights(seed, dtype=dtype)
    qt, ws_ref, ws2_ref = NVFP4QTensor.quantize(w.clone(), 16, try_tensorrt=False)
    packed, ws, ws2 = F.nvfp4_quant(w)
    assert packed.dtype == torch.uint8 and packed.shape == (48, 128)
    assert ws.dtype == torch.float8_e4m3fn and ws.shape == (48, 16)
    assert ws2.dtype == torch.float32 and ws2.shape == ()
    assert torch.equal(packed, qt._quantized_data)
    assert torch.equal(ws.view(torch.uint8), ws_ref.view(torch.uint8))
    assert torch.equal(ws2, ws2_ref)
    assert torch.equal(ws2, w.float().abs().amax() / (6.0 * 448.0))
    # modelopt decodes code 8 as +0, we as -0: equal as values, which is what torch.equal compares
    assert torch.equal(F.nvfp4_dequant(packed, ws, ws2), _modelopt_dequant(NVFP4QTensor, packed, ws, ws2, w.shape))


def test_quant_with_shared_global_matches_modelopt(NVFP4QTensor):
    w = _weights(3)
    shared = torch.tensor(w.abs().max().item() * 4 / 2688)  # e.g. w3's larger amax
    qt, ws_ref, _ = NVFP4QTensor.quantize(w.clone(), 16, weights_scaling_factor_2=shared, try_tensorrt=False)
    packed, ws, ws2 = F.nvfp4_quant(w, weight_scale_2=shared)
    assert torch.equal(packed, qt._quantized_data) and torch.equal(ws.view(torch.uint8), ws_ref.view(torch.uint8))
    assert torch.equal(ws2, shared)


def test_dequant_matches_modelopt_on_random_bytes(NVFP4QTensor):
    g = torch.Generator().manual_seed(4)
    packed = torch.randint(0, 256, (32, 64), generator=g, dtype=torch.uint8)
    ws = (torch.rand(32, 8, generator=g) * 400 + 2**-9).to(torch.float8_e4m3fn)
    ws2 = torch.tensor(0.0123)
    assert torch.equal(F.nvfp4_dequant(packed, ws, ws2), _modelopt_dequant(NVFP4QTensor, packed, ws, ws2, (32, 128)))


def test_nibble_order_and_formula_from_definition():
    # byte 0x2F: low nibble (element 0) = code 15 = -6, high nibble (element 1) = code 2 = 1.0
    packed = torch.tensor([[0x2F] + [0x00] * 7, [0x71] + [0x08] * 7], dtype=torch.uint8)
    ws = torch.tensor([[0.5], [3.0]]).to(torch.float8_e4m3fn)
    ws2 = torch.tensor(0.25)
    got = F.nvfp4_dequant(packed, ws, ws2)
    assert got.shape == (2, 16)
    for r in range(2):
        for c in range(16):
            byte = packed[r, c // 2].item()
            code = byte & 0xF if c % 2 == 0 else byte >> 4
            assert got[r, c].item() == E2M1[code] * ws[r, 0].float().item() * 0.25
    assert got[0, :2].tolist() == [-0.75, 0.125] and got[1, :2].tolist() == [0.375, 4.5]
    assert F.nvfp4_quant(got)[0][0, 0].item() == 0x2F  # and back


def _negative(s):
    return (s.view(torch.uint8) | 0x80).view(torch.float8_e4m3fn)


@pytest.mark.parametrize("bad,match", [
    (lambda p, s, g: (p, s[:, :-1], g), r"weight_scale shape.*\(4, 4\).*\(4, 3\)"),
    (lambda p, s, g: (p, s.float(), g), r"weight_scale .*float8_e4m3fn"),
    (lambda p, s, g: (p, s, g.double()), r"weight_scale_2 .*one fp32 value"),
    (lambda p, s, g: (p, s, torch.tensor(0.0)), r"weight_scale_2 .*> 0"),
    (lambda p, s, g: (p, s, torch.ones(2)), r"weight_scale_2 .*one fp32 value"),
    (lambda p, s, g: (p, _negative(s), g), r"weight_scale .*negative"),
])
def test_dequant_rejects_malformed_scales(bad, match):
    p, s, g = F.nvfp4_quant(torch.randn(4, 64))
    with pytest.raises(ValueError, match=match) as e:
        F.nvfp4_dequant(*bad(p, s, g), name="w9")
    assert "'w9'" in str(e.value)


def _mxfp4(seed, rows=16, cols=256, lo=110, hi=128):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(-128, 128, (rows, cols // 2), generator=g, dtype=torch.int8)
    scale = torch.randint(lo, hi, (rows, cols // 32), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    return packed, scale


def test_mxfp4_transcode_is_exact():
    from modelopt.torch.quantization.utils.numeric_utils import mxfp4_to_nvfp4_global_amax

    packed, scale = _mxfp4(5, lo=110, hi=128)  # exponents -17..0: exactly the 18 binades E4M3 holds
    sb = scale.view(torch.uint8)
    sb[0, 0], sb[0, 1] = 110, 127
    w, ws, ws2 = F.mxfp4_to_nvfp4(packed, scale, name="x")
    assert w.dtype == torch.uint8 and torch.equal(w, packed.view(torch.uint8))  # same nibbles
    assert ws.dtype == torch.float8_e4m3fn and ws.shape == (16, 16) and ws2.shape == ()
    assert ws2.item() == 2.0 ** (0 - 8) and ws.float().max().item() == 256 and ws.float().min().item() == 2**-9
    assert torch.equal(F.nvfp4_dequant(w, ws, ws2).view(torch.int32), F.mxfp4_dequant(packed, scale).view(torch.int32))
    assert ws2.item() == mxfp4_to_nvfp4_global_amax(sb)[0] / 2688  # modelopt's closed form agrees


def test_mxfp4_transcode_shared_top_and_zero_blocks():
    packed, scale = _mxfp4(6, lo=120, hi=126)
    packed[3, :16] = 0       # an all-zero block may carry any scale, even one E4M3 cannot hold
    packed[4, 16:32] = 0x08  # -0 codes are zeros too
    scale.view(torch.uint8)[3, 0] = scale.view(torch.uint8)[4, 1] = 0
    w, ws, ws2 = F.mxfp4_to_nvfp4(packed, scale, top_exp=3, name="w1")  # w3's top is 2^3
    assert ws2.item() == 2.0 ** -5
    assert torch.equal(F.nvfp4_dequant(w, ws, ws2), F.mxfp4_dequant(packed, scale))
    with pytest.raises(ValueError, match=r"w1.*below"):
        F.mxfp4_to_nvfp4(packed, scale, top_exp=-10, name="w1")


def test_mxfp4_transcode_range_too_wide_raises_naming_tensor():
    packed, scale = _mxfp4(7, lo=120, hi=127)
    packed[5, 40] = 0x11  # a non-zero value in block (5, 2) ...
    scale.view(torch.uint8)[5, 2] = 127 - 20  # ... 2^-20 while the top is >= 2^-2: 19+ binades
    with pytest.raises(ValueError, match=r"layers\.7\.ffn\.experts\.1\.w2\.weight.*losslessly.*row 5, block 2"):
        F.mxfp4_to_nvfp4(packed, scale, name="layers.7.ffn.experts.1.w2.weight")
    tensors = {"layers.7.ffn.experts.1.w2.weight": packed, "layers.7.ffn.experts.1.w2.scale": scale}
    with pytest.raises(to_nvfp4.ConvertError, match=r"layers\.7\.ffn\.experts\.1\.w2\.weight"):
        to_nvfp4.convert_tensors(tensors)


# ----------------------------------------------------------------------------- converter


@pytest.fixture(scope="module")
def tiny(tiny_ckpt):
    return tiny_ckpt("tiny", 0)


@pytest.fixture(scope="module")
def converted(tiny, tmp_path_factory):
    dst = tmp_path_factory.mktemp("nv") / "tiny-nvfp4"
    to_nvfp4.main([str(tiny), str(dst)])
    return dst


@pytest.fixture(scope="module")
def models(tiny, converted):
    return load_model(tiny), load_model(converted)


def _ids(n, seed):
    return torch.randint(2, 129280, (1, n), generator=torch.Generator().manual_seed(seed))


def test_converter_layout(tiny, converted):
    idx = json.loads((converted / "model.safetensors.index.json").read_text())["weight_map"]
    src = json.loads((tiny / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(set(idx.values())) == sorted(set(src.values()))  # same shards
    t = {}
    for f in sorted(set(idx.values())):
        t.update(load_file(converted / f))
    assert set(t) == set(idx)
    base = f"{EXP}.w1"
    assert t[f"{base}.weight"].dtype == torch.uint8 and t[f"{base}.weight"].shape == (128, 128)
    assert t[f"{base}.weight_scale"].dtype == torch.float8_e4m3fn and t[f"{base}.weight_scale"].shape == (128, 16)
    assert t[f"{base}.weight_scale_2"].dtype == torch.float32 and t[f"{base}.weight_scale_2"].shape == ()
    assert t[f"{base}.input_scale"].dtype == torch.float32 and t[f"{base}.input_scale"].shape == ()
    assert t[f"{EXP}.w2.weight_scale"].shape == (256, 8)
    assert torch.equal(t[f"{EXP}.w1.weight_scale_2"], t[f"{EXP}.w3.weight_scale_2"])  # gate/up share
    assert not any(re.match(r"layers\.\d+\.ffn\.experts\.\d+\.w\d\.scale$", n) for n in t)
    assert t["mtp.0.ffn.experts.0.w1.scale"].dtype == torch.float8_e8m0fnu  # MTP experts stay MXFP4
    assert t["layers.1.attn.wkv.weight"].dtype == torch.float8_e4m3fn and "layers.1.attn.wkv.scale" in t
    hq = json.loads((converted / "hf_quant_config.json").read_text())["quantization"]
    cfg = json.loads((converted / "config.json").read_text())["quantization_config"]
    assert hq["moe_quant_algo"] == cfg["moe_quant_algo"] == "NVFP4" and cfg["quant_method"] == "fp8"
    assert "mtp.*" in hq["exclude_modules"] and "*.attn.*" in cfg["ignore"]
    assert sorted(cfg["quantized_layers"]) == [f"layers.{i}.ffn.experts" for i in range(5)]
    assert (converted / "tokenizer.json").exists()


@pytest.mark.parametrize("numerics", ["plain", "reference"])
def test_converted_checkpoint_gives_identical_logits(models, numerics):
    """Reference numerics too: NVFP4 experts get exactly the FP8 input rounding of their MXFP4 source."""
    a, b = models
    assert b.cfg.expert_dtype == "nvfp4" and a.cfg.expert_dtype == "fp4"
    for la, lb in zip(a.layers, b.layers):
        for p in ("w1", "w2", "w3"):
            assert torch.equal(getattr(la.ffn.experts, p), getattr(lb.ffn.experts, p))
    ids = _ids(20, 0)
    try:
        assert torch.equal(a.set_numerics(numerics)(ids), b.set_numerics(numerics)(ids))
    finally:
        a.set_numerics("plain"), b.set_numerics("plain")


def _bf16_experts(tiny, dst):
    """`tiny` with its routed experts stored bf16 (exact: MXFP4 values fit bf16)."""
    return _variant(tiny, dst, edit=lambda t: t.update({
        n: F.mxfp4_dequant(t[n], t.pop(n[: -len(".weight")] + ".scale")).to(torch.bfloat16)
        for n in [n for n in t if to_nvfp4.EXPERT.match(n)]}))


def test_converter_from_bf16_uses_modelopt(tiny, tmp_path, models):
    src = _bf16_experts(tiny, tmp_path / "bf16")
    with pytest.raises(to_nvfp4.ConvertError, match=r"layers\.0\.ffn\.experts\.0\.w1\.weight.*--from-bf16"):
        to_nvfp4.convert(src, tmp_path / "refused")
    conv = to_nvfp4.convert(src, tmp_path / "out", from_bf16=True)
    assert conv.n_quantized == 5 * 8 * 3 and conv.n_lossless == 0
    out, inp = Checkpoint(tmp_path / "out"), Checkpoint(src)
    w1, w3 = (inp.get(f"{EXP}.{p}.weight").float() for p in ("w1", "w3"))
    shared = out.get(f"{EXP}.w1.weight_scale_2")
    assert torch.equal(shared, torch.maximum(w1.abs().amax(), w3.abs().amax()) / (6.0 * 448.0))
    ours = F.nvfp4_quant(w1, weight_scale_2=shared)  # what modelopt wrote, bit for bit
    assert torch.equal(ours[0], out.get(f"{EXP}.w1.weight"))
    assert torch.equal(ours[1].view(torch.uint8), out.get(f"{EXP}.w1.weight_scale").view(torch.uint8))
    model = load_model(tmp_path / "out")
    ref = models[0].layers[2].ffn.experts.w1[3]
    err = (model.layers[2].ffn.experts.w1[3] - ref).abs().max() / ref.abs().max()
    assert 0 <= err < 0.1  # re-rounding onto NVFP4's grid: small, not zero in general


def test_nvfp4_preset_loads(tiny_ckpt, models):
    path = tiny_ckpt("nvfp4", 0)
    assert (path / "hf_quant_config.json").exists()
    model = load_model(path)
    assert model.cfg.expert_dtype == "nvfp4"
    # every weight equals the MXFP4 `tiny`'s, so its logits do too (the engine test runs it)
    ref = dict(models[0].named_parameters())
    assert all(torch.equal(p, ref[n]) for n, p in model.named_parameters())


# ----------------------------------------------------------------------------- broken NVFP4 checkpoints


def _variant(src, dst, edit=None, config=None):
    """Copy of checkpoint `src`, shards symlinked unless edited: edit(tensors) rewrites the
    shard holding BAD (and, in `tiny`, every routed expert), the index following it;
    config(cfg, hf_quant) edits the two json files."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).symlink_to(f.resolve()) if f.suffix == ".safetensors" else shutil.copyfile(f, dst / f.name)
    if edit:
        idx = json.loads((dst / "model.safetensors.index.json").read_text())
        shard = idx["weight_map"][f"{BAD}.w1.weight"]
        t = load_file(dst / shard)
        edit(t)
        t = {k: v.contiguous() for k, v in t.items()}
        (dst / shard).unlink()
        save_file(t, dst / shard, metadata={"format": "pt"})
        idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if v != shard} | {k: shard for k in t}
        (dst / "model.safetensors.index.json").write_text(json.dumps(idx))
    if config:
        cfg, hq = (json.loads((dst / n).read_text()) for n in ("config.json", "hf_quant_config.json"))
        config(cfg, hq)
        (dst / "config.json").write_text(json.dumps(cfg))
        (dst / "hf_quant_config.json").write_text(json.dumps(hq))
    return dst


def _pop(name):
    return lambda t: t.pop(name)


def _put(name, fn):
    return lambda t: t.__setitem__(name, fn(t))


def _undeclare(cfg, hq):
    for k in ("quant_algo", "moe_quant_algo", "quantized_layers"):
        cfg["quantization_config"].pop(k)
        hq["quantization"].pop(k)


BROKEN = [
    ("missing-weight_scale", dict(edit=_pop(f"{BAD}.w1.weight_scale")),
     [rf"{BAD}\.w1\.weight", rf"block scales {BAD}\.w1\.weight_scale\b"]),
    ("missing-weight_scale_2", dict(edit=_pop(f"{BAD}.w3.weight_scale_2")),
     [rf"{BAD}\.w3\.weight", rf"global scale {BAD}\.w3\.weight_scale_2"]),
    ("weight_scale-shape", dict(edit=_put(f"{BAD}.w2.weight_scale", lambda t: t[f"{BAD}.w2.weight_scale"][:, :4])),
     [rf"{BAD}\.w2\.weight", r"\(256, 8\).*\(256, 4\)"]),
    ("weight-shape", dict(edit=lambda t: t.update({
        f"{BAD}.w1.weight": t[f"{BAD}.w1.weight"][:64], f"{BAD}.w1.weight_scale": t[f"{BAD}.w1.weight_scale"][:64]})),
     [rf"{BAD}\.w1\.weight: shape \(64, 256\), expected \(128, 256\)"]),
    ("weight_scale-dtype", dict(edit=_put(f"{BAD}.w1.weight_scale", lambda t: t[f"{BAD}.w1.weight_scale"].float())),
     [rf"{BAD}\.w1\.weight", r"float8_e4m3fn"]),
    ("weight-dtype", dict(edit=_put(f"{BAD}.w1.weight", lambda t: t[f"{BAD}.w1.weight"].to(torch.bfloat16))),
     [rf"{BAD}\.w1\.weight", r"uint8"]),
    ("input_scale-shape", dict(edit=_put(f"{BAD}.w2.input_scale", lambda t: torch.ones(3))),
     [rf"{BAD}\.w2\.input_scale", r"one fp32 value"]),
    ("input_scale-negative", dict(edit=_put(f"{BAD}.w2.input_scale", lambda t: torch.tensor(-1.0))),
     [rf"{BAD}\.w2\.input_scale", r"> 0"]),
    ("nan-weight_scale", dict(edit=_put(f"{BAD}.w3.weight_scale", lambda t: torch.full((128, 16), float("nan"))
                                        .to(torch.float8_e4m3fn))), [rf"{BAD}\.w3\.weight", r"NaN"]),
    ("both-scales", dict(edit=_put(f"{BAD}.w1.scale", lambda t: torch.full((128, 8), 127, dtype=torch.uint8))),
     [rf"{BAD}\.w1\.weight", r"both"]),
    ("orphan-scale", dict(edit=lambda t: t.update({f"{BAD}.w4.weight_scale": t[f"{BAD}.w1.weight_scale"].clone()})),
     [rf"unexpected tensor {BAD}\.w4\.weight_scale", rf"{BAD}\.w4\.weight"]),
    ("undeclared", dict(config=_undeclare), [r"\.weight_scale", r"declares NVFP4"]),
]


@pytest.mark.parametrize("case", BROKEN, ids=[c[0] for c in BROKEN])
def test_broken_nvfp4_tensors_are_named(converted, tmp_path, case):
    _, kw, patterns = case
    with pytest.raises(CheckpointError) as e:
        load_model(_variant(converted, tmp_path / "v", **kw))
    for p in patterns:
        assert re.search(p, str(e.value)), f"{p!r} not in: {e.value}"


def test_excluded_module_only_warns(converted, tmp_path, caplog):
    path = _variant(converted, tmp_path / "v", config=lambda c, h: h["quantization"]["exclude_modules"].append(
        "layers.2.ffn.experts.*"))
    load_model(path)
    assert "excludes" in caplog.text and "layers.2.ffn.experts" in caplog.text


def test_hf_expert_names_map_to_official():
    assert hf_to_official("model.layers.3.mlp.experts.5.gate_proj.weight_scale_2") == "layers.3.ffn.experts.5.w1.weight_scale_2"
    assert hf_to_official("model.layers.3.mlp.experts.5.up_proj.weight") == "layers.3.ffn.experts.5.w3.weight"
    assert hf_to_official("model.layers.3.mlp.experts.5.down_proj.input_scale") == "layers.3.ffn.experts.5.w2.input_scale"
    assert hf_to_official("model.layers.3.mlp.shared_experts.gate_proj.weight") == "layers.3.ffn.shared_experts.w1.weight"


# ----------------------------------------------------------------------------- engine


@pytest.mark.parametrize("numerics", ["plain", "reference"])
def test_engine_greedy_tokens_match_mxfp4_source(tiny_ckpt, tiny, numerics):
    """The lossless transcode decodes the tokens of its source, logits and all, in both numerics
    (reference: the NVFP4 experts' inputs get the MXFP4 experts' FP8 rounding)."""
    from engine import LLM, SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    prompt = _ids(9, 10)[0].tolist()
    outs = []
    for path in (tiny, tiny_ckpt("nvfp4", 0)):
        llm = LLM(path, device="cpu", dtype=torch.float32, numerics=numerics, max_num_seqs=1,
                  kv_cache_memory=64 << 20)
        outs.append(llm.generate([prompt], greedy)[0].outputs[0])
    assert outs[0].token_ids == outs[1].token_ids and len(outs[0].token_ids) == 8
    assert outs[0].logprobs == outs[1].logprobs


# ----------------------------------------------------------------------------- packing for the fused MoE kernel


def test_experts_pack_rederives_the_checkpoint_codes(tiny_ckpt):
    """The NVFP4 checkpoint's experts, packed for the kernel (its own codes and scales, kept by
    the loader), decode to exactly the checkpoint's values, for an fp32 and a bf16 model."""
    from engine.kernels.fused_moe import dequant_experts

    path = tiny_ckpt("nvfp4", 0)
    ckpt = Checkpoint(path)
    exact, held16 = load_model(path), load_model(path, dtype=torch.bfloat16)
    for i, (a, b) in enumerate(zip(exact.layers, held16.layers)):
        ea, eb = a.ffn.experts, b.ffn.experts
        codes = ckpt.get(f"layers.{i}.ffn.experts.1.w2.weight")
        assert ea.nvfp4_parts is not None and torch.equal(ea.nvfp4_parts[2][0][1], codes)
        want = (ea.w1.clone(), ea.w3.clone(), ea.w2.clone())
        assert ea.pack() and eb.pack() and ea.packed.fmt == eb.packed.fmt == "nvfp4"
        assert ea.nvfp4_parts is None and ea.w1 is None
        for got in (dequant_experts(ea.packed), dequant_experts(eb.packed)):
            assert all(torch.equal(g, w) for g, w in zip(got, want))
    mtp = exact.mtp[0].ffn.experts                 # MXFP4 in this checkpoint: packed as MXFP4
    assert mtp.nvfp4_parts is None and mtp.pack() and mtp.packed.fmt == "mxfp4"


def test_experts_pack_refuses_weights_off_the_grid(tiny_ckpt):
    model = load_model(tiny_ckpt("nvfp4", 0))
    experts = model.layers[0].ffn.experts
    with torch.no_grad():
        experts.w2[3, 5, 7] *= 1.001                # no longer an NVFP4 value of its block
    assert not experts.pack() and experts.packed is None and experts.w2 is not None


@pytest.mark.parametrize("tp", [2, 4])
def test_nvfp4_codes_kept_per_tensor_parallel_rank(tiny_ckpt, tp):
    """Each rank keeps the codes of its own slice of every expert (w1/w3 rows, w2 columns): they
    decode to exactly the weights it holds (what Experts.pack checks before it packs them)."""
    from engine.parallel import state

    try:
        for rank in range(tp):
            state.init_simulated(rank, tp)
            experts = load_model(tiny_ckpt("nvfp4", 0)).layers[1].ffn.experts
            assert experts.w1.shape[1] == 128 // tp and experts.w2.shape[2] == 128 // tp
            for parts, w in zip(experts.nvfp4_parts, (experts.w1, experts.w3, experts.w2)):
                assert all(torch.equal(F.nvfp4_dequant(*(t[e] for t in parts)), w[e]) for e in range(w.shape[0]))
    finally:
        state.shutdown()
