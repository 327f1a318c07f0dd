"""One typed config for DeepSeek-V4, read from either config.json flavour.

DeepSeek ships `compress_ratios` (one entry per block plus a trailing MTP entry),
`num_hash_layers`, `qk_rope_head_dim` and a YaRN `rope_scaling`; transformers'
`save_pretrained` writes `layer_types`, `mlp_layer_types`, `compress_rates` and
`rope_parameters` instead. Both end up here, checked, with the short names of
DeepSeek's own `ModelArgs`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

# quant_algo values of an NVFP4 (modelopt) checkpoint; W4A16_NVFP4 is the weight-only flavour.
_NVFP4_ALGOS = ("NVFP4", "W4A16_NVFP4")
HF_QUANT_CONFIG = "hf_quant_config.json"

# transformers' attention kinds; any ratio other than 0 and 4 behaves as HCA.
_HF_KIND_RATIO = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


class ConfigError(ValueError):
    """A config field is missing, unknown or inconsistent; the message names it."""


@dataclass(frozen=True)
class YarnParams:
    factor: float
    original_seq_len: int
    beta_fast: float
    beta_slow: float


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    n_routed_experts: int
    n_shared_experts: int
    n_activated_experts: int
    moe_inter_dim: int
    compress_ratios: tuple[int, ...]        # one per main block (the MTP entry lives apart)
    n_hash_layers: int = 0
    mtp_compress_ratio: int = 0
    n_mtp_layers: int = 0
    score_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    route_scale: float = 1.0
    swiglu_limit: float = 0.0                # 0 = no clamp
    window_size: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn: YarnParams | None = None           # applied to compressed layers only
    max_position_embeddings: int = 1 << 20
    bos_token_id: int = 0
    eos_token_id: int = 1
    expert_dtype: str = "bf16"               # "fp4" (MXFP4), "nvfp4", "fp8", "bf16"
    quantization: dict | None = field(default=None, compare=False)

    # ---- derived facts the model asks for ----
    def layer_kind(self, layer: int) -> str:
        ratio = self.ratio(layer)
        return "swa" if ratio == 0 else "csa" if ratio == 4 else "hca"

    def ratio(self, layer: int) -> int:
        """Compress ratio of a main block; layer == n_layers means the MTP block."""
        return self.mtp_compress_ratio if layer >= self.n_layers else self.compress_ratios[layer]

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.n_hash_layers

    @property
    def fp8_linears(self) -> bool:
        return bool(self.quantization) and self.quantization.get("quant_method") == "fp8"

    def validate(self) -> "ModelConfig":
        def need(cond: bool, name: str, why: str):
            if not cond:
                raise ConfigError(f"config field `{name}`: {why}")

        for name in ("vocab_size", "dim", "n_layers", "n_heads", "head_dim", "q_lora_rank", "o_groups",
                     "o_lora_rank", "n_routed_experts", "n_activated_experts", "moe_inter_dim", "hc_mult"):
            need(getattr(self, name) > 0, name, f"must be positive, got {getattr(self, name)}")
        need(len(self.compress_ratios) == self.n_layers, "compress_ratios",
             f"{len(self.compress_ratios)} entries for {self.n_layers} layers")
        for i, r in enumerate(self.compress_ratios + (self.mtp_compress_ratio,)):
            need(isinstance(r, int) and r >= 0, "compress_ratios", f"entry {i} = {r!r} is not a ratio >= 0")
        need(0 < self.rope_dim <= self.head_dim and self.rope_dim % 2 == 0, "qk_rope_head_dim",
             f"{self.rope_dim} must be even and <= head_dim {self.head_dim}")
        need(self.n_heads % self.o_groups == 0, "o_groups", f"{self.o_groups} does not divide n_heads {self.n_heads}")
        need(self.n_activated_experts <= self.n_routed_experts, "num_experts_per_tok",
             f"{self.n_activated_experts} > n_routed_experts {self.n_routed_experts}")
        need(0 <= self.n_hash_layers <= self.n_layers, "num_hash_layers", f"{self.n_hash_layers} out of range")
        need(self.score_func in ("sqrtsoftplus", "softmax", "sigmoid"), "scoring_func", f"unknown {self.score_func!r}")
        need(self.window_size > 0, "sliding_window", "must be positive")
        need(self.expert_dtype in ("fp4", "nvfp4", "fp8", "bf16"), "expert_dtype", f"unknown {self.expert_dtype!r}")
        if any(self.layer_kind(i) == "csa" for i in range(self.n_layers)):
            d = self.index_head_dim
            need(d >= self.rope_dim and d & (d - 1) == 0, "index_head_dim",
                 f"{d} must be a power of two >= qk_rope_head_dim {self.rope_dim} (Hadamard)")
            need(self.index_topk > 0 and self.index_n_heads > 0, "index_topk", "indexer sizes must be positive")
        need(self.n_mtp_layers in (0, 1), "num_nextn_predict_layers", f"{self.n_mtp_layers}: only 0 or 1 supported")
        return self

    def check_tp(self, tp: int, numerics: str = "plain") -> "ModelConfig":
        """Refuse a tensor-parallel split the model cannot run, naming the field and the sizes.

        Every split dim must divide by tp (engine.model.shards: heads, output groups, expert
        widths, vocab). In reference numerics an FP8-format linear whose input is a rank's
        slice rounds it to FP8 per 128 channels (fp8_sim(x, 128)), and an FP8 weight is held
        in 128x128 blocks: a rank's slice must hold whole 128-wide blocks. The sliced widths:
        the routed and shared experts' intermediate (w1/w3 rows, w2's input), the output
        groups' low rank (wo_a rows, wo_b's input) and the query heads (wq_b rows)."""
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        if tp == 1:
            return self
        def need(cond: bool, name: str, why: str):
            if not cond:
                raise ConfigError(f"config field `{name}`: {why}")

        split = [("num_attention_heads", self.n_heads), ("o_groups", self.o_groups),
                 ("moe_intermediate_size", self.moe_inter_dim), ("vocab_size", self.vocab_size)]
        for name, n in split:
            need(n % tp == 0, name, f"{n} does not split over tp = {tp} ranks")
        if numerics != "reference":
            return self
        blocks = []   # (field, full width, sliced width per rank, what rounds it)
        if self.expert_dtype in ("fp4", "fp8"):
            blocks.append(("moe_intermediate_size", self.moe_inter_dim, self.moe_inter_dim // tp,
                           "the routed experts' w2 input is FP8-rounded per 128 channels"))
        if self.fp8_linears:
            if self.n_shared_experts:
                full = self.moe_inter_dim * self.n_shared_experts
                blocks.append(("moe_intermediate_size", full, full // tp,
                               "the shared expert's w1/w3 rows and w2 input are FP8 blocks of 128"))
            full = self.o_groups * self.o_lora_rank
            blocks.append(("o_lora_rank", full, full // tp,
                           "o_groups x o_lora_rank is wo_b's FP8-rounded input (and wo_a's FP8 rows)"))
            full = self.n_heads * self.head_dim
            blocks.append(("num_attention_heads", full, full // tp,
                           "num_attention_heads x head_dim are wq_b's FP8 rows"))
        for name, full, local, why in blocks:
            need(local % 128 == 0, name,
                 f"tp = {tp} gives each rank a {local}-wide slice of {full}, not whole 128-wide FP8 blocks "
                 f"({why}); reference numerics need it a multiple of 128: use a smaller tp or numerics='plain'")
        return self

    # ---- reading ----
    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        with open(path) as f:
            return cls.from_dict(json.load(f), read_hf_quant_config(path.parent))

    @classmethod
    def from_dict(cls, d: dict, hf_quant: dict | None = None) -> "ModelConfig":
        """hf_quant: modelopt's hf_quant_config.json beside config.json, if any."""
        def get(*names, default=KeyError):
            for n in names:
                if n in d and d[n] is not None:
                    return d[n]
            if default is KeyError:
                raise ConfigError(f"config field `{names[0]}` is missing")
            return default

        n_layers = int(get("num_hidden_layers", "n_layers"))
        n_mtp = int(get("num_nextn_predict_layers", "n_mtp_layers", default=0))
        ratios, mtp_ratio = _read_ratios(d, n_layers, n_mtp)
        head_dim = int(get("head_dim"))
        rope_dim = get("qk_rope_head_dim", "rope_head_dim", default=None)
        if rope_dim is None:
            factor = get("partial_rotary_factor", default=None)
            if factor is None:
                raise ConfigError("config field `qk_rope_head_dim` is missing (nor `partial_rotary_factor`)")
            rope_dim = round(head_dim * factor)
        rope_theta, compress_theta, yarn = _read_rope(d)
        quant = d.get("quantization_config")
        expert_dtype = d.get("expert_dtype") or (quant or {}).get("expert_dtype") or ("fp4" if quant else "bf16")
        if nvfp4_declared(quant) or nvfp4_declared(hf_quant):
            expert_dtype = "nvfp4"  # wins over a top-level `expert_dtype: fp4` left from the MXFP4 source
        eos = get("eos_token_id", default=1)
        cfg = cls(
            vocab_size=int(get("vocab_size")),
            dim=int(get("hidden_size", "dim")),
            n_layers=n_layers,
            n_heads=int(get("num_attention_heads", "n_heads")),
            head_dim=head_dim,
            rope_dim=int(rope_dim),
            q_lora_rank=int(get("q_lora_rank")),
            o_groups=int(get("o_groups")),
            o_lora_rank=int(get("o_lora_rank")),
            n_routed_experts=int(get("n_routed_experts")),
            n_shared_experts=int(get("n_shared_experts", default=1)),
            n_activated_experts=int(get("num_experts_per_tok", "n_activated_experts")),
            moe_inter_dim=int(get("moe_intermediate_size", "moe_inter_dim")),
            compress_ratios=ratios,
            n_hash_layers=_read_hash_layers(d, n_layers),
            mtp_compress_ratio=mtp_ratio,
            n_mtp_layers=n_mtp,
            score_func=get("scoring_func", "score_func", default="sqrtsoftplus"),
            norm_topk_prob=bool(get("norm_topk_prob", default=True)),
            route_scale=float(get("routed_scaling_factor", "route_scale", default=1.0)),
            swiglu_limit=float(get("swiglu_limit", default=0.0)),
            window_size=int(get("sliding_window", "window_size", default=128)),
            index_n_heads=int(get("index_n_heads", default=64)),
            index_head_dim=int(get("index_head_dim", default=128)),
            index_topk=int(get("index_topk", default=512)),
            hc_mult=int(get("hc_mult", default=4)),
            hc_sinkhorn_iters=int(get("hc_sinkhorn_iters", default=20)),
            hc_eps=float(get("hc_eps", default=1e-6)),
            norm_eps=float(get("rms_norm_eps", "norm_eps", default=1e-6)),
            rope_theta=rope_theta,
            compress_rope_theta=compress_theta,
            yarn=yarn,
            max_position_embeddings=int(get("max_position_embeddings", default=1 << 20)),
            bos_token_id=int(get("bos_token_id", default=0)),
            eos_token_id=int(eos[0] if isinstance(eos, list) else eos),
            expert_dtype=expert_dtype,
            quantization=quant,
        )
        return cfg.validate()


def read_hf_quant_config(ckpt_dir: str | Path) -> dict | None:
    """modelopt's hf_quant_config.json in a checkpoint directory (None if there is none)."""
    path = Path(ckpt_dir) / HF_QUANT_CONFIG
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{HF_QUANT_CONFIG}: not valid JSON ({e})") from None


def nvfp4_declared(q: dict | None) -> bool:
    """Whether a quantization block (config.json's or hf_quant_config.json's) declares NVFP4:
    as the whole model's quant_algo, as moe_quant_algo, or for some quantized_layers entry."""
    if not isinstance(q, dict):
        return False
    q = q.get("quantization", q)  # hf_quant_config.json nests the block
    algos = [q.get("quant_algo"), q.get("moe_quant_algo")]
    algos += [v.get("quant_algo") for v in (q.get("quantized_layers") or {}).values() if isinstance(v, dict)]
    return any(isinstance(a, str) and a.upper() in _NVFP4_ALGOS for a in algos)


def _read_ratios(d: dict, n_layers: int, n_mtp: int) -> tuple[tuple[int, ...], int]:
    if "compress_ratios" in d and d["compress_ratios"] is not None:
        r = [int(x) for x in d["compress_ratios"]]
        if len(r) not in (n_layers, n_layers + n_mtp):
            raise ConfigError(f"config field `compress_ratios`: {len(r)} entries, expected {n_layers} "
                              f"(+{n_mtp} MTP) for num_hidden_layers={n_layers}")
        return tuple(r[:n_layers]), (r[n_layers] if len(r) > n_layers else 0)
    kinds = d.get("layer_types")
    if kinds is None:
        raise ConfigError("config field `compress_ratios` is missing (nor `layer_types`)")
    if len(kinds) != n_layers:
        raise ConfigError(f"config field `layer_types`: {len(kinds)} entries for {n_layers} layers")
    rates = dict(_HF_KIND_RATIO)
    for k, v in (d.get("compress_rates") or {}).items():
        if k not in rates:
            raise ConfigError(f"config field `compress_rates`: unknown layer kind {k!r}")
        rates[k] = int(v)
    out = []
    for i, k in enumerate(kinds):
        if k not in rates:
            raise ConfigError(f"config field `layer_types`: unknown layer kind {k!r} at layer {i}")
        out.append(rates[k])
    return tuple(out), 0


def _read_hash_layers(d: dict, n_layers: int) -> int:
    if d.get("num_hash_layers") is not None:
        return int(d["num_hash_layers"])
    kinds = d.get("mlp_layer_types")
    if kinds is None:
        return 0
    if len(kinds) != n_layers:
        raise ConfigError(f"config field `mlp_layer_types`: {len(kinds)} entries for {n_layers} layers")
    for i, k in enumerate(kinds):
        if k not in ("hash_moe", "moe"):
            raise ConfigError(f"config field `mlp_layer_types`: unknown kind {k!r} at layer {i}")
    n = sum(k == "hash_moe" for k in kinds)
    if kinds[:n] != ["hash_moe"] * n:
        raise ConfigError("config field `mlp_layer_types`: hash_moe layers must come first")
    return n


def _read_yarn(rs: dict | None, where: str = "rope_scaling") -> YarnParams | None:
    if not rs or rs.get("type", rs.get("rope_type", "default")) in ("default", None):
        return None
    kind = rs.get("type", rs.get("rope_type"))
    if kind != "yarn":
        raise ConfigError(f"config field `{where}`: unsupported type {kind!r}")
    for key in ("factor", "original_max_position_embeddings"):
        if key not in rs:
            raise ConfigError(f"config field `{where}.{key}` is missing")
    return YarnParams(float(rs["factor"]), int(rs["original_max_position_embeddings"]),
                      float(rs.get("beta_fast", 32)), float(rs.get("beta_slow", 1)))


def _read_rope(d: dict) -> tuple[float, float, YarnParams | None]:
    rp = d.get("rope_parameters")
    if isinstance(rp, dict) and isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main, comp = rp["main"], rp["compress"]
        if main.get("rope_type", "default") != "default":
            raise ConfigError("config field `rope_parameters.main`: sliding layers use plain RoPE")
        return float(main["rope_theta"]), float(comp["rope_theta"]), _read_yarn(comp, "rope_parameters.compress")
    rs = d.get("rope_scaling")
    if rs is None and isinstance(rp, dict) and "factor" in rp:
        rs = rp
    theta = d.get("rope_theta", (rp or {}).get("rope_theta", 10000.0))
    return float(theta), float(d.get("compress_rope_theta", 160000.0)), _read_yarn(rs)

