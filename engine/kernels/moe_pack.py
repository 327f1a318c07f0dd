"""The routed experts' packed layout for fused_moe.py's kernels: packing at load time, and the
exact dequantisation the kernels' arithmetic amounts to (the tests' and the reference's weights).

Packed layout (pack_experts): [128 rows, 128 k] tiles of 2048 int32 words, contiguous in K-loop order:
w13 [E, I/64, D/128, 2048] (tile rows 0-63: w1 rows 64j.., rows 64-127: the same w3 rows) and
w2 [E, D/128, I/128, 2048]. Word ((half*2 + g)*128 + t)*4 + wr (t = 32 warp + 4 lrow + lk) holds the
8 nibbles of rows 64 half + 16 warp + 8 r1 + lrow, k = 64 g + 16 wr + 8 r2 + 2 lk + h (r1, r2, h in
{0,1}): thread t's wgmma A-fragment registers, so its 4 words are one 16-byte load and nothing is
shuffled. The nibble bits sit (_SIGN_POS/_MAG_POS) where 11 logic ops make four bf16x2 registers of
e2m1 * 2^-126 (sign -> bit 15, e1 e0 m -> bits 8..6). Scales: one byte per block, [128, 128/SB] per
tile in thread order [warp, lrow, half, blk, r1]. NVFP4 e4m3 is recoded "e5m3": (b << 4) + 0x7580
is the bf16 of scale * 2^118 (exact, subnormals too; a zero scale zeroes its nibbles). MXFP4 e8m0
is shifted per expert so b << 7 is the bf16 of 2^(e8m0 - 127 + 254 - max). The leftovers
(weight_scale_2 * 2^8, or 2^(max-128)) are alpha [E, 3] (gate, up, down) on the fp32 accumulators.
e2m1 * scale is exact in bf16: only the activations round before the fp32 accumulation. (MXFP4
stays exact while an expert's block scales span < 2^126.)
"""
import functools
from dataclasses import dataclass

import torch

from engine.numerics import E2M1_VALUES

# Per word nibble slot j = 2*q + h (q = r1 + 2*r2): bit of its sign and lowest bit of its e1e0m
# (fused_moe.py's _SIGN / _MAG masks pick them out in the kernel).
_SIGN_POS = (15, 31, 14, 30, 13, 29, 9, 25)
_MAG_POS = (6, 22, 3, 19, 26, 10, 0, 16)


@functools.lru_cache(maxsize=None)
def _tile_tables(nb: int):
    """(word slot -> flat n*128+k [2048, 8], scale byte -> flat n*nb+blk [128*nb]) for one tile."""
    half, g, t, wr, q, h = torch.meshgrid(*[torch.arange(s) for s in (2, 2, 128, 4, 4, 2)], indexing="ij")
    warp, lrow, lk = t // 32, (t // 4) % 8, t % 4
    n = 64 * half + 16 * warp + 8 * (q % 2) + lrow
    k = 64 * g + 16 * wr + 8 * (q // 2) + 2 * lk + h
    words = (n * 128 + k).reshape(2048, 8)
    warp, lrow, half, blk, r1 = torch.meshgrid(*[torch.arange(s) for s in (4, 8, 2, nb, 2)], indexing="ij")
    scales = ((64 * half + 16 * warp + 8 * r1 + lrow) * nb + blk).reshape(-1)
    return words, scales


def _tiles(m: torch.Tensor, cols: int) -> torch.Tensor:
    """[E, R, C] -> [E, R/128, C/cols, 128*cols]: 128-row x cols-column tiles, each row-major."""
    E, R, C = m.shape
    return m.reshape(E, R // 128, 128, C // cols, cols).permute(0, 1, 3, 2, 4).reshape(E, R // 128, C // cols, -1)


def _untiles(t: torch.Tensor, cols: int) -> torch.Tensor:
    E, RT, CT = t.shape[:3]
    return t.reshape(E, RT, CT, 128, cols).permute(0, 1, 3, 2, 4).reshape(E, RT * 128, CT * cols)


def _bits(device):
    src, _ = _tile_tables(1)
    return (src.to(device), torch.tensor(_SIGN_POS, device=device), torch.tensor(_MAG_POS, device=device))


def _pack_words(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes [E, R, C] -> int32 words [E, R/128, C/128, 2048]."""
    src, sign, mag = _bits(codes.device)
    c = _tiles(codes, 128)[..., src].to(torch.int64)                          # [.., 2048, 8]
    w = (((c & 7) << mag) | ((c >> 3) << sign)).sum(-1)                        # disjoint bits
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)


def _unpack_words(words: torch.Tensor) -> torch.Tensor:
    """Inverse of _pack_words -> codes uint8 [E, R, C]."""
    src, sign, mag = _bits(words.device)
    w = words.to(torch.int64)[..., None] & 0xFFFFFFFF
    c = ((w >> mag) & 7) | (((w >> sign) & 1) << 3)                           # [E, RT, CT, 2048, 8]
    tiles = torch.empty(*words.shape[:3], 128 * 128, dtype=torch.uint8, device=words.device)
    tiles[..., src.reshape(-1)] = c.reshape(*words.shape[:3], -1).to(torch.uint8)
    return _untiles(tiles, 128)


def _codes(packed: torch.Tensor) -> torch.Tensor:
    b = packed.view(torch.uint8)
    return torch.stack((b & 0xF, b >> 4), -1).reshape(*b.shape[:-1], -1)


def _recode_scales(proj, fmt: str):
    """One projection's checkpoint tensors -> (codes [E,R,C], scale bytes [E,R,C/SB], alpha [E])."""
    if fmt == "nvfp4":
        w, s, s2 = proj
        s = s.float()
        if not bool(torch.isfinite(s).all()) or bool((s < 0).any()):
            raise ValueError("NVFP4 weight_scale must be finite and >= 0")
        mant, ex = torch.frexp(s)
        byte = torch.where(s > 0, (ex + 9) * 8 + ((mant * 2 - 1) * 8).round().to(torch.int32), 0)
        codes = _codes(w) * (s > 0).repeat_interleave(16, -1)                   # zero scale -> zero block
        alpha = s2.float().reshape(-1).expand(w.shape[0]) * 256.0
        return codes, byte.to(torch.uint8), alpha
    w, s = proj
    b = s.view(torch.uint8).to(torch.int32)
    if bool((b == 255).any()):
        raise ValueError("MXFP4 e8m0 scale contains 0xFF (NaN)")
    bmax = b.flatten(1).amax(1)                                                # [E]
    byte = (b + (254 - bmax)[:, None, None]).clamp(0, 254)
    return _codes(w), byte.to(torch.uint8), torch.exp2((bmax - 128).double()).float()


@dataclass
class PackedExperts:
    """Kernel layout of E experts (see the module docstring). D hidden, I intermediate (per rank)."""
    fmt: str                # "mxfp4" | "nvfp4"
    E: int; D: int; I: int  # noqa: E702
    w13: torch.Tensor      # int32 [E, I/64, D/128, 2048]
    s13: torch.Tensor      # uint8 [E, I/64, D/128, 128*128/SB]
    w2: torch.Tensor       # int32 [E, D/128, I/128, 2048]
    s2: torch.Tensor       # uint8 [E, D/128, I/128, 128*128/SB]
    alpha: torch.Tensor    # fp32 [E, 3]: gate, up, down accumulator multipliers

    @property
    def block(self) -> int:
        return 16 if self.fmt == "nvfp4" else 32


_FIELDS = ("w13", "s13", "w2", "s2", "alpha")


def pack_experts(w1, w3, w2, fmt: str, chunk: int = 16) -> PackedExperts:
    """Checkpoint experts -> PackedExperts. Each projection is a tuple of stacked [E, ...] tensors:
    mxfp4: (weight uint8/int8 [E,out,in/2], scale e8m0 [E,out,in/32]);
    nvfp4: (weight [E,out,in/2], weight_scale e4m3 [E,out,in/16], weight_scale_2 fp32 [E]).
    Low nibble = even input column. w1, w3: [E, I, D/2]; w2: [E, D, I/2]. Works on any device,
    `chunk` experts at a time (the int64 staging is 16x the packed size)."""
    if fmt not in ("mxfp4", "nvfp4"):
        raise ValueError(f"fmt must be 'mxfp4' or 'nvfp4', got {fmt!r}")
    E = w1[0].shape[0]
    if E > chunk:
        parts = [pack_experts(*[tuple(t[i:i + chunk] for t in p) for p in (w1, w3, w2)], fmt, chunk)
                 for i in range(0, E, chunk)]
        cat = (torch.cat([getattr(q, f) for q in parts]) for f in _FIELDS)
        return PackedExperts(fmt, E, parts[0].D, parts[0].I, *cat)
    (c1, b1, a1), (c3, b3, a3), (c2, b2, a2) = (_recode_scales(p, fmt) for p in (w1, w3, w2))
    E, I, D = c1.shape
    if D % 128 or I % 128 or c2.shape != (E, D, I) or c3.shape != c1.shape:
        raise ValueError(f"need w1/w3 [E,I,D], w2 [E,D,I] with D, I multiples of 128; got "
                         f"{tuple(c1.shape)}, {tuple(c3.shape)}, {tuple(c2.shape)}")
    nb = 128 // (16 if fmt == "nvfp4" else 32)
    _, ssrc = _tile_tables(nb)

    def inter(a, b):          # gate/up rows alternate in groups of 64: one tile = 64 gate + 64 up rows
        return torch.stack((a.reshape(E, I // 64, 64, -1), b.reshape(E, I // 64, 64, -1)), 2).reshape(E, 2 * I, -1)

    def scales(s):
        return _tiles(s, nb)[..., ssrc.to(s.device)].contiguous()

    return PackedExperts(fmt, E, D, I, _pack_words(inter(c1, c3)), scales(inter(b1, b3)),
                         _pack_words(c2), scales(b2), torch.stack((a1, a3, a2), 1).float().contiguous())


def _scale_values(b: torch.Tensor, fmt: str) -> torch.Tensor:
    """Stored scale bytes -> the fp64 value of the bf16 scale the kernel builds from them."""
    b = b.to(torch.float64)
    if fmt == "mxfp4":
        return torch.exp2(b - 127)
    return torch.exp2(torch.floor(b / 8) + 108) * (1 + (b % 8) / 8)


def dequant_experts(p: PackedExperts, chunk: int = 16):
    """PackedExperts -> (w1 [E,I,D], w3 [E,I,D], w2 [E,D,I]) fp32, by the kernel's arithmetic."""
    if p.E > chunk:
        cut = lambda i: PackedExperts(p.fmt, min(chunk, p.E - i), p.D, p.I,  # noqa: E731
                                      *(getattr(p, f)[i:i + chunk] for f in _FIELDS))
        return tuple(torch.cat(t) for t in zip(*(dequant_experts(cut(i), chunk) for i in range(0, p.E, chunk))))
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=p.w13.device) * 2.0**-126
    nb = 128 // p.block
    _, ssrc = _tile_tables(nb)

    def one(words, sc, alpha):
        s = torch.empty_like(sc)
        s[..., ssrc.to(sc.device)] = sc
        s = _scale_values(_untiles(s, nb), p.fmt).repeat_interleave(p.block, -1)
        return lut[_unpack_words(words).long()] * s * alpha.double()[:, None, None]

    E, I, D = p.E, p.I, p.D
    g13 = one(p.w13, p.s13, torch.ones(E, device=p.w13.device)).reshape(E, I // 64, 2, 64, D)
    w1, w3 = (g13[:, :, i].reshape(E, I, D) * p.alpha[:, i, None, None].double() for i in (0, 1))
    return w1.float(), w3.float(), one(p.w2, p.s2, p.alpha[:, 2]).float()
