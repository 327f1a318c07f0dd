"""The number formats' arithmetic, as a leaf (imports only torch): who rounds how.

Shared by the model (its `reference` numerics and checkpoint formats) and by the kernels' torch
references, so neither has to import the other:
- `up`/`up_dtype`: the compute dtype of the fp32 islands (fp64 when the whole model runs in fp64,
  for the exactness tests: FP8/FP4 roundings are discontinuous, so two fp32 computations one ulp
  apart can round apart; in fp64 they practically never do).
- DeepSeek's quantisation-aware round trips (quantise then dequantise in place), all with
  power-of-two (UE8M0) scales: `fp8_sim_ref` (e4m3 per block), `fp4_sim_ref` (e2m1 per block),
  `hadamard` (the indexer's rotation before FP4).
- E8M0/E2M1 helpers and FP8 block dequantisation (engine.model.formats builds the checkpoint
  formats on these).
"""
from dataclasses import dataclass

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_MAX = 6.0  # largest e2m1 magnitude

# e2m1 code -> value; bit 3 is the sign, so codes 8..15 mirror 0..7.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


# ----------------------------------------------------------------------------- compute dtype

def up(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float64 else x.float()


def up_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------- round trips (reference numerics)

def _pow2_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """2^ceil(log2(amax/qmax)), exactly: from frexp, as DeepSeek's kernels take it from the
    float's bits (log2 rounds to the power of two within an ulp above one)."""
    mant, e = torch.frexp(amax / qmax)
    return torch.exp2(torch.where(mant == 0.5, e - 1, e).to(amax.dtype))


def _to_e4m3(y: torch.Tensor) -> torch.Tensor:
    """Round to e4m3 (nearest, ties to even). torch casts fp64 through fp32, which rounds
    twice; rounding to odd in fp32 first makes the second rounding the correct one."""
    if y.dtype == torch.float64:
        f = y.float()
        inexact = f.double() != y
        f = torch.where(inexact & (f.double().abs() > y.abs()), torch.nextafter(f, torch.zeros_like(f)), f)
        y = torch.where(inexact, (f.view(torch.int32) | 1).view(torch.float32), f)
    return y.to(torch.float8_e4m3fn)


def _e4m3_blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (e4m3 codes [..., D/block, block], scales [..., D/block, 1] in x's wide dtype),
    scale 2^ceil(log2(amax / 448)) per block of the last dim."""
    xb = up(x).unflatten(-1, (-1, block))
    s = _pow2_scale(xb.abs().amax(-1, keepdim=True).clamp(min=1e-4), FP8_MAX)
    return _to_e4m3((xb / s).clamp(-FP8_MAX, FP8_MAX)), s


def fp8_sim_ref(x: torch.Tensor, block: int) -> torch.Tensor:
    """e4m3 round trip per `block` channels of the last dim (torch; the act_sim kernel's reference)."""
    q, s = _e4m3_blocks(x, block)
    return (up(q).to(s.dtype) * s).flatten(-2).to(x.dtype)


def fp8_codes_ref(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_sim_ref's rounding as the FP8 tensor cores take it: x [..., D] -> (e4m3 codes [..., D],
    fp32 power-of-two scales [..., D/block]), codes * scales == fp8_sim_ref(x, block) exactly."""
    q, s = _e4m3_blocks(x, block)
    return q.flatten(-2), s.squeeze(-1).float()


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e2m1 value (0, .5, 1, 1.5, 2, 3, 4, 6), ties to the even code."""
    a = x.abs()
    y = torch.where(a <= 0.25, 0.0,
        torch.where(a < 0.75, 0.5,
        torch.where(a <= 1.25, 1.0,
        torch.where(a < 1.75, 1.5,
        torch.where(a <= 2.5, 2.0,
        torch.where(a < 3.5, 3.0,
        torch.where(a <= 5.0, 4.0, 6.0)))))))
    return torch.copysign(y, x)


def fp4_sim_ref(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """e2m1 round trip per `block` channels of the last dim (torch; the act_sim kernel's reference)."""
    xb = up(x).unflatten(-1, (-1, block))
    s = _pow2_scale(xb.abs().amax(-1, keepdim=True).clamp(min=FP4_MAX * 2.0 ** -126), FP4_MAX)
    q = round_e2m1((xb / s).clamp(-FP4_MAX, FP4_MAX))
    return (q * s).flatten(-2).to(x.dtype)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Walsh-Hadamard transform (Sylvester order) over the last dim, scaled by n^-1/2."""
    n = x.shape[-1]
    assert n & (n - 1) == 0, "Hadamard size must be a power of two"
    shape, y, h = x.shape, up(x), 1
    while h < n:
        y = y.reshape(*shape[:-1], n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2)
        h *= 2
    return (y.reshape(shape) * n ** -0.5).to(x.dtype)


# ----------------------------------------------------------------------------- E8M0 and FP8 block scales

def _where(name):
    return f" for {name!r}" if name else ""


def _check_2d(t, what, name):
    if t.dim() != 2:
        raise ValueError(f"{what}{_where(name)} must be 2-D, got shape {tuple(t.shape)}")


def _ceil_div(a, b):
    return -(-a // b)


def _e8m0_bytes(t, name=None):
    """View an E8M0 tensor (uint8 or float8_e8m0fnu) as its raw uint8 bytes."""
    if t.dtype == torch.float8_e8m0fnu:
        return t.view(torch.uint8)
    if t.dtype == torch.uint8:
        return t
    raise ValueError(f"E8M0 scale{_where(name)} must be uint8 or float8_e8m0fnu, got {t.dtype}")


def e8m0_to_float(t, name=None):
    """E8M0 bytes (uint8 or float8_e8m0fnu) -> fp32 ``2^(byte-127)``; raises on 0xFF (NaN)."""
    b = _e8m0_bytes(t, name)
    if bool((b == 0xFF).any()):
        raise ValueError(f"E8M0 scale{_where(name)} contains 0xFF (NaN)")
    # exp2 of an integer-valued fp32 is exact; byte 0 gives the fp32 subnormal 2^-127.
    return torch.exp2(b.to(torch.float32) - 127.0)


def exponent_to_e8m0(exp, name=None):
    """Integer exponents e in [-127, 127] -> float8_e8m0fnu tensor holding ``2^e``."""
    exp = exp.to(torch.int32)
    if bool(((exp < -127) | (exp > 127)).any()):
        raise ValueError(f"E8M0 exponent{_where(name)} out of range [-127, 127]")
    return (exp + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def pow2_scale_exponent(amax, qmax):
    """Smallest e with ``amax / 2^e <= qmax``, i.e. ``ceil(log2(amax/qmax))``, clamped to E8M0.

    Uses frexp rather than log2 so exact powers of two never round the wrong way.
    amax is floored at the smallest normal fp32 so all-zero blocks get a valid scale.
    """
    ratio = amax.float().clamp_min(torch.finfo(torch.float32).tiny) / qmax
    mant, e = torch.frexp(ratio)  # ratio = mant * 2^e, mant in [0.5, 1)
    exp = torch.where(mant == 0.5, e - 1, e)
    # The low clamp only ever makes a scale larger than needed (never overflows).
    return exp.clamp(-127, 127)


def fp8_block_dequant(w, scale, block=128, name=None):
    """float8_e4m3fn ``w [out, in]`` with E8M0 ``scale [ceil(out/b), ceil(in/b)]`` -> fp32 ``[out, in]``.

    ``W[i, j] = w[i, j] * scale[i // b, j // b]``; the last row/column block may be ragged.
    """
    _check_2d(w, "FP8 weight", name)
    _check_2d(scale, "FP8 scale", name)
    if w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"FP8 weight{_where(name)} must be float8_e4m3fn, got {w.dtype}")
    out_f, in_f = w.shape
    want = (_ceil_div(out_f, block), _ceil_div(in_f, block))
    if tuple(scale.shape) != want:
        raise ValueError(f"FP8 scale shape mismatch{_where(name)}: weight {tuple(w.shape)} with "
                         f"block {block} needs scale {want}, got {tuple(scale.shape)}")
    s = e8m0_to_float(scale, name)
    s = s.repeat_interleave(block, 0).repeat_interleave(block, 1)[:out_f, :in_f]
    return w.to(torch.float32) * s


# ----------------------------------------------------------------------------- which roundings a model applies

@dataclass(frozen=True)
class Numerics:
    """What DeepSeek's quantisation-aware inference rounds, in one place (the model's modules and
    its step read this, nothing else):
    kv_fp8: the KV's non-rope channels, window and compressed entries alike (e4m3 per 64);
    indexer_fp4: the indexer's queries and keys, Hadamard-rotated then e2m1 per 32;
    act_fp8: the input of every GEMM DeepSeek runs in FP8/FP4 (the FP8 linears but wo_a, which its
    converter dequantises to bf16; the routed experts, MXFP4 and NVFP4 alike), e4m3 per 128."""
    name: str = "plain"
    kv_fp8: bool = False
    indexer_fp4: bool = False
    act_fp8: bool = False

    MODES = ("plain", "reference")

    @classmethod
    def of(cls, mode: str) -> "Numerics":
        """`plain`: no rounding (equals transformers' DeepseekV4); `reference`: all of DeepSeek's."""
        if mode not in cls.MODES:
            raise ValueError(f"numerics must be one of {cls.MODES}, got {mode!r}")
        on = mode == "reference"
        return cls(mode, kv_fp8=on, indexer_fp4=on, act_fp8=on)


PLAIN = Numerics()
