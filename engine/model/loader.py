"""Checkpoint loading: safetensors (single file or sharded), official or transformers names.

Tensors are read memory-mapped and converted one at a time: FP8 e4m3 weights with
E8M0 128x128 `.scale`, MXFP4 experts (two e2m1 per byte, E8M0 per 32), NVFP4 experts
as NVIDIA's modelopt writes them (uint8 `.weight`, e4m3 `.weight_scale` per 16, fp32
`.weight_scale_2`, fp32 `.input_scale`) and plain bf16/fp32. Formats may be mixed: an
NVFP4 checkpoint keeps FP8 attention and MXFP4 MTP experts. Every parameter must be
filled exactly once, with the right shape; anything missing, unexpected or malformed is
an error naming the tensor.
"""
from __future__ import annotations

import fnmatch
import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

from .config import HF_QUANT_CONFIG, ModelConfig, nvfp4_declared, read_hf_quant_config
from .formats import fp8_block_dequant, mxfp4_dequant, nvfp4_dequant
from .model import Transformer
from .shards import read_shard
from ..parallel.state import tp_rank, tp_size

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """The checkpoint does not match the model; the message names the tensor."""


class Checkpoint:
    """Name -> tensor over one or many safetensors files, opened lazily, memory-mapped."""

    def __init__(self, path: str | Path):
        path = Path(path)
        index = path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"no *.safetensors files in {path}")
            weight_map = {}
            for f in files:
                with safe_open(f, framework="pt") as sf:
                    weight_map.update({k: f.name for k in sf.keys()})
        self.dir, self.weight_map, self._open = path, weight_map, {}

    def names(self) -> list[str]:
        return list(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def get_slice(self, name: str):
        """safetensors' lazy slice (shape, dtype, and reading only a range)."""
        return self.get_file(name).get_slice(name)

    def get_slice_range(self, name: str, dim: int, lo: int, hi: int) -> torch.Tensor:
        idx = [slice(None)] * len(self.get_slice(name).get_shape())
        idx[dim] = slice(lo, hi)
        return self.get_slice(name)[tuple(idx)]

    def get_file(self, name: str):
        fname = self.weight_map[name]
        if fname not in self._open:
            f = self.dir / fname
            if not f.exists():
                raise CheckpointError(f"tensor {name}: shard {fname} listed in the index is missing")
            self._open[fname] = safe_open(f, framework="pt")
        return self._open[fname]

    def get(self, name: str) -> torch.Tensor:
        f = self.get_file(name)
        try:
            return f.get_tensor(name)
        except Exception as e:  # a name in the index but not in the shard
            raise CheckpointError(f"tensor {name}: cannot be read from {self.weight_map[name]} ({e})") from None


# transformers' DeepseekV4 names (as loaded, and as its save_pretrained half-reverses them)
# -> DeepSeek's; applied in order to names without `model.`.
_HF_RENAMES = [
    (r"^embed_tokens\.", "embed."), (r"^lm_head\.", "head."),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"\.input_layernorm\.", ".attn_norm."), (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."), (r"\.mlp\.", ".ffn."),
    (r"\.sinks$", ".attn_sink"), (r"\.q_a_proj\.", ".wq_a."), (r"\.q_a_norm\.", ".q_norm."),
    (r"\.q_b_proj\.", ".wq_b."), (r"\.o_a_proj\.", ".wo_a."), (r"\.o_b_proj\.", ".wo_b."),
    (r"\.compressor\.kv_proj\.", ".compressor.wkv."), (r"\.compressor\.gate_proj\.", ".compressor.wgate."),
    (r"\.compressor\.position_bias$", ".compressor.ape"), (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.attn\.kv_proj\.", ".attn.wkv."),
    # transformers' save_pretrained reverses its own `.norm.` -> `.kv_norm.` rename too widely
    (r"\.attn\.norm\.", ".attn.kv_norm."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."), (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    # modelopt's HF export writes routed experts unfused, one projection each
    (r"\.experts\.(\d+)\.gate_proj\.", r".experts.\1.w1."), (r"\.experts\.(\d+)\.up_proj\.", r".experts.\1.w3."),
    (r"\.experts\.(\d+)\.down_proj\.", r".experts.\1.w2."),
]
_EXPERT = re.compile(r"^(.*\.ffn\.experts)\.(\d+)\.(w[123])\.weight$")


def hf_to_official(name: str) -> str:
    name = name.removeprefix("model.")
    for pat, rep in _HF_RENAMES:
        name = re.sub(pat, rep, name)
    return name


# companions read together with their `.weight`: MXFP4/FP8 `.scale`, modelopt NVFP4's three
_COMPANIONS = (".scale", ".weight_scale", ".weight_scale_2", ".input_scale")


def _weight_of(name: str) -> str | None:
    """The `.weight` a companion tensor belongs to (None if `name` is no companion)."""
    for suffix in _COMPANIONS:
        if name.endswith(suffix):
            return name[: -len(suffix)] + ".weight"
    return None


def _dequant(ckpt: Checkpoint, name: str, fmt_hint: str | None = None) -> torch.Tensor:
    """Read `name` (a `.weight`) and apply its companion scales, if any."""
    w = ckpt.get(name)
    base = name[: -len(".weight")] if name.endswith(".weight") else None
    if base is not None and base + ".weight_scale" in ckpt:
        return _nvfp4(ckpt, name, base, w)
    stray = [base + p for p in (".weight_scale_2", ".input_scale") if base is not None and base + p in ckpt]
    if stray:
        raise CheckpointError(f"tensor {name}: NVFP4 weight without its block scales {base}.weight_scale "
                              f"(but {stray[0]} is there)")
    scale_name = base + ".scale" if base is not None else None
    has_scale = scale_name is not None and scale_name in ckpt
    if w.dtype == torch.float8_e4m3fn:
        if not has_scale:
            raise CheckpointError(f"tensor {name}: FP8 weight without its scale {scale_name}")
        return _checked(fp8_block_dequant, w, ckpt.get(scale_name), name)
    if w.dtype in (torch.int8, torch.uint8):
        if not has_scale:
            raise CheckpointError(f"tensor {name}: packed FP4 weight without its scale {scale_name}")
        return _checked(mxfp4_dequant, w, ckpt.get(scale_name), name)
    if has_scale:
        raise CheckpointError(f"tensor {name}: has a scale {scale_name} but dtype {w.dtype} is not FP8/FP4")
    if not (w.is_floating_point() or name.endswith("tid2eid")):
        raise CheckpointError(f"tensor {name}: unexpected dtype {w.dtype}")
    return w


def _nvfp4(ckpt: Checkpoint, name: str, base: str, w: torch.Tensor) -> torch.Tensor:
    """modelopt NVFP4: uint8 `.weight`, e4m3 `.weight_scale` [out, in/16], fp32 `.weight_scale_2`;
    `.input_scale` (W4A4 activations) is validated but unused: the experts run W4A16."""
    if base + ".scale" in ckpt:
        raise CheckpointError(f"tensor {name}: has both an MXFP4/FP8 scale {base}.scale and NVFP4 {base}.weight_scale")
    if w.dtype not in (torch.uint8, torch.int8):
        raise CheckpointError(f"tensor {name}: NVFP4 weight must be packed uint8, got {w.dtype}")
    ws2 = base + ".weight_scale_2"
    if ws2 not in ckpt:
        raise CheckpointError(f"tensor {name}: NVFP4 weight without its global scale {ws2}")
    if base + ".input_scale" in ckpt:
        _check_input_scale(ckpt.get(base + ".input_scale"), base + ".input_scale")
    try:
        return nvfp4_dequant(w, ckpt.get(base + ".weight_scale"), ckpt.get(ws2), name=name)
    except ValueError as e:
        raise CheckpointError(f"tensor {name}: {e}") from None


def _check_input_scale(t: torch.Tensor, name: str):
    if t.dtype != torch.float32 or t.numel() != 1 or t.dim() > 1:
        raise CheckpointError(f"tensor {name}: must be one fp32 value, got {t.dtype} of shape {tuple(t.shape)}")
    if not bool(torch.isfinite(t).all() & (t > 0).all()):
        raise CheckpointError(f"tensor {name}: must be finite and > 0, got {t.item()}")


class _Nvfp4Meta:
    """What config.json / hf_quant_config.json declare about NVFP4, checked against the tensors.

    Tensors describe their own format, so an undeclared NVFP4 tensor is an error (a config
    lost in copying), while one in an excluded module only warns: exclude lists are
    fnmatch hints in each producer's own naming."""

    def __init__(self, path: Path, cfg: ModelConfig):
        hq = read_hf_quant_config(path)
        self.declared = nvfp4_declared(cfg.quantization) or nvfp4_declared(hq)
        q = (hq or {}).get("quantization") or {}
        self.exclude = list(q.get("exclude_modules") or []) + list((cfg.quantization or {}).get("ignore") or [])
        self.contradicted: list[str] = []

    def check(self, scale_name: str, official: str):
        if not self.declared:
            raise CheckpointError(f"tensor {scale_name}: NVFP4 block scales, but neither {HF_QUANT_CONFIG} nor "
                                  f"config.json's quantization_config declares NVFP4 (quant_algo)")
        modules = (scale_name[: -len(".weight_scale")], official[: -len(".weight_scale")])
        if any(fnmatch.fnmatchcase(m, p) or fnmatch.fnmatchcase(m, p + ".*") for m in modules for p in self.exclude):
            self.contradicted.append(scale_name)

    def report(self):
        if self.contradicted:
            log.warning("%d NVFP4 tensors lie in modules the quantization config excludes (e.g. %s); "
                        "loaded as stored", len(self.contradicted), self.contradicted[0])


def _checked(dequant, w: torch.Tensor, scale: torch.Tensor, name: str) -> torch.Tensor:
    """formats' ValueErrors (scale shape or dtype, a NaN scale byte) as CheckpointErrors."""
    try:
        return dequant(w, scale, name=name)
    except ValueError as e:
        raise CheckpointError(f"tensor {name}: {e}") from None


class _Filler:
    """Tracks which parameters (and expert slices) have been written."""

    def __init__(self, model: Transformer):
        self.params = dict(model.named_parameters())
        self.params.update(model.named_buffers(remove_duplicate=False))
        self.params = {k: v for k, v in self.params.items() if not k.endswith("inv_freq")}
        self.done: set = set()
        self.nvfp4_parts: dict = {}   # experts module -> {(expert, "w1"|"w2"|"w3"): (codes, scales, global)}

    def attach_nvfp4_parts(self, model: Transformer):
        """Hand each Experts module whose every projection is NVFP4 the checkpoint's own codes and
        scales (this rank's slices), stacked per projection, for Experts.pack."""
        for prefix, got in self.nvfp4_parts.items():
            experts = model.get_submodule(prefix)
            E = experts.w1.shape[0]
            if len(got) == 3 * E:
                experts.nvfp4_parts = [tuple(torch.stack([got[e, w][i] for e in range(E)]) for i in range(3))
                                       for w in ("w1", "w3", "w2")]

    def put(self, target: str, value: torch.Tensor, src: str, index: int | None = None):
        if target not in self.params:
            raise CheckpointError(f"unexpected tensor {src} (no parameter {target} in this model)")
        p = self.params[target]
        key = (target, index)
        dest = p if index is None else (p[index] if 0 <= index < p.shape[0] else None)
        if dest is None:
            raise CheckpointError(f"tensor {src}: expert index {index} out of range [0, {p.shape[0]})")
        if key in self.done:
            raise CheckpointError(f"tensor {src}: {target} given twice")
        if tuple(value.shape) != tuple(dest.shape):
            raise CheckpointError(f"tensor {src}: shape {tuple(value.shape)}, expected {tuple(dest.shape)}")
        if target.endswith("tid2eid"):
            if value.is_floating_point():
                raise CheckpointError(f"tensor {src}: tid2eid must be integer, got {value.dtype}")
            n_exp = self.params[target.replace("tid2eid", "weight")].shape[0]
            if value.numel() and (value.min() < 0 or value.max() >= n_exp):
                raise CheckpointError(f"tensor {src}: expert ids outside [0, {n_exp})")
        with torch.no_grad():
            dest.copy_(value.to(dest.dtype))
        self.done.add(key)

    def check_complete(self):
        missing = []
        for name, p in self.params.items():
            if name.endswith(("experts.w1", "experts.w2", "experts.w3")):
                missing += [f"{name}[{e}]" for e in range(p.shape[0]) if (name, e) not in self.done
                            and (name, None) not in self.done]
            elif (name, None) not in self.done:
                missing.append(name)
        if missing:
            head = ", ".join(missing[:8]) + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
            raise CheckpointError(f"missing tensors: {head}")


def load_model(path: str | Path, device="cpu", dtype=torch.float32, numerics: str = "plain",
               with_mtp: bool | None = None) -> Transformer:
    """Build the model from `path`'s config.json and fill it from its safetensors.

    with_mtp: None loads the MTP block when the checkpoint has one (transformers drops
    it on save); True requires it; False skips it.
    """
    path = Path(path)
    cfg = ModelConfig.from_file(path)
    ckpt = Checkpoint(path)
    names = ckpt.names()
    hf_style = any(n.startswith(("model.", "lm_head.")) for n in names)
    has_mtp = any(n.startswith("mtp.") for n in names)
    if with_mtp is None:
        with_mtp = has_mtp
        if cfg.n_mtp_layers and not has_mtp:
            log.warning("%s: config declares an MTP block but the checkpoint has none; loading without it", path)
    elif with_mtp and cfg.n_mtp_layers and not has_mtp:
        raise CheckpointError("missing tensors: mtp.0.* (the MTP block)")
    with torch.device(device):
        model = Transformer(cfg, dtype=dtype, with_mtp=with_mtp)
    filler, nvfp4 = _Filler(model), _Nvfp4Meta(path, cfg)
    for name in names:
        off = hf_to_official(name) if hf_style else name
        if (weight := _weight_of(name)) is not None and weight in ckpt:
            if name.endswith(".weight_scale"):
                nvfp4.check(name, off)
            continue  # read together with its weight
        if weight is not None and not name.endswith(".scale"):
            raise CheckpointError(f"unexpected tensor {name}: its weight {weight} is not in the checkpoint")
        if name.startswith("mtp.") and not len(model.mtp):
            continue
        _load_tensor(ckpt, name, off, filler, device)
    filler.check_complete()
    filler.attach_nvfp4_parts(model)
    nvfp4.report()
    return model.set_numerics(numerics).eval()


class _View:
    """A checkpoint seen through a reader of parts (tensor-parallel slices)."""

    def __init__(self, ckpt: Checkpoint, get):
        self.ckpt, self.get = ckpt, get

    def __contains__(self, name: str) -> bool:
        return name in self.ckpt


def _load_tensor(ckpt: Checkpoint, name: str, off: str, filler: _Filler, device):
    """Checkpoint tensor `name`, known by its official name `off`, into its parameter
    (this rank's shard of it under tensor parallelism)."""
    m = _EXPERT.match(off)
    base = name[: -len(".weight")]
    raw = []

    def dequant(get):
        w = _dequant(_View(ckpt, get), name)           # validates the parts first
        if m and base + ".weight_scale_2" in ckpt:   # NVFP4 expert: keep this rank's codes for the kernel
            raw.append(tuple(get(p) for p in (name, base + ".weight_scale", base + ".weight_scale_2")))
        return w

    value = read_shard(ckpt, name, off, tp_rank(), tp_size(), dequant).to(device)
    if m:
        filler.put(f"{m[1]}.{m[3]}", value, name, int(m[2]))
        if raw:
            filler.nvfp4_parts.setdefault(m[1], {})[(int(m[2]), m[3])] = tuple(t.to(device) for t in raw[0])
    elif off.endswith(".ffn.experts.gate_up_proj"):  # transformers' merged [E, 2*I, D]
        if value.dim() != 3 or value.shape[1] % 2:
            raise CheckpointError(f"tensor {name}: shape {tuple(value.shape)} is not [E, 2*I, D]")
        w1, w3 = value.chunk(2, dim=1)
        filler.put(off.replace("gate_up_proj", "w1"), w1, name)
        filler.put(off.replace("gate_up_proj", "w3"), w3, name)
    elif off.endswith(".ffn.experts.down_proj"):
        filler.put(off.replace("down_proj", "w2"), value, name)
    else:
        filler.put(off, value, name)
