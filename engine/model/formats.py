"""Checkpoint number formats of DeepSeek-V4-Flash (spec §4), as pure torch functions.

* E8M0: one unsigned byte per scale, value ``2^(byte-127)``; 0xFF is NaN.
* FP8: ``float8_e4m3fn`` weights with one E8M0 scale per 128x128 block.
* MXFP4: e2m1 codes packed two per byte (even column in the low nibble) with one
  E8M0 scale per 32 consecutive input columns of a row.
* NVFP4 (NVIDIA modelopt): the same packed e2m1 codes (uint8), one float8_e4m3fn scale
  per 16 input columns, and one fp32 per-tensor ``weight_scale_2``.

Everything dequantizes to fp32. The quantizers choose power-of-two scales exactly the
way the checkpoint's are chosen, so ``dequant(quant(w))`` is exact whenever ``w`` is
already on the target grid.
"""

import torch

# The helpers the kernels' references share live in the leaf engine.numerics; re-exported here.
from ..numerics import (E2M1_VALUES, FP4_MAX, FP8_MAX, _ceil_div, _check_2d, _e8m0_bytes,  # noqa: F401
                        _where, e8m0_to_float, exponent_to_e8m0, fp8_block_dequant, pow2_scale_exponent)

__all__ = [
    "E2M1_VALUES",
    "FP8_MAX",
    "FP4_MAX",
    "e8m0_to_float",
    "exponent_to_e8m0",
    "pow2_scale_exponent",
    "fp8_block_dequant",
    "fp8_block_quant",
    "unpack_fp4",
    "pack_fp4",
    "fp4_to_float",
    "float_to_fp4_codes",
    "mxfp4_dequant",
    "mxfp4_quant",
    "NVFP4_BLOCK",
    "nvfp4_dequant",
    "nvfp4_quant",
    "mxfp4_top_exponent",
    "mxfp4_to_nvfp4",
]

# Midpoints between neighbouring e2m1 magnitudes, with whether a tie rounds UP
# (true when the upper neighbour has an even code, i.e. round-half-to-even).
_FP4_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_FP4_TIE_UP = (False, True, False, True, False, True, False)



def _check_finite(w, name):
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"cannot quantize{_where(name)}: tensor has inf/NaN")


# ----------------------------------------------------------------------------- FP8 (block 128x128)


def fp8_block_quant(w, block=128, name=None):
    """fp32 ``w [out, in]`` -> (float8_e4m3fn weight, float8_e8m0fnu scale) per ``block``x``block``.

    Each block gets scale ``2^ceil(log2(amax/448))`` so the scaled block fits e4m3 without
    clipping; the cast to e4m3 rounds to nearest even.
    """
    _check_2d(w, "FP8 weight", name)
    _check_finite(w, name)
    w = w.float()
    out_f, in_f = w.shape
    ob, ib = _ceil_div(out_f, block), _ceil_div(in_f, block)
    # Zero-pad ragged edges so every block is full; padding never raises an amax.
    padded = w.new_zeros(ob * block, ib * block)
    padded[:out_f, :in_f] = w
    amax = padded.view(ob, block, ib, block).abs().amax(dim=(1, 3))  # [ob, ib]
    exp = pow2_scale_exponent(amax, FP8_MAX)
    s = torch.exp2(exp.float()).repeat_interleave(block, 0).repeat_interleave(block, 1)
    q = (w / s[:out_f, :in_f]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, exponent_to_e8m0(exp, name)


# ----------------------------------------------------------------------------- FP4 e2m1 codes


def unpack_fp4(packed, name=None):
    """Packed FP4 ``[out, in/2]`` (int8 or uint8) -> codes uint8 ``[out, in]``.

    Byte k holds column 2k in its low nibble and column 2k+1 in its high nibble.
    """
    _check_2d(packed, "packed FP4 weight", name)
    if packed.dtype not in (torch.int8, torch.uint8):
        raise ValueError(f"packed FP4 weight{_where(name)} must be int8/uint8, got {packed.dtype}")
    b = packed.view(torch.uint8)
    codes = torch.stack((b & 0x0F, b >> 4), dim=-1)  # [out, in/2, 2]
    return codes.reshape(b.shape[0], b.shape[1] * 2)


def pack_fp4(codes, name=None):
    """Codes ``[out, in]`` (values 0..15) -> packed int8 ``[out, in/2]``, even column in the low nibble."""
    _check_2d(codes, "FP4 codes", name)
    if codes.shape[1] % 2:
        raise ValueError(f"FP4 codes{_where(name)} need an even column count, got {tuple(codes.shape)}")
    c = codes.to(torch.int32)
    if bool(((c < 0) | (c > 15)).any()):
        raise ValueError(f"FP4 codes{_where(name)} must be in [0, 15]")
    c = c.view(c.shape[0], -1, 2)
    b = (c[..., 0] | (c[..., 1] << 4)).to(torch.uint8)
    return b.view(torch.int8)


def fp4_to_float(codes):
    """e2m1 codes (any shape, values 0..15) -> fp32 values via the code table."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def float_to_fp4_codes(x):
    """fp values -> e2m1 codes uint8: clamp to +-6, then round to nearest, ties to even code.

    The sign bit follows the input's sign, so small negatives become -0 (code 8).
    """
    x = x.float()
    if bool(torch.isnan(x).any()):
        raise ValueError("cannot convert NaN to FP4")
    a = x.abs().clamp_max(FP4_MAX)
    mag = torch.zeros_like(a, dtype=torch.int32)
    for mid, tie_up in zip(_FP4_MIDPOINTS, _FP4_TIE_UP):
        mag += (a >= mid if tie_up else a > mid).to(torch.int32)
    sign = torch.signbit(x).to(torch.int32) << 3
    return (mag | sign).to(torch.uint8)


# ----------------------------------------------------------------------------- MXFP4 (routed experts)


def mxfp4_dequant(weight, scale, block=32, name=None):
    """Packed FP4 ``weight [out, in/2]`` with E8M0 ``scale [out, in/block]`` -> fp32 ``[out, in]``.

    ``W[r, c] = fp4(r, c) * 2^(scale[r, c // block] - 127)``.
    """
    codes = unpack_fp4(weight, name)  # [out, in]
    _check_2d(scale, "MXFP4 scale", name)
    out_f, in_f = codes.shape
    if in_f % block:
        raise ValueError(f"MXFP4 weight{_where(name)}: in={in_f} is not a multiple of block {block}")
    want = (out_f, in_f // block)
    if tuple(scale.shape) != want:
        raise ValueError(f"MXFP4 scale shape mismatch{_where(name)}: packed weight "
                         f"{tuple(weight.shape)} (in={in_f}) needs scale {want}, got {tuple(scale.shape)}")
    s = e8m0_to_float(scale, name)  # [out, in/block]
    vals = fp4_to_float(codes).view(out_f, in_f // block, block)
    return (vals * s.unsqueeze(-1)).view(out_f, in_f)


def mxfp4_quant(w, block=32, name=None):
    """fp32 ``w [out, in]`` -> (packed int8 ``[out, in/2]``, float8_e8m0fnu scale ``[out, in/block]``).

    Per row and ``block`` columns the scale is ``2^ceil(log2(amax/6))``; values then round
    to nearest even on the e2m1 grid.
    """
    _check_2d(w, "MXFP4 weight", name)
    _check_finite(w, name)
    out_f, in_f = w.shape
    if in_f % block or block % 2:
        raise ValueError(f"MXFP4 weight{_where(name)}: in={in_f} must be a multiple of an even "
                         f"block ({block})")
    blocks = w.float().view(out_f, in_f // block, block)
    exp = pow2_scale_exponent(blocks.abs().amax(dim=-1), FP4_MAX)  # [out, in/block]
    scaled = blocks / torch.exp2(exp.float()).unsqueeze(-1)
    codes = float_to_fp4_codes(scaled).view(out_f, in_f)
    return pack_fp4(codes, name), exponent_to_e8m0(exp, name)


# ----------------------------------------------------------------------------- NVFP4 (modelopt)

NVFP4_BLOCK = 16
# E4M3 holds 2^k exactly for k in [-9, 8]: 2^-9 is its smallest subnormal, 256 its largest
# power of two (448 is not one). This window bounds what one tensor's block scales can span.
_E4M3_POW2_MIN, _E4M3_POW2_MAX = -9, 8


def _nvfp4_global(ws2, name):
    """weight_scale_2 (fp32, 0-d or one element) -> 0-d fp32, checked."""
    if ws2.dtype != torch.float32 or ws2.numel() != 1 or ws2.dim() > 1:
        raise ValueError(f"NVFP4 weight_scale_2{_where(name)} must be one fp32 value, "
                         f"got {ws2.dtype} of shape {tuple(ws2.shape)}")
    g = ws2.reshape(())
    if not bool(torch.isfinite(g) & (g > 0)):
        raise ValueError(f"NVFP4 weight_scale_2{_where(name)} must be finite and > 0, got {g.item()}")
    return g


def _nvfp4_block_scales(scale, out_f, in_f, name):
    """E4M3 ``weight_scale [out, in/16]`` -> fp32, checked (a NaN or negative scale is corrupt)."""
    if scale.dtype != torch.float8_e4m3fn:
        raise ValueError(f"NVFP4 weight_scale{_where(name)} must be float8_e4m3fn, got {scale.dtype}")
    want = (out_f, in_f // NVFP4_BLOCK)
    if tuple(scale.shape) != want:
        raise ValueError(f"NVFP4 weight_scale shape mismatch{_where(name)}: weight [out, in/2] with in={in_f} "
                         f"needs weight_scale {want}, got {tuple(scale.shape)}")
    s = scale.float()
    if bool(torch.isnan(s).any()):
        raise ValueError(f"NVFP4 weight_scale{_where(name)} contains NaN")
    if bool(torch.signbit(s).any()):
        raise ValueError(f"NVFP4 weight_scale{_where(name)} contains negative scales")
    return s


def nvfp4_dequant(weight, weight_scale, weight_scale_2, name=None):
    """Packed ``weight [out, in/2]`` (uint8), E4M3 ``weight_scale [out, in/16]``, fp32
    ``weight_scale_2`` -> fp32 ``[out, in]``: ``e2m1 * (weight_scale * weight_scale_2)``.

    The block scale is multiplied by the global first, as modelopt's
    ``NVFP4QTensor.dequantize`` does, so the two roundings (and the result) are identical.
    """
    codes = unpack_fp4(weight, name)
    out_f, in_f = codes.shape
    if in_f % NVFP4_BLOCK:
        raise ValueError(f"NVFP4 weight{_where(name)}: in={in_f} is not a multiple of {NVFP4_BLOCK}")
    s = _nvfp4_block_scales(weight_scale, out_f, in_f, name)
    g = _nvfp4_global(weight_scale_2, name)
    vals = fp4_to_float(codes).view(out_f, in_f // NVFP4_BLOCK, NVFP4_BLOCK)
    return (vals * (s * g).unsqueeze(-1)).view(out_f, in_f)


def nvfp4_quant(w, weight_scale_2=None, name=None):
    """fp32 ``w [out, in]`` -> (uint8 ``[out, in/2]``, float8_e4m3fn ``[out, in/16]``, fp32 0-d global).

    modelopt's NVFP4 weight quantization, op for op (so bit-identical to
    ``NVFP4QTensor.quantize``): global = amax/(6*448) unless given (w1/w3 share one);
    block scale = e4m3(clamp(block_amax / (6*global), 2^-9, 448)), 1 for an all-zero block;
    codes = e2m1 round-half-even of w / (block_scale * global), saturating at 6.
    """
    _check_2d(w, "NVFP4 weight", name)
    _check_finite(w, name)
    w = w.float()
    out_f, in_f = w.shape
    if in_f % NVFP4_BLOCK:
        raise ValueError(f"NVFP4 weight{_where(name)}: in={in_f} is not a multiple of {NVFP4_BLOCK}")
    if weight_scale_2 is None:
        amax = w.abs().amax()
        # modelopt divides 0/0 into NaN scales for an all-zero tensor; any positive global encodes it.
        weight_scale_2 = amax / (FP4_MAX * FP8_MAX) if bool(amax > 0) else torch.ones(())
    g = _nvfp4_global(torch.as_tensor(weight_scale_2, dtype=torch.float32), name)
    blocks = w.view(out_f, in_f // NVFP4_BLOCK, NVFP4_BLOCK)
    s = blocks.abs().amax(-1) / (FP4_MAX * g)  # 6*g is rounded first, as modelopt has it
    s = torch.where(s == 0, torch.ones_like(s), s)
    s8 = s.clamp(2.0 ** _E4M3_POW2_MIN, FP8_MAX).to(torch.float8_e4m3fn)
    scaled = (blocks / (s8.float() * g).unsqueeze(-1)).view(out_f, in_f)
    # + 0.0 turns -0 into +0: modelopt's sign bit is (x < 0), float_to_fp4_codes' is signbit(x).
    codes = float_to_fp4_codes(scaled + 0.0)
    return pack_fp4(codes, name).view(torch.uint8), s8, g.clone()


def _mxfp4_exponents(weight, scale, name):
    """Per MXFP4 block: exponent k (its scale is 2^k) and whether any of its codes is non-zero."""
    codes = unpack_fp4(weight, name)
    out_f, in_f = codes.shape
    want = (out_f, in_f // 32)
    if in_f % 32 or tuple(scale.shape) != want:
        raise ValueError(f"MXFP4 scale shape mismatch{_where(name)}: packed weight {tuple(weight.shape)} "
                         f"needs scale {want}, got {tuple(scale.shape)}")
    b = _e8m0_bytes(scale, name)
    if bool((b == 0xFF).any()):
        raise ValueError(f"E8M0 scale{_where(name)} contains 0xFF (NaN)")
    live = (codes.view(out_f, -1, 32) & 0x7).amax(-1) > 0  # +-0 codes decode to 0 under any scale
    return b.to(torch.int32) - 127, live


def mxfp4_top_exponent(weight, scale, name=None):
    """Largest block exponent of an MXFP4 tensor over blocks holding a non-zero value (None if all zero)."""
    k, live = _mxfp4_exponents(weight, scale, name)
    return int(k[live].max()) if bool(live.any()) else None


def mxfp4_to_nvfp4(weight, scale, top_exp=None, name=None):
    """Lossless MXFP4 -> NVFP4: (uint8 weight, e4m3 weight_scale, fp32 weight_scale_2).

    The nibbles are kept; each E8M0 per-32 scale 2^k becomes two E4M3 per-16 scales
    2^(k-m) under the global 2^m, m = top_exp - 8, so the largest maps to 256.
    ``top_exp`` defaults to this tensor's own largest exponent; pass the max over w1 and
    w3 so they share weight_scale_2. A non-zero block with k - m < -9 has no exact
    E4M3 scale: that raises (naming the tensor) instead of rounding. The result is
    proven by dequantizing both and comparing bit for bit.
    """
    k, live = _mxfp4_exponents(weight, scale, name)
    own_top = int(k[live].max()) if bool(live.any()) else None
    if top_exp is None:
        top_exp = _E4M3_POW2_MAX if own_top is None else own_top
    elif own_top is not None and own_top > top_exp:
        raise ValueError(f"top_exp{_where(name)} is 2^{top_exp}, below the tensor's largest block scale 2^{own_top}")
    m = top_exp - _E4M3_POW2_MAX
    d = k - m
    bad = live & (d < _E4M3_POW2_MIN)
    if bool(bad.any()):
        r, j = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"cannot transcode{_where(name)} MXFP4 -> NVFP4 losslessly: its block scales span "
            f"2^{int(k[live].min())}..2^{top_exp}, more than the 18 binades (2^-9..2^8) E4M3 block scales "
            f"cover under one fp32 global (first: row {r}, block {j}, scale 2^{int(k[r, j])})")
    d = d.clamp(_E4M3_POW2_MIN, _E4M3_POW2_MAX)  # only all-zero blocks are clamped: any scale decodes them
    ws = torch.exp2(d.float()).repeat_interleave(2, dim=1).to(torch.float8_e4m3fn)
    g = torch.tensor(2.0 ** m, dtype=torch.float32)
    packed = weight.view(torch.uint8).clone()
    src, dst = mxfp4_dequant(weight, scale, name=name), nvfp4_dequant(packed, ws, g, name=name)
    if not torch.equal(src.view(torch.int32), dst.view(torch.int32)):
        raise ValueError(f"MXFP4 -> NVFP4 transcode{_where(name)} is not bit-exact")  # a bug, never data
    return packed, ws, g
