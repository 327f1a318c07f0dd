"""Attention's post-GEMM glue for q and kv, one kernel: RMSNorm, RoPE, FP8 simulation, ring write.

The tail of engine.model.attention.Attention.qkv, then (decode) the ring write:
  q  [T,H,Dh]: per-head unweighted RMSNorm, then RoPE on the last R dims;
  kv [T,Dh]:   RMSNorm with kv_norm's weight, RoPE, optionally the e4m3 round trip of the
               non-rope dims (per-64 power-of-two scales, engine.numerics.fp8_sim_ref),
               then ring[slot, pos % W] = kv.
RoPE pairs (2i, 2i+1) are interleaved (GPT-J). Every intermediate is rounded to the tensor's
dtype where the torch code rounds it, so bf16 results match bit for bit up to fp32 ulps.
Grid (T, head blocks + 1): the last program of each token does its kv.
"""
import torch
import triton
import triton.language as tl

from engine.numerics import fp8_sim_ref as fp8_sim
from .act_sim import fp8_round_trip
from .common import gdc_enter, hold, pdl_args, apply_rope, cos_sin, round_to
from .rms_norm import rms_norm_ref as rms_norm


@triton.jit
def _rope(y, cos, sin, M: tl.constexpr, DH: tl.constexpr, R: tl.constexpr):
    """y [M,DH] fp32; cos/sin [DH/2] (pair i of the rope slice at i + (DH-R)/2) -> rotated y."""
    a, b = tl.split(tl.reshape(y, (M, DH // 2, 2)))
    is_rope = tl.arange(0, DH // 2)[None, :] >= (DH - R) // 2
    a2 = tl.where(is_rope, a * cos[None, :] - b * sin[None, :], a)
    b2 = tl.where(is_rope, b * cos[None, :] + a * sin[None, :], b)
    return tl.reshape(tl.join(a2, b2), (M, DH))


@triton.jit
def _rope_qkv_kernel(args, K: tl.constexpr, USE_GDC: tl.constexpr = False):
    gdc_enter(USE_GDC)
    rope_qkv_program(tl.program_id(0), tl.program_id(1), args, K)


@triton.jit
def rope_qkv_program(t, hb, args, K: tl.constexpr):
    """Program (token t, head block hb) of the grid (T, head blocks + 1): args and K as
    rope_qkv_launch makes them (kv_prep.py runs these programs in its launch too)."""
    (q_ptr, kv_ptr, w_ptr, cos_ptr, sin_ptr, pos_ptr, inv_ptr, qo_ptr, kvo_ptr, ring_ptr, slot_ptr, H, W,
     stride_qt, stride_qh, stride_kvt, stride_cs, stride_rs, stride_rw, eps) = args
    DH: tl.constexpr = K[0]
    R: tl.constexpr = K[1]
    BLOCK_H: tl.constexpr = K[2]
    TABLE: tl.constexpr = K[3]
    FP8: tl.constexpr = K[4]
    FB: tl.constexpr = K[5]
    RING: tl.constexpr = K[6]
    p = tl.arange(0, DH // 2) - (DH - R) // 2                # rope pair index (< 0: not rope)
    pm = p >= 0
    if TABLE:
        cos = tl.load(cos_ptr + t * stride_cs + p, mask=pm, other=1.0)
        sin = tl.load(sin_ptr + t * stride_cs + p, mask=pm, other=0.0)
    else:
        ang = tl.load(pos_ptr + t).to(tl.float32) * tl.load(inv_ptr + p, mask=pm, other=0.0)
        cos = tl.cos(ang)
        sin = tl.sin(ang)
    if hb * BLOCK_H < H:
        _q_heads(q_ptr, qo_ptr, t, hb, H, stride_qt, stride_qh, cos, sin, eps, DH, R, BLOCK_H)
    else:
        _kv_row(kv_ptr, w_ptr, kvo_ptr, ring_ptr, slot_ptr, pos_ptr, t, W, stride_kvt, stride_rs, stride_rw,
                cos, sin, eps, DH, R, FP8, FB, RING)


# The two branches live in their own functions: variables of one name but different shapes in
# the two arms of a runtime `if` do not compile (the interpreter would not notice).
@triton.jit
def _q_heads(q_ptr, qo_ptr, t, hb, H, stride_qt, stride_qh, cos, sin, eps,
             DH: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr):
    d = tl.arange(0, DH)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = (h < H)[:, None]
    x = tl.load(q_ptr + t * stride_qt + h[:, None] * stride_qh + d[None, :], mask=hm, other=0.0)
    x = x.to(tl.float32)                                                                # [BH,DH]
    y = x * tl.math.rsqrt(tl.sum(x * x, axis=1, keep_dims=True) / DH + eps)
    y = _rope(round_to(y, qo_ptr.dtype.element_ty), cos, sin, BLOCK_H, DH, R)
    o = qo_ptr + (t * H + h[:, None]) * DH + d[None, :]
    tl.store(o, round_to(y, qo_ptr.dtype.element_ty), mask=hm)


@triton.jit
def _kv_row(kv_ptr, w_ptr, kvo_ptr, ring_ptr, slot_ptr, pos_ptr, t, W, stride_kvt, stride_rs, stride_rw,
            cos, sin, eps, DH: tl.constexpr, R: tl.constexpr, FP8: tl.constexpr, FB: tl.constexpr,
            RING: tl.constexpr):
    d = tl.arange(0, DH)
    x = tl.load(kv_ptr + t * stride_kvt + d).to(tl.float32)                             # [DH]
    r = tl.math.rsqrt(tl.sum(x * x, axis=0) / DH + eps)
    y = round_to(tl.load(w_ptr + d).to(tl.float32) * (x * r), kvo_ptr.dtype.element_ty)
    y = tl.reshape(_rope(tl.reshape(y, (1, DH)), cos, sin, 1, DH, R), (DH,))
    y = round_to(y, kvo_ptr.dtype.element_ty)
    if FP8:
        y = tl.where(d < DH - R, round_to(fp8_round_trip(y, DH, FB), kvo_ptr.dtype.element_ty), y)
    tl.store(kvo_ptr + t * DH + d, y)
    if RING:
        slot = tl.load(slot_ptr + t)
        row = ring_ptr + slot * stride_rs + (tl.load(pos_ptr + t) % W) * stride_rw
        tl.store(row + d, round_to(y, ring_ptr.dtype.element_ty), mask=(d < DH) & (slot >= 0))


def rope_qkv(q, kv, kv_weight, eps, cos=None, sin=None, *, positions=None, inv_freq=None,
             ring=None, slots=None, fp8=False, fp8_block=64, block_h=2):
    """q [...,H,Dh], kv [...,Dh] (the wq_b / wkv GEMM outputs), kv_weight [Dh]
    -> (q, kv) normed and roped, kv's first Dh-R dims e4m3-rounded if fp8; new tensors.

    RoPE angles: cos/sin [...,R/2] fp32 (common.cos_sin), or positions [...] with
    inv_freq [R/2] (cos/sin computed in-kernel). ring [slots,W,Dh] with slots [...] (per
    token; < 0 skips): ring[slot, pos % W] = kv, positions required. Tokens must not share a
    ring row (decode: one token per slot). The write lands before attention reads the ring:
    right for decode (the row written is the one the window just dropped), not for a prefill
    chunk, whose earlier tokens still need the rows it overwrites."""
    H, DH = q.shape[-2:]
    lead = q.shape[:-2]
    q3, kv2 = q.reshape(-1, H, DH), kv.reshape(-1, DH)
    T = q3.shape[0]
    table = cos is not None
    R = 2 * (cos.shape[-1] if table else inv_freq.shape[-1])
    assert DH & (DH - 1) == 0 and 0 < R <= DH and R % 2 == 0 and kv2.shape[0] == T
    assert not fp8 or (DH - R) % fp8_block == 0 and DH % fp8_block == 0
    assert q3.stride(-1) == 1 and kv2.stride(-1) == 1
    qo = torch.empty(T, H, DH, dtype=q.dtype, device=q.device)
    kvo = torch.empty(T, DH, dtype=kv.dtype, device=q.device)
    if T:
        grid, args, K = rope_qkv_launch(q3, kv2, kv_weight, eps, cos, sin, positions, inv_freq, ring, slots, fp8,
                                        fp8_block, block_h, qo, kvo)
        if not hold(_rope_qkv_kernel, grid, args, K):
            _rope_qkv_kernel[grid](args, K=K, num_warps=4, **pdl_args())
    return qo.view(*lead, H, DH), kvo.view(*lead, DH)


def rope_qkv_launch(q3, kv2, kv_weight, eps, cos, sin, positions, inv_freq, ring, slots, fp8, fp8_block, block_h,
                    qo, kvo):
    """rope_qkv's launch on q3 [T,H,DH], kv2 [T,DH] into qo, kvo -> (grid, args, constexprs K) of
    rope_qkv_program (its kernel's, or kv_prep's share of a launch)."""
    T, H, DH = q3.shape
    table = cos is not None
    R = 2 * (cos.shape[-1] if table else inv_freq.shape[-1])
    cs = (cos.reshape(T, -1).float().contiguous(), sin.reshape(T, -1).float().contiguous()) if table else None
    pos = positions.reshape(T).contiguous() if positions is not None else None
    assert pos is not None or (table and ring is None), "positions needed for in-kernel rope / ring"
    dummy = kvo
    bh = min(block_h, triton.next_power_of_2(H))
    args = (q3, kv2, kv_weight.contiguous(), cs[0] if table else dummy, cs[1] if table else dummy,
            pos if pos is not None else dummy, inv_freq.float().contiguous() if not table else dummy,
            qo, kvo, ring if ring is not None else dummy, slots.reshape(T).contiguous() if ring is not None else dummy,
            H, ring.shape[1] if ring is not None else 1, q3.stride(0), q3.stride(1), kv2.stride(0),
            cs[0].stride(0) if table else 0, ring.stride(0) if ring is not None else 0,
            ring.stride(1) if ring is not None else 0, eps)
    return (T, triton.cdiv(H, bh) + 1), args, (DH, R, bh, table, fp8, fp8_block, ring is not None)


def rope_qkv_ref(q, kv, kv_weight, eps, cos=None, sin=None, *, positions=None, inv_freq=None,
                 ring=None, slots=None, fp8=False, fp8_block=64, block_h=None):
    """Torch reference: Attention.qkv's lines after its GEMMs, then the ring write."""
    if cos is None:
        cos, sin = cos_sin(positions, inv_freq)
    q = apply_rope(rms_norm(q, None, eps), cos[..., None, :], sin[..., None, :])
    kv = apply_rope(rms_norm(kv, kv_weight, eps), cos, sin)
    if fp8:
        nope = kv.shape[-1] - 2 * cos.shape[-1]
        kv = torch.cat((fp8_sim(kv[..., :nope], fp8_block), kv[..., nope:]), dim=-1)
    if ring is not None:
        ring_write(ring, slots.reshape(-1), positions.reshape(-1), kv.reshape(-1, kv.shape[-1]))
    return q, kv


def ring_write(ring, s, p, k):
    """ring[s, p % W] = k for rows with s >= 0, with no host sync (a decode graph captures it): the
    skipping rows write what a writing row writes at the same place (or, when no row writes, put
    back what is there), so every index is valid and duplicate writes agree."""
    W = ring.shape[1]
    m = s >= 0
    d = m.int().argmax().view(1)                # a writing row (row 0 when none writes); a tensor index:
    s_d, p_d = s.index_select(0, d).clamp(min=0), p.index_select(0, d)    # indexing by it stays on device
    rows, cols = torch.where(m, s, s_d), torch.where(m, p, p_d) % W
    donor = torch.where(m.index_select(0, d)[:, None], k.index_select(0, d).to(ring.dtype), ring[s_d, p_d % W])
    ring[rows, cols] = torch.where(m[:, None], k.to(ring.dtype), donor)
