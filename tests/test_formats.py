"""Checkpoint number formats (engine/model/formats.py) against hand-written references."""

import math

import pytest
import torch

from engine.model import formats as F

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _e8m0(byte):
    # Straight from the format definition, independent of formats.py.
    return math.ldexp(1.0, int(byte) - 127)


def _ref_fp8_dequant(w, scale, block):
    out_f, in_f = w.shape
    wf = w.float().tolist()
    sb = scale.view(torch.uint8).tolist()
    res = torch.empty(out_f, in_f)
    for i in range(out_f):
        for j in range(in_f):
            res[i, j] = wf[i][j] * _e8m0(sb[i // block][j // block])
    return res


def _ref_mxfp4_dequant(packed, scale, block):
    out_f, half = packed.shape
    pb = packed.view(torch.uint8).tolist()
    sb = scale.view(torch.uint8).tolist()
    res = torch.empty(out_f, 2 * half)
    for r in range(out_f):
        for c in range(2 * half):
            byte = pb[r][c // 2]
            code = byte & 0xF if c % 2 == 0 else byte >> 4
            res[r, c] = E2M1[code] * _e8m0(sb[r][c // block])
    return res


def _rand_e8m0(shape, gen, lo=118, hi=128):
    return torch.randint(lo, hi, shape, generator=gen, dtype=torch.uint8).view(torch.float8_e8m0fnu)


# ----------------------------------------------------------------------------- E8M0


def test_e8m0_values():
    b = torch.tensor([127, 118, 128, 0, 254], dtype=torch.uint8)
    got = F.e8m0_to_float(b)
    assert got.dtype == torch.float32
    assert got.tolist() == [1.0, 2.0**-9, 2.0, 2.0**-127, 2.0**127]
    # the float8_e8m0fnu view decodes the same bytes
    assert torch.equal(F.e8m0_to_float(b.view(torch.float8_e8m0fnu)), got)


def test_e8m0_nan_raises():
    with pytest.raises(ValueError, match="0xFF"):
        F.e8m0_to_float(torch.tensor([127, 0xFF], dtype=torch.uint8))
    with pytest.raises(ValueError, match="my.scale"):
        F.e8m0_to_float(torch.tensor([0xFF], dtype=torch.uint8), name="my.scale")


def test_e8m0_wrong_dtype_raises():
    with pytest.raises(ValueError, match="uint8"):
        F.e8m0_to_float(torch.ones(2))


# ----------------------------------------------------------------------------- FP8


@pytest.mark.parametrize("shape,block", [((8, 12), 4), ((10, 7), 4), ((5, 9), 8)])
def test_fp8_dequant_matches_reference(shape, block):
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(shape, generator=g) * 50).to(torch.float8_e4m3fn)
    sshape = (-(-shape[0] // block), -(-shape[1] // block))
    s = _rand_e8m0(sshape, g)
    got = F.fp8_block_dequant(w, s, block=block)
    assert got.dtype == torch.float32 and got.shape == shape
    assert torch.equal(got, _ref_fp8_dequant(w, s, block))


def test_fp8_quant_roundtrip_exact_on_grid():
    # Values that are e4m3 numbers times a per-block power of two survive exactly.
    g = torch.Generator().manual_seed(2)
    out_f, in_f, block = 200, 300, 128  # ragged in both dims
    q = (torch.randn(out_f, in_f, generator=g) * 100).to(torch.float8_e4m3fn).float()
    q[0, 0] = 448.0  # make the amax of block (0,0) hit the top of the range
    exps = torch.randint(-9, 3, (2, 3), generator=g)
    scale = torch.exp2(exps.float()).repeat_interleave(block, 0).repeat_interleave(block, 1)
    w = q * scale[:out_f, :in_f]
    wq, s = F.fp8_block_quant(w, block=block)
    assert wq.dtype == torch.float8_e4m3fn and wq.shape == (out_f, in_f)
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (2, 3)
    assert s.view(torch.uint8)[0, 0].item() == exps[0, 0].item() + 127
    assert torch.equal(F.fp8_block_dequant(wq, s, block=block), w)


def test_fp8_quant_scale_rule_and_error():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(130, 260, generator=g) * 0.05
    wq, s = F.fp8_block_quant(w)
    # reference scale rule 2^ceil(log2(amax/448)) per 128x128 block (ragged edges included)
    for bi in range(2):
        for bj in range(3):
            amax = w[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128].abs().max().item()
            assert s.view(torch.uint8)[bi, bj].item() == math.ceil(math.log2(amax / 448)) + 127
    back = F.fp8_block_dequant(wq, s)
    # e4m3 has 3 mantissa bits: relative error <= 2^-4 for normals, half a subnormal
    # step (2^-10 times the block scale) below 2^-6
    sfull = F.e8m0_to_float(s).repeat_interleave(128, 0).repeat_interleave(128, 1)[:130, :260]
    assert ((back - w).abs() <= torch.maximum(w.abs() * 2**-4, sfull * 2**-10)).all()


def test_fp8_quant_zero_block():
    w = torch.zeros(128, 256)
    w[:, 128:] = 1.0
    wq, s = F.fp8_block_quant(w)
    assert (s.view(torch.uint8) != 0xFF).all()
    assert torch.equal(F.fp8_block_dequant(wq, s), w)


def test_fp8_dequant_shape_error_names_tensor():
    w = torch.zeros(256, 256).to(torch.float8_e4m3fn)
    s = torch.full((2, 3), 127, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.wq_a.*\(2, 2\).*\(2, 3\)"):
        F.fp8_block_dequant(w, s, name="layers.0.attn.wq_a")


def test_fp8_dequant_wrong_dtype_raises():
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        F.fp8_block_dequant(torch.zeros(4, 4), torch.full((1, 1), 127, dtype=torch.uint8), name="w")


# ----------------------------------------------------------------------------- FP4 codes


def test_nibble_order():
    packed = torch.tensor([[0x21]], dtype=torch.uint8)
    assert F.unpack_fp4(packed).tolist() == [[1, 2]]
    assert F.unpack_fp4(packed.view(torch.int8)).tolist() == [[1, 2]]
    assert F.pack_fp4(torch.tensor([[1, 2]])).view(torch.uint8).tolist() == [[0x21]]
    # high-bit byte survives int8 storage
    assert F.unpack_fp4(torch.tensor([[0xF8]], dtype=torch.uint8).view(torch.int8)).tolist() == [[8, 15]]


def test_pack_unpack_roundtrip():
    g = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 16, (7, 20), generator=g, dtype=torch.uint8)
    packed = F.pack_fp4(codes)
    assert packed.dtype == torch.int8 and packed.shape == (7, 10)
    assert torch.equal(F.unpack_fp4(packed), codes)


def test_fp4_table_and_rounding():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = F.fp4_to_float(codes)
    assert vals.tolist() == E2M1
    assert torch.signbit(vals[8])  # code 8 is -0
    # exact grid values map back to their codes (+0 / -0 distinguished by sign)
    assert torch.equal(F.float_to_fp4_codes(vals), codes)
    # ties go to the even code; beyond +-6 clamps
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, 5.01, 7.0, -100.0, -2.5, -0.1])
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 6.0, 6.0, -6.0, -2.0, -0.0]
    assert F.fp4_to_float(F.float_to_fp4_codes(x)).tolist() == want


def test_fp4_nearest():
    g = torch.Generator().manual_seed(5)
    x = torch.rand(2000, generator=g) * 14 - 7
    got = F.fp4_to_float(F.float_to_fp4_codes(x))
    grid = torch.tensor(E2M1)
    dist = (x.clamp(-6, 6)[:, None] - grid[None, :]).abs().min(dim=1).values
    assert torch.allclose((got - x.clamp(-6, 6)).abs(), dist)


def test_fp4_errors():
    with pytest.raises(ValueError, match="even"):
        F.pack_fp4(torch.zeros(2, 3, dtype=torch.uint8), name="x")
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        F.pack_fp4(torch.full((1, 2), 16))
    with pytest.raises(ValueError, match="NaN"):
        F.float_to_fp4_codes(torch.tensor([float("nan")]))


# ----------------------------------------------------------------------------- MXFP4


@pytest.mark.parametrize("shape", [(3, 64), (5, 96)])
def test_mxfp4_dequant_matches_reference(shape):
    g = torch.Generator().manual_seed(6)
    out_f, in_f = shape
    packed = torch.randint(-128, 128, (out_f, in_f // 2), generator=g, dtype=torch.int8)
    s = _rand_e8m0((out_f, in_f // 32), g)
    got = F.mxfp4_dequant(packed, s)
    assert got.dtype == torch.float32 and got.shape == shape
    assert torch.equal(got, _ref_mxfp4_dequant(packed, s, 32))


def test_mxfp4_quant_roundtrip_exact_on_grid():
    g = torch.Generator().manual_seed(7)
    out_f, in_f = 6, 128
    vals = torch.tensor(E2M1)[torch.randint(0, 16, (out_f, in_f), generator=g)]
    vals[:, ::32] = 6.0  # each block hits the top so the chosen scale is exactly the one used
    exps = torch.randint(-10, 1, (out_f, in_f // 32), generator=g)
    w = vals * torch.exp2(exps.float()).repeat_interleave(32, 1)
    packed, s = F.mxfp4_quant(w)
    assert packed.dtype == torch.int8 and packed.shape == (out_f, in_f // 2)
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (out_f, in_f // 32)
    assert torch.equal(s.view(torch.uint8).long(), exps + 127)
    assert torch.equal(F.mxfp4_dequant(packed, s), w)


def test_mxfp4_quant_scale_rule():
    g = torch.Generator().manual_seed(8)
    w = torch.randn(4, 64, generator=g) * 0.1
    w[1, :32] = 0.0  # all-zero block must still get a valid scale
    packed, s = F.mxfp4_quant(w)
    sb = s.view(torch.uint8)
    assert sb[1, 0].item() != 0xFF
    amax = w[0, :32].abs().max().item()
    assert sb[0, 0].item() == math.ceil(math.log2(amax / 6)) + 127
    back = F.mxfp4_dequant(packed, s)
    assert torch.equal(back[1, :32], torch.zeros(32))
    # widest e2m1 gap is 4 -> 6, so the error is at most 1 unit of the block scale
    assert ((back - w).abs() <= F.e8m0_to_float(s).repeat_interleave(32, 1)).all()


def test_mxfp4_shape_error_names_tensor():
    packed = torch.zeros(4, 32, dtype=torch.int8)  # in = 64 -> scale (4, 2)
    s = torch.full((4, 1), 127, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"ffn\.experts\.3\.w1.*\(4, 2\).*\(4, 1\)"):
        F.mxfp4_dequant(packed, s, name="ffn.experts.3.w1")
    with pytest.raises(ValueError, match="multiple"):
        F.mxfp4_quant(torch.zeros(2, 48), name="w")
