"""Which slice of each checkpoint tensor a tensor-parallel rank owns, and reading only that.

The plan follows DeepSeek's reference: vocab rows of embed and head, the query heads
(wq_b rows, attn_sink), whole output groups (wo_a rows; wo_b columns), and every
expert's intermediate width (w1/w3 rows, w2 columns; the shared expert likewise). The
rest (norms, mHC, wq_a, wkv, compressors, the indexer, the gate) is replicated.

A slice is read through safetensors' lazy slicing: only the rows/columns of the owned
range, widened to the quantisation block that holds them (FP8: 128x128; FP4: 32 or 16
columns), are read, dequantised, then cut to the exact range.
"""
import re

import torch

_SPLIT = [
    (r"^(embed|head)\.weight$", 0),
    (r"\.attn\.wq_b\.weight$", 0),
    (r"\.attn\.attn_sink$", 0),
    (r"\.attn\.wo_a\.weight$", 0),
    (r"\.attn\.wo_b\.weight$", 1),
    (r"\.ffn\.(experts\.\d+|shared_experts)\.(w1|w3)\.weight$", 0),
    (r"\.ffn\.(experts\.\d+|shared_experts)\.w2\.weight$", 1),
    (r"\.ffn\.experts\.gate_up_proj$", 1),   # transformers' merged [E, 2I, D]: both halves
    (r"\.ffn\.experts\.down_proj$", 2),      # [E, D, I]
]


def split_dim(official_name: str) -> int | None:
    for pat, dim in _SPLIT:
        if re.search(pat, official_name):
            return dim
    return None


def _range(n: int, rank: int, size: int, name: str) -> tuple[int, int]:
    if n % size:
        raise ValueError(f"tensor {name}: dimension {n} does not split over tp = {size}")
    step = n // size
    return rank * step, (rank + 1) * step


def _cut(t: torch.Tensor, dim: int, lo: int, hi: int) -> torch.Tensor:
    return t.narrow(dim, lo, hi - lo)


def read_shard(ckpt, name: str, official: str, rank: int, size: int, dequant):
    """This rank's part of tensor `name` (dequantised), or the whole tensor if replicated.

    dequant(get) -> tensor: dequantises `name` reading its parts through get(part_name)."""
    dim = split_dim(official)
    if size == 1 or dim is None:
        return dequant(ckpt.get)
    sl = ckpt.get_slice(name)
    shape, dtype = sl.get_shape(), sl.get_dtype()
    packed = dtype in ("I8", "U8")             # two e2m1 per byte along the columns
    logical = list(shape)
    if packed:
        logical[-1] *= 2
    if official.endswith("gate_up_proj"):      # halves [w1; w3] along dim 1, each split
        half = logical[1] // 2
        lo, hi = _range(half, rank, size, name)
        return torch.cat((ckpt.get_slice_range(name, 1, lo, hi), ckpt.get_slice_range(name, 1, half + lo, half + hi)),
                         dim=1)
    lo, hi = _range(logical[dim], rank, size, name)
    if dtype == "F8_E4M3":
        block = 128
    elif packed:
        block = 1 if dim == 0 else _fp4_block(ckpt, name, logical[-1])
    else:
        return ckpt.get_slice_range(name, dim, lo, hi)
    alo, ahi = lo // block * block, min(-(-hi // block) * block, logical[dim])

    def get(part: str) -> torch.Tensor:
        if part == name:
            s, e = (alo // 2, ahi // 2) if packed and dim == len(shape) - 1 else (alo, ahi)
            return ckpt.get_slice_range(part, dim, s, e)
        sshape = ckpt.get_slice(part).get_shape()
        if len(sshape) < 2:                    # per-tensor scales are replicated
            return ckpt.get(part)
        per = logical[dim] // sshape[dim] if dtype != "F8_E4M3" else 128
        per = max(per, 1)
        return ckpt.get_slice_range(part, dim, alo // per, -(-ahi // per))

    return _cut(dequant(get), dim, lo - alo, hi - alo).clone()


def _fp4_block(ckpt, name: str, cols: int) -> int:
    """Columns per scale of a packed FP4 weight: 32 (MXFP4) or 16 (NVFP4)."""
    base = name[: -len(".weight")]
    for scale in (base + ".scale", base + ".weight_scale"):
        if scale in ckpt:
            return cols // ckpt.get_slice(scale).get_shape()[-1]
    return 32
