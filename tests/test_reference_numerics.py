"""`reference` numerics (DeepSeek's QAT simulation, engine/numerics.py) against
independent implementations written here from the spec (§3.3-3.5, §3.10, §4.4):

* fp8_sim: per block of channels, scale ``2^ceil(log2(max(amax, 1e-4) / 448))``, e4m3
  round trip (nearest, ties to the even code) -- e4m3 decoded from its bits and rounded by
  brute-force nearest-neighbour search over all 127 finite magnitudes;
* fp4_sim: scale ``2^ceil(log2(max(amax, 6*2^-126) / 6))``, nearest of the 8 e2m1
  magnitudes, ties to the even code, same brute force;
* Hadamard: the explicit Sylvester matrix (repeated kron) times n^-1/2.

The scale exponent is the exact smallest k with ``amax <= qmax * 2^k`` (found by exact
comparisons in fp64), which is what DeepSeek's kernels compute from the float's bits.
All reference arithmetic is fp64, where every step here is exact.

Then on a loaded tiny model: reference vs plain logits, the KV's FP8 nope dims, the
compressors' and the indexer's simulated outputs, and set_numerics' argument check.
"""
import copy

import pytest
import torch

from conftest import rel_err
from engine.model import load_model
from engine import numerics as QS
from engine.model.rope import cos_sin

# ----------------------------------------------------------------------------- independent references


def _e4m3_grid():
    """Finite non-negative e4m3fn magnitudes with their codes (0x00..0x7E; 0x7F is NaN)."""
    vals = []
    for code in range(0x7F):
        e, m = code >> 3, code & 7
        vals.append(m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return torch.tensor(vals, dtype=torch.float64), torch.arange(0x7F)


E4M3_MAGS, E4M3_CODES = _e4m3_grid()
E2M1_MAGS = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
E2M1_CODES = torch.arange(8)
assert E4M3_MAGS.max() == 448 and bool((E4M3_MAGS.diff() > 0).all())


def nearest_even(a: torch.Tensor, mags: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Magnitudes a >= 0 (fp64) -> the nearest grid value; of two equally near, the even code."""
    d = (a[..., None] - mags).abs()                        # exact in fp64 for these inputs
    cand = d == d.amin(-1, keepdim=True)
    even = cand & (codes % 2 == 0)
    idx = torch.where(even.any(-1), even.to(torch.int8).argmax(-1), cand.to(torch.int8).argmax(-1))
    return mags[idx]


def exact_pow2_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """2^k for the smallest integer k with amax <= qmax * 2^k (amax fp64 > 0)."""
    k = torch.ceil(torch.log2(amax / qmax))
    for _ in range(3):  # log2 may be off by one near powers of two: settle it exactly
        k = torch.where(qmax * torch.exp2(k) < amax, k + 1, k)
        k = torch.where(qmax * torch.exp2(k - 1) >= amax, k - 1, k)
    assert bool((amax <= qmax * torch.exp2(k)).all() & (amax > qmax * torch.exp2(k - 1)).all())
    return torch.exp2(k)


def _work_dtype(x):
    # the simulation computes in fp32 (fp64 for fp64 tensors); the amax floor is that dtype's constant
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def ref_fp8_sim(x: torch.Tensor, block: int) -> torch.Tensor:
    xb = x.double().unflatten(-1, (-1, block))
    floor = torch.tensor(1e-4, dtype=_work_dtype(x)).item()
    s = exact_pow2_scale(xb.abs().amax(-1, keepdim=True).clamp(min=floor), 448.0)
    y = (xb / s).clamp(-448.0, 448.0)
    q = torch.sign(y) * nearest_even(y.abs(), E4M3_MAGS, E4M3_CODES)
    return (q * s).flatten(-2).to(x.dtype)


def ref_fp4_sim(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    xb = x.double().unflatten(-1, (-1, block))
    s = exact_pow2_scale(xb.abs().amax(-1, keepdim=True).clamp(min=6.0 * 2.0 ** -126), 6.0)
    y = (xb / s).clamp(-6.0, 6.0)
    q = torch.sign(y) * nearest_even(y.abs(), E2M1_MAGS, E2M1_CODES)
    return (q * s).flatten(-2).to(x.dtype)


def sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.kron(h, torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64))
    assert h.shape[0] == n, "power of two only"
    return h


def ref_hadamard(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1]
    return (x.double() @ sylvester(n).T * n ** -0.5).to(x.dtype)


def is_fp8_exact(x: torch.Tensor, block: int) -> bool:
    return torch.equal(ref_fp8_sim(x, block), x)


# ----------------------------------------------------------------------------- the references themselves


def test_references_round_ties_to_even_code():
    # e4m3 around 1 (spacing 1/8): 1.0625 between 1 (code 0x38) and 1.125 (0x39) -> 1;
    # 1.1875 between 1.125 and 1.25 (0x3A) -> 1.25; subnormal 2^-10 between 0 and 2^-9 -> 0;
    # 3*2^-10 between 2^-9 (code 1) and 2^-8 (code 2) -> 2^-8; 464 is not reachable (clamped).
    a = torch.tensor([1.0625, 1.1875, 2.0 ** -10, 3 * 2.0 ** -10, 1.0625 + 1e-9, 1.1875 - 1e-9], dtype=torch.float64)
    assert nearest_even(a, E4M3_MAGS, E4M3_CODES).tolist() == [1.0, 1.25, 0.0, 2.0 ** -8, 1.125, 1.125]
    a = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.2500001, 4.9999], dtype=torch.float64)
    assert nearest_even(a, E2M1_MAGS, E2M1_CODES).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 4.0]
    amax = torch.tensor([448.0, 448.0 * (1 + 2.0 ** -40), 224.0, 1.0], dtype=torch.float64)
    assert exact_pow2_scale(amax, 448.0).tolist() == [1.0, 2.0, 0.5, 2.0 ** -8]
    h = sylvester(8)
    assert torch.equal(h @ h.T, 8 * torch.eye(8, dtype=torch.float64)) and bool((h[0] == 1).all())


# ----------------------------------------------------------------------------- quant_sim vs references


def next_up(v: float, dtype) -> float:
    """The smallest `dtype` value above the (representable, positive) v."""
    ibits = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16}[dtype]
    return (torch.tensor(v, dtype=dtype).view(ibits) + 1).view(dtype).item()


def _random_blocks(shape, block, dtype, seed):
    """Gaussian values with one magnitude per block spread over 1e-7..1e4, plus special blocks:
    all zero, amax below the 1e-4 floor, amax exactly 448*2^k / 6*2^k, and just above it."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    xb = x.unflatten(-1, (-1, block))
    mag = 10.0 ** (torch.rand(*xb.shape[:-1], 1, generator=g, dtype=torch.float64) * 11 - 7)
    xb = xb * mag
    flat = xb.reshape(-1, block)
    flat[0] = 0
    flat[1] *= 1e-6 / flat[1].abs().max()              # under the fp8 floor
    for i, (qmax, k) in enumerate([(448.0, 0), (448.0, -5), (6.0, 3), (6.0, -9)]):
        row = flat[2 + 2 * i]
        row *= 0.9 * qmax * 2.0 ** k / row.abs().max()
        row[3] = qmax * 2.0 ** k                         # amax exactly on a power-of-two scale
        nxt = flat[3 + 2 * i]
        nxt *= 0.9 * qmax * 2.0 ** k / nxt.abs().max()
        # the next representable value above qmax * 2^k: the scale must double
        nxt[5] = next_up(qmax * 2.0 ** k, dtype)
        # values deep in the block's subnormal range: the only ones a scale off by 2x changes
        # (doubling a power-of-two scale maps the rest of a float grid onto itself)
        tiny = qmax * 2.0 ** k * torch.tensor([2.0 ** -15, -3 * 2.0 ** -16, 2.0 ** -17, 5 * 2.0 ** -18, 2.0 ** -5])
        row[6:11] = tiny.double()
        nxt[6:11] = tiny.double()
    return flat.reshape(shape).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("block", [64, 128])
def test_fp8_sim_random(dtype, block):
    x = _random_blocks((6, 5, 256), block, dtype, seed=block)
    got = QS.fp8_sim_ref(x, block)
    assert got.dtype == dtype and got.shape == x.shape
    want = ref_fp8_sim(x, block)
    bad = (got != want).nonzero()
    assert bad.numel() == 0, f"{len(bad)} mismatches, first at {bad[0].tolist()}: x={x[tuple(bad[0])]!r} " \
                             f"got {got[tuple(bad[0])]!r} want {want[tuple(bad[0])]!r}"
    assert is_fp8_exact(got, block)                      # the result is on the block's grid
    assert not is_fp8_exact(x, block)                    # ... and the input was not


def _fp8_tie_blocks(dtype, scale_exp):
    """Blocks of 64 whose amax is 448 * 2^scale_exp, the rest exact e4m3 midpoints, and
    midpoints nudged by (much) less than an fp32 ulp either way in fp64."""
    mids = (E4M3_MAGS[:-1] + E4M3_MAGS[1:]) / 2                       # 126 exact ties
    vals = [mids, -mids]
    if dtype == torch.float64:
        vals += [mids * (1 + 2.0 ** -40), mids * (1 - 2.0 ** -40), -mids * (1 + 2.0 ** -40)]
    v = torch.cat(vals)
    n = -(-v.numel() // 63)
    v = torch.cat((v, torch.zeros(n * 63 - v.numel(), dtype=torch.float64))).view(n, 63)
    blocks = torch.cat((torch.full((n, 1), 448.0, dtype=torch.float64), v), dim=1)
    return (blocks * 2.0 ** scale_exp).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale_exp", [0, -7, 5])
def test_fp8_sim_exact_ties(dtype, scale_exp):
    x = _fp8_tie_blocks(dtype, scale_exp)
    got, want = QS.fp8_sim_ref(x, 64), ref_fp8_sim(x, 64)
    bad = (got != want).nonzero()
    assert bad.numel() == 0, f"{len(bad)} mismatches, e.g. x={x[tuple(bad[0])].item()!r}: " \
                             f"got {got[tuple(bad[0])].item()!r}, want {want[tuple(bad[0])].item()!r}"
    # spot check against hand values: 1.0625 -> 1.0 and 1.1875 -> 1.25 (ties to even)
    s = 2.0 ** scale_exp
    y = QS.fp8_sim_ref(torch.tensor([[448.0, 1.0625, 1.1875, -1.0625] + [0.0] * 60], dtype=dtype) * s, 64) / s
    assert y[0, 1:4].tolist() == [1.0, 1.25, -1.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_fp4_sim_random(dtype):
    x = _random_blocks((4, 7, 128), 32, dtype, seed=7)
    got, want = QS.fp4_sim_ref(x, 32), ref_fp4_sim(x, 32)
    assert got.dtype == dtype and torch.equal(got, want)
    assert torch.equal(ref_fp4_sim(got, 32), got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("scale_exp", [0, -3, 4, -126])
def test_fp4_sim_exact_ties(dtype, scale_exp):
    if dtype == torch.bfloat16 and scale_exp == -126:
        scale_exp = -100
    mids = (E2M1_MAGS[:-1] + E2M1_MAGS[1:]) / 2                       # 0.25 .. 5.0
    row = torch.cat((torch.tensor([6.0]), mids, -mids, E2M1_MAGS, -E2M1_MAGS[1:], mids * (1 + 2.0 ** -6),
                     mids * (1 - 2.0 ** -6)))
    x = torch.cat((row, torch.zeros(64 - row.numel(), dtype=torch.float64))).view(2, 32) * 2.0 ** scale_exp
    x[1, 0] = 6.0 * 2.0 ** scale_exp                                   # each block's amax: scale exactly 2^scale_exp
    x = x.to(dtype)
    got, want = QS.fp4_sim_ref(x, 32), ref_fp4_sim(x, 32)
    assert torch.equal(got, want), (x, got, want)
    y = QS.fp4_sim_ref(torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 4, dtype=dtype) * 2.0 ** scale_exp)
    assert (y[:8] / 2.0 ** scale_exp).tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


def test_fp4_sim_zero_and_tiny_blocks():
    x = torch.zeros(3, 32)
    x[1, :4] = torch.tensor([1e-39, -3e-39, 2e-40, 0.0])   # fp32 subnormals: scale floored at 2^-126
    x[2, 0] = 1e-30
    assert torch.equal(QS.fp4_sim_ref(x), ref_fp4_sim(x))
    assert torch.equal(QS.fp4_sim_ref(x)[0], x[0])


@pytest.mark.parametrize("n", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_hadamard_is_sylvester(n, dtype):
    x = torch.randn(3, 4, n, generator=torch.Generator().manual_seed(n), dtype=torch.float64).to(dtype)
    got, want = QS.hadamard(x), ref_hadamard(x)
    assert got.dtype == dtype
    if dtype == torch.float64:
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)
    elif dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    # orthogonal and an involution; row 0 is the (scaled) sum: Sylvester, not Walsh, order
    torch.testing.assert_close(QS.hadamard(QS.hadamard(x.double())), x.double())
    torch.testing.assert_close(QS.hadamard(x.double())[..., 0], x.double().sum(-1) * n ** -0.5)


# ----------------------------------------------------------------------------- on a loaded tiny model


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return tiny_ckpt("tiny", 0)


@pytest.fixture(scope="module")
def model(ckpt):
    return load_model(ckpt, numerics="reference")


def _ids(S, seed):
    return torch.randint(2, 129280, (1, S), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def attn_inputs(model):
    """The input x of every layer's attention on a 32-token prompt (plain numerics):
    8 CSA entries (ratio 4, more than its top-4) and 2 ratio-16 entries per sequence."""
    xs, hooks = {}, []
    for i, layer in enumerate(model.layers):
        hooks.append(layer.attn.register_forward_pre_hook(lambda m, args, i=i: xs.__setitem__(i, args[0].clone())))
    try:
        model.set_numerics("plain")(_ids(32, 5))
    finally:
        for h in hooks:
            h.remove()
    assert sorted(xs) == list(range(len(model.layers)))
    return xs


def test_reference_logits_differ_but_stay_close(model):
    ids = _ids(16, 0)
    plain = model.set_numerics("plain")(ids)[0]
    ref = model.set_numerics("reference")(ids)[0]
    again = model(ids)[0]
    assert torch.equal(ref, again)                                    # deterministic
    err = rel_err(ref, plain)                                         # per position, on max-abs scale
    assert bool((err > 1e-3).all()), err                              # every position really changes
    cos = torch.nn.functional.cosine_similarity(ref, plain, dim=-1)
    # FP8 rounding of every GEMM input (~3% per element) through 5 blocks: loose closeness
    assert err.median() < 0.2 and err.max() < 0.6, err
    assert cos.median() > 0.98 and cos.min() > 0.85, cos
    model.set_numerics("plain")
    assert torch.equal(model(ids)[0], plain)                          # switching back restores plain


def _qkv(attn, x):
    pos = torch.arange(x.shape[1])
    cos, sin = cos_sin(pos, attn.inv_freq)
    return attn.qkv(x, cos, sin)


def test_kv_nope_dims_fp8_in_reference_only(model, attn_inputs):
    nope = model.cfg.head_dim - model.cfg.rope_dim
    for i, layer in enumerate(model.layers):
        x = attn_inputs[i]
        # 1) the real input: reference KV nope dims sit on an FP8 grid per 64, plain ones do not
        model.set_numerics("reference")
        _, kv_ref, _ = _qkv(layer.attn, x)
        model.set_numerics("plain")
        _, kv_plain, _ = _qkv(layer.attn, x)
        assert is_fp8_exact(kv_ref[..., :nope], 64), f"layer {i}"
        assert not is_fp8_exact(kv_plain[..., :nope], 64), f"layer {i}"
        assert not is_fp8_exact(kv_ref[..., nope:], 64), f"layer {i}: rope dims must stay unrounded"
        # 2) an input already on wkv's FP8 activation grid (per 128), so that the GEMM input
        #    rounding of reference mode is the identity: then the rope dims are identical and
        #    the nope dims are exactly the plain ones through the independent fp8 simulation.
        x8 = ref_fp8_sim(x, 128)
        model.set_numerics("reference")
        _, kv_ref, _ = _qkv(layer.attn, x8)
        model.set_numerics("plain")
        _, kv_plain, _ = _qkv(layer.attn, x8)
        assert torch.equal(kv_ref[..., nope:], kv_plain[..., nope:]), f"layer {i}"
        assert torch.equal(kv_ref[..., :nope], ref_fp8_sim(kv_plain[..., :nope], 64)), f"layer {i}"
        assert not torch.equal(kv_ref, kv_plain)


def test_kv_captured_in_reference_forward_is_fp8(model):
    """Same property, on the KV computed inside a reference-mode forward (hook on attn.qkv's caller)."""
    nope = model.cfg.head_dim - model.cfg.rope_dim
    kvs = {}

    def hook(mod, args, i):
        kvs[i] = _qkv(mod, args[0])[1]

    hooks = [l.attn.register_forward_pre_hook(lambda m, a, i=i: hook(m, a, i)) for i, l in enumerate(model.layers)]
    try:
        model.set_numerics("reference")(_ids(12, 3))
    finally:
        for h in hooks:
            h.remove()
    assert len(kvs) == len(model.layers)
    for i, kv in kvs.items():
        assert is_fp8_exact(kv[..., :nope], 64), f"layer {i}"


def test_main_compressor_fp8_on_nope_dims(model, attn_inputs):
    nope = model.cfg.head_dim - model.cfg.rope_dim
    n_checked = 0
    for i, layer in enumerate(model.layers):
        comp = layer.attn.compressor
        if comp is None:
            continue
        x = attn_inputs[i]
        model.set_numerics("plain")
        plain = comp(x, layer.attn.inv_freq)
        model.set_numerics("reference")
        ref = comp(x, layer.attn.inv_freq)
        assert plain.shape[1] == x.shape[1] // comp.ratio > 0
        want = torch.cat((ref_fp8_sim(plain[..., :nope], 64), plain[..., nope:]), dim=-1)
        assert torch.equal(ref, want), f"layer {i}"
        assert not torch.equal(ref, plain)
        n_checked += 1
    assert n_checked == sum(r > 0 for r in model.cfg.compress_ratios)


def _as_fp64(module, mode, model):
    model.set_numerics(mode)
    return copy.deepcopy(module).double()


def test_indexer_compressor_and_queries_hadamard_fp4(model, attn_inputs):
    """Indexer keys and queries: reference = FP4(Hadamard(plain)), whole head dim.

    Checked on fp64 copies of the modules: FP4 rounding is discontinuous, and the engine's
    fast transform and the explicit matrix product differ by an fp32 ulp or so; in fp64 that
    never reaches a rounding boundary."""
    n_checked = 0
    for i, layer in enumerate(model.layers):
        idx = layer.attn.indexer
        if idx is None:
            continue
        x = attn_inputs[i].double()
        inv = layer.attn.inv_freq
        plain_c, ref_c = _as_fp64(idx.compressor, "plain", model), _as_fp64(idx.compressor, "reference", model)
        plain, ref = plain_c(x, inv), ref_c(x, inv)
        assert plain.shape == (1, x.shape[1] // 4, model.cfg.index_head_dim)
        assert torch.equal(ref, ref_fp4_sim(ref_hadamard(plain), 32)), f"layer {i}"
        assert not torch.equal(ref, plain)
        # queries: feed a q_lora input already on the FP8 activation grid so only the FP4 step differs
        pos = torch.arange(x.shape[1])
        cos, sin = cos_sin(pos, inv)
        model.set_numerics("plain")
        _, _, qr = _qkv(layer.attn, attn_inputs[i])
        qr8 = ref_fp8_sim(qr.double(), 128)
        q_plain, w_plain = _as_fp64(idx, "plain", model).queries(x, qr8, cos, sin)
        q_ref, w_ref = _as_fp64(idx, "reference", model).queries(x, qr8, cos, sin)
        assert torch.equal(q_ref, ref_fp4_sim(ref_hadamard(q_plain), 32)), f"layer {i}"
        assert torch.equal(w_ref, w_plain)                          # weights_proj is bf16: untouched
        n_checked += 1
    assert n_checked == sum(r == 4 for r in model.cfg.compress_ratios)


def test_set_numerics_rejects_unknown_mode(model):
    model.set_numerics("reference")
    with pytest.raises(ValueError, match=r"numerics must be one of \('plain', 'reference'\), got 'fp8'"):
        model.set_numerics("fp8")
    assert model.numerics.name == "reference"                       # unchanged by the failed call
    with pytest.raises(ValueError, match="'Reference'"):
        model.set_numerics("Reference")
    model.set_numerics("plain")
    assert model.numerics.name == "plain"
    rounding = [m for m in model.modules() if hasattr(m, "numerics") and m is not model]
    assert rounding and all(m.numerics is model.numerics for m in rounding)
    assert not (model.numerics.kv_fp8 or model.numerics.indexer_fp4 or model.numerics.act_fp8)
