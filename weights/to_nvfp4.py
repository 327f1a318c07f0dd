"""Convert a DeepSeek-V4 checkpoint's routed experts to NVIDIA's NVFP4 (modelopt) layout.

    python -m weights.to_nvfp4 SRC DST [--from-bf16] [--input-scale S]

Every ``layers.L.ffn.experts.E.w{1,2,3}`` becomes ``.weight`` (uint8 ``[out, in/2]``),
``.weight_scale`` (float8_e4m3fn ``[out, in/16]``), ``.weight_scale_2`` (fp32 scalar, one
per expert shared by w1 and w3) and ``.input_scale`` (fp32 scalar); the MXFP4 ``.scale``
goes. Everything else (FP8 attention, shared experts, gate, head, the MTP block and its
experts) is copied as is and listed as excluded. Shard names and the index are kept.

MXFP4 experts are transcoded losslessly (same nibbles, exact power-of-two scales): each
tensor is dequantized both ways and compared bit for bit, and a tensor whose scales span
more than E4M3 can hold exactly is an error naming it. bf16/fp32 experts (``--from-bf16``)
are quantized with modelopt's ``NVFP4QTensor.quantize``.

``input_scale`` is only used by W4A4 (Blackwell) engines; with no calibration data it is
a placeholder (``--input-scale``, default 1.0). W4A16 engines, this one included, ignore it.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from engine.model import formats
from engine.model.config import HF_QUANT_CONFIG, nvfp4_declared, read_hf_quant_config
from engine.model.loader import Checkpoint

INDEX = "model.safetensors.index.json"
EXPERT = re.compile(r"^(layers\.(\d+)\.ffn\.experts\.\d+\.(w[123]))\.weight$")  # main blocks only
GROUP = formats.NVFP4_BLOCK
PRODUCER = {"name": "weights.to_nvfp4", "version": "1"}
# modules that keep their source format (fnmatch patterns on official module names)
EXCLUDE = ["embed", "head", "*.attn.*", "*.ffn.gate", "*.ffn.shared_experts.*", "mtp.*"]
_PARTNER = {"w1": "w3", "w3": "w1"}  # gate and up share weight_scale_2 so GEMM1 can fuse


class ConvertError(ValueError):
    """The source cannot be converted as asked; the message names the tensor."""


class DictSource:
    """name -> tensor dict seen as a checkpoint (what Checkpoint offers: `in`, get, names)."""

    def __init__(self, tensors: dict):
        self.tensors = tensors

    def __contains__(self, name):
        return name in self.tensors

    def get(self, name):
        return self.tensors[name]

    def names(self):
        return list(self.tensors)


class Converter:
    """Turns source tensors into NVFP4 expert tensors, one expert projection at a time."""

    def __init__(self, src, from_bf16=False, input_scale=1.0):
        self.src, self.from_bf16 = src, from_bf16
        self.input_scale = torch.tensor(float(input_scale), dtype=torch.float32)
        if not (self.input_scale > 0 and torch.isfinite(self.input_scale)):
            raise ConvertError(f"--input-scale must be finite and > 0, got {input_scale}")
        self.layers: set[int] = set()
        self.n_lossless = self.n_quantized = 0
        self._shared: dict[str, object] = {}  # expert prefix -> shared top exponent / global scale

    def wanted(self, name: str) -> bool:
        """False for tensors that the NVFP4 layout drops (an expert's MXFP4 `.scale`)."""
        return not (name.endswith(".scale") and EXPERT.match(name[: -len(".scale")] + ".weight")
                    and name[: -len(".scale")] + ".weight" in self.src)

    def convert(self, name: str) -> dict[str, torch.Tensor]:
        """Output tensors for source tensor `name`: itself, or an expert's four NVFP4 tensors."""
        m = EXPERT.match(name)
        if m is None:
            return {name: self.src.get(name)} if self.wanted(name) else {}
        base, proj = m[1], m[3]
        w = self.src.get(name)
        if w.dtype in (torch.int8, torch.uint8) and base + ".scale" in self.src:
            q = self._transcode(base, proj, w)
            self.n_lossless += 1
        elif w.is_floating_point() and base + ".scale" not in self.src:
            if not self.from_bf16:
                raise ConvertError(f"tensor {name}: {w.dtype} expert; pass --from-bf16 to quantize it with modelopt")
            q = self._quantize(base, proj, w)
            self.n_quantized += 1
        else:
            raise ConvertError(f"tensor {name}: expected an MXFP4 expert (int8 + {base}.scale) or a bf16/fp32 "
                               f"one, got {w.dtype}" + (" with a scale" if base + ".scale" in self.src else ""))
        self.layers.add(int(m[2]))
        return {f"{base}.weight": q[0], f"{base}.weight_scale": q[1], f"{base}.weight_scale_2": q[2],
                f"{base}.input_scale": self.input_scale.clone()}

    def _expert(self, base: str) -> str:
        return base.rsplit(".", 1)[0]

    def _pair(self, base: str, proj: str) -> list[str]:
        """The projections sharing one weight_scale_2: w1 with w3 (if present), w2 alone."""
        partner = f"{self._expert(base)}.{_PARTNER[proj]}" if proj in _PARTNER else None
        return [base] + ([partner] if partner and partner + ".weight" in self.src else [])

    def _transcode(self, base: str, proj: str, w: torch.Tensor):
        key = base if proj == "w2" else self._expert(base)
        try:
            if key not in self._shared:
                tops = [formats.mxfp4_top_exponent(self.src.get(b + ".weight"), self._scale(b), name=b + ".weight")
                        for b in self._pair(base, proj)]
                tops = [t for t in tops if t is not None]
                self._shared[key] = max(tops) if tops else None
            return formats.mxfp4_to_nvfp4(w, self._scale(base), top_exp=self._shared[key], name=base + ".weight")
        except ValueError as e:  # formats' errors name the tensor; ConvertError is one too
            raise ConvertError(str(e)) from None

    def _scale(self, base: str) -> torch.Tensor:
        if base + ".scale" not in self.src:
            raise ConvertError(f"tensor {base}.weight: its partner's MXFP4 scale {base}.scale is missing")
        return self.src.get(base + ".scale")

    def _quantize(self, base: str, proj: str, w: torch.Tensor):
        key = base if proj == "w2" else self._expert(base)
        if key not in self._shared:
            amax = max(float(self.src.get(b + ".weight").float().abs().amax()) for b in self._pair(base, proj))
            amax = torch.tensor(amax if amax > 0 else formats.FP4_MAX * formats.FP8_MAX, dtype=torch.float32)
            self._shared[key] = amax / (formats.FP4_MAX * formats.FP8_MAX)  # modelopt's amax/(6*448)
        w, ws, ws2 = modelopt_nvfp4(w, self._shared[key])
        return w, ws, ws2.clone()  # w1's and w3's must not share storage (safetensors refuses)


def modelopt_nvfp4(w: torch.Tensor, weight_scale_2: torch.Tensor | None = None):
    """modelopt's own NVFP4 weight quantizer (pure torch, CPU-safe) -> (uint8, e4m3, fp32 0-d)."""
    from modelopt.torch.quantization.qtensor import NVFP4QTensor  # heavy import: only when quantizing

    qt, ws, ws2 = NVFP4QTensor.quantize(w.float(), GROUP, weights_scaling_factor_2=weight_scale_2,
                                        try_tensorrt=False)
    return qt._quantized_data.view(torch.uint8), ws, ws2.float().reshape(())


def convert_tensors(tensors: dict, from_bf16=False, input_scale=1.0):
    """In memory: name -> tensor dict -> (NVFP4 dict, converted layer ids). For small models."""
    conv = Converter(DictSource(tensors), from_bf16, input_scale)
    out = {}
    for name in tensors:
        out.update(conv.convert(name))
    if not conv.layers:
        raise ConvertError("no routed-expert tensors (layers.L.ffn.experts.E.w{1,2,3}.weight) found")
    return out, sorted(conv.layers)


def quant_configs(cfg: dict, layers) -> tuple[dict, dict]:
    """config.json with its NVFP4 quantization_config, and hf_quant_config.json, as NVIDIA's
    DeepSeek-V4 recipe writes them: the source block (FP8 `quant_method`) kept, NVFP4 added."""
    group = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": GROUP}
    block = {
        "quant_algo": "MIXED_PRECISION",
        "moe_quant_algo": "NVFP4",
        "kv_cache_quant_algo": None,
        "group_size": GROUP,
        "quantized_layers": {f"layers.{L}.ffn.experts": {"quant_algo": "NVFP4", "group_size": GROUP}
                             for L in sorted(layers)},
    }
    q = {**(cfg.get("quantization_config") or {}), **block, "producer": PRODUCER, "ignore": EXCLUDE,
         "config_groups": {"group_0": {"input_activations": group, "weights": group, "targets": ["Linear"]}}}
    hq = {"producer": PRODUCER, "quantization": {**block, "exclude_modules": EXCLUDE}}
    return {**cfg, "quantization_config": q}, hq


# ----------------------------------------------------------------------------- on disk


def _shards(ckpt: Checkpoint) -> dict[str, list[str]]:
    plan: dict[str, list[str]] = {}
    for name, fname in ckpt.weight_map.items():
        plan.setdefault(fname, []).append(name)
    return plan


def _copy_others(src: Path, dst: Path):
    skip = {INDEX, "config.json", HF_QUANT_CONFIG}
    for f in src.iterdir():
        if f.name in skip or f.suffix == ".safetensors":
            continue
        if f.is_dir():
            shutil.copytree(f, dst / f.name, dirs_exist_ok=True)
        else:
            shutil.copy2(f, dst / f.name)


def _check_source(src: Path, dst: Path, cfg: dict):
    if dst.resolve() == src.resolve():
        raise ConvertError("DST must differ from SRC")
    if nvfp4_declared(cfg.get("quantization_config")) or nvfp4_declared(read_hf_quant_config(src)):
        raise ConvertError(f"{src} already declares NVFP4")


def convert(src, dst, from_bf16=False, input_scale=1.0) -> Converter:
    """SRC checkpoint dir -> DST with NVFP4 experts; one source shard in memory at a time."""
    src, dst = Path(src), Path(dst)
    cfg = json.loads((src / "config.json").read_text())
    _check_source(src, dst, cfg)
    ckpt = Checkpoint(src)
    conv = Converter(ckpt, from_bf16, input_scale)
    dst.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    with tqdm(total=len(ckpt.weight_map), unit="tensor", desc="to_nvfp4") as bar:
        for fname, names in _shards(ckpt).items():
            bar.set_postfix_str(fname)
            out = {}
            for name in names:
                out.update(conv.convert(name))
                bar.update()
            out = {k: v.contiguous() for k, v in out.items()}
            save_file(out, str(dst / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in out})
            total += sum(t.numel() * t.element_size() for t in out.values())
            del out
    if not conv.layers:
        raise ConvertError(f"{src}: no routed-expert tensors (layers.L.ffn.experts.E.w{{1,2,3}}.weight) found")
    if (src / INDEX).exists():
        (dst / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                             "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    new_cfg, hq = quant_configs(cfg, conv.layers)
    (dst / "config.json").write_text(json.dumps(new_cfg, indent=2) + "\n")
    (dst / HF_QUANT_CONFIG).write_text(json.dumps(hq, indent=2) + "\n")
    _copy_others(src, dst)
    return conv


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m weights.to_nvfp4", description=__doc__.split("\n")[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--from-bf16", action="store_true", help="quantize bf16/fp32 experts with modelopt")
    ap.add_argument("--input-scale", type=float, default=1.0,
                    help="placeholder activation scale written for W4A4 engines (default 1.0)")
    a = ap.parse_args(argv)
    try:
        conv = convert(a.src, a.dst, a.from_bf16, a.input_scale)
    except ConvertError as e:
        raise SystemExit(f"error: {e}") from None
    print(f"{a.dst}: {conv.n_lossless} MXFP4 expert tensors transcoded bit-exactly, "
          f"{conv.n_quantized} quantized from bf16, layers {sorted(conv.layers)}")


if __name__ == "__main__":
    main()
