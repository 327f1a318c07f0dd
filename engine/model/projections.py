"""The projections that read one input, packed as one GEMM (engine.kernels.proj_gemm).

Per block, up to five groups, each a single launch at decode:
- "attn", on the attention's normed x [.., D]: wq_a and wkv (FP8 Linears: input rounded to e4m3
  in reference numerics, outputs in the model dtype), the indexer's weights_proj (bf16 Linear),
  then the attention compressor's and the indexer compressor's wkv and wgate (fp32 outputs, as
  Compressor.project computes them). Up to CODES_MAX_M tokens its FP8 rows read x's e4m3 codes
  and scales as mhc_pre made them (takes_codes), as do the FFN group's.
- "ffn", on the FFN's normed x: the shared expert's w1 and w3 (FP8), then the router gate's
  logits (fp32), when the router is the sqrt-softplus one the router kernel takes.
- "q", on the q latent (wq_a's output) before its RMSNorm: wq_b and the indexer's wq_b (FP8),
  the norm done inside the kernel. Taken up to Q_GROUP_MAX_M tokens: bench/proj.py measures it
  faster than rms_norm + two cuBLAS GEMMs at M <= 16 and slower at M = 64 (bench/RESULTS.md), so
  larger steps (prefill, big batches) keep the cuBLAS path.
- "wo_a", the attention output's wo_a (bf16, as DeepSeek runs it) where the rank holds one head
  group (TP = 8 at the real dims: a plain GEMM, not a grouped one), and "wo", the lone wo_b on
  wo_a's output: each one launch (wo's rounds its input to e4m3 and dots the FP8 rows on the FP8
  tensor cores) instead of cuBLAS with its split-K reduce (and, for wo_b, act_sim before it).
  Taken up to WO_GROUP_MAX_M tokens (bench/proj.py --groups wo_a,wo_b: bench/RESULTS.md).
- "w2", the shared expert's w2 (FP8 rows only) on its SwiGLU, which the kernel makes from the w1
  and w3 outputs in its K loop (proj_gemm's swiglu): one launch instead of the activation kernel
  and cuBLAS, up to W2_GROUP_MAX_M tokens (bench/proj.py: the lone w2 is no faster packed than on
  cuBLAS, slower at M = 64; the launch is what this saves). Off by default (W2_GROUP_MAX_M = 0):
  the step measured ~0.1 ms slower with it (below).
Prefill-sized steps (proj_gemm.UNFUSED_M tokens on) run the attn and ffn groups as one GEMM per
projection (cuBLAS, on the Linears' dequantised weights): there the GEMMs are compute-bound and
the kernel's weight-stream tiles are 2-4x slower (bench/RESULTS.md).

FP8 rows are kept as the checkpoint's e4m3 + E8M0 bytes when the kernel runs (half the bytes of
the dequantised copy), re-derived from the loaded weight and used only if that is exact, as it is
for every checkpoint weight. Dense rows are copied into the packed buffer once and the module's
weight becomes a view of it (no second copy). Packing is redone whenever numerics (which rows
round their input) or the kernel set change: Transformer.pack_projections.
"""
import torch

from ..kernels.proj_gemm import QBLOCK, Proj, pack_proj
from ..numerics import Numerics, fp8_block_dequant
from .block import Block
from .linear import Linear

Q_GROUP_MAX_M = 16      # tokens in a step up to which the q group runs packed (see above)
WO_GROUP_MAX_M = 16     # and the wo_a / wo groups (bench/proj.py: faster than cuBLAS at 1-16 tokens, slower at 64)
# The w2 group with its SwiGLU: off (0; code and tests kept, bench/decode.py --ab swiglu_w2 turns
# it on). It saves a launch a layer yet measured slower in every A/B (2026-12-05, C = 1 / C = 16):
# +0.10 / +0.07 ms a step with proj_plan's split-K (H200), +0.09 / +0.15 with W2_PLAN's one
# program per 64 rows, unsplit (H100), +0.12 / +0.18 with that plan launched without PDL (H200),
# where ~0 to -0.03 was predicted; why (it runs beside the routed experts) is not found.
W2_GROUP_MAX_M = 0
W2_PLAN = dict(block_n=64, split_k=1)
CODES_MAX_M = 16        # tokens up to which the x and FFN groups' FP8 rows dot x's e4m3 codes (16-row tiles)


def takes_codes(p: Proj | None, M: int) -> bool:
    """Whether the group's FP8 rows dot x's e4m3 codes and scales at M tokens (proj_gemm's xq),
    so that mhc_pre, which makes x, should also make them (its act_q)."""
    return p is not None and 0 < p.n8 <= p.n_act and M <= CODES_MAX_M


def fp8_rows(lin: Linear):
    """(e4m3, E8M0) of an FP8 Linear whose dequantisation is exactly its weight, else None."""
    if lin.qweight is not None:
        return lin.qweight, lin.qscale
    w = lin.weight
    if lin.fmt != "fp8" or w.dtype != torch.bfloat16 or w.shape[0] % QBLOCK or w.shape[1] % QBLOCK:
        return None
    from .formats import fp8_block_quant
    q, s = fp8_block_quant(w.float())
    return (q, s) if torch.equal(fp8_block_dequant(q, s), w.float()) else None


def _linear(name: str, lin: Linear, num: Numerics, fp8: bool, lo: bool = True):
    rows = fp8_rows(lin) if fp8 else None
    w = lin.weight if lin.weight is not None else fp8_block_dequant(lin.qweight, lin.qscale).to(torch.bfloat16)
    return name, w, rows, num.act_fp8 and lin.fp8_gemm, lo


def attn_segments(b: Block, num: Numerics, fp8: bool) -> list:
    a = b.attn
    segs = [_linear("wq_a", a.wq_a, num, fp8), _linear("wkv", a.wkv, num, fp8)]
    ix = a.indexer
    if ix is not None:
        segs.append(_linear("idx.weights_proj", ix.weights_proj, num, False))
    for prefix, c in (("comp.", a.compressor), ("idx.comp.", ix.compressor if ix is not None else None)):
        if c is not None:
            segs += [(prefix + "wkv", c.wkv.weight, None, False, False), (prefix + "wgate", c.wgate.weight, None, False, False)]
    return segs


def ffn_segments(b: Block, num: Numerics, fp8: bool) -> list:
    m, segs = b.ffn, []
    if m.shared_experts is not None:
        segs += [_linear("w1", m.shared_experts.w1, num, fp8), _linear("w3", m.shared_experts.w3, num, fp8)]
    if m.gate.score_func == "sqrtsoftplus":     # the others route through Gate.forward
        segs.append(("gate", m.gate.weight, None, False, False))
    return segs


def q_segments(b: Block, num: Numerics, fp8: bool) -> list:
    a = b.attn
    segs = [_linear("wq_b", a.wq_b, num, fp8)]
    if a.indexer is not None:
        segs.append(_linear("idx.wq_b", a.indexer.wq_b, num, fp8))
    # one region per group: the two must agree on FP8 rows and on the input rounding
    return segs if len({(s[2] is not None, s[3]) for s in segs}) == 1 else []


def w2_segments(b: Block, num: Numerics, fp8: bool) -> list:
    s = b.ffn.shared_experts
    if s is None or not fp8 or fp8_rows(s.w2) is None:    # the SwiGLU K loop reads FP8 rows only
        return []
    return [_linear("w2", s.w2, num, fp8)]


def pack_block(b: Block, num: Numerics, fp8: bool) -> dict:
    """-> {"attn": Proj, "ffn": Proj or None, "q": Proj or None, "wo_a": Proj or None, "wo": Proj,
    "w2": Proj or None}; the dense rows' module weights become views of it."""
    out = {}
    a = b.attn
    for group, segs in (("attn", attn_segments(b, num, fp8)), ("ffn", ffn_segments(b, num, fp8)),
                        ("q", q_segments(b, num, fp8)),
                        ("wo_a", [_linear("wo_a", a.wo_a, num, False)] if a.n_groups == 1 else []),
                        ("wo", [_linear("wo_b", a.wo_b, num, fp8)]), ("w2", w2_segments(b, num, fp8))):
        segs.sort(key=lambda s: (s[2] is not None, s[3], s[4]), reverse=True)     # region order
        if not segs:
            out[group] = None
            continue
        w0 = segs[0][1]
        p = pack_proj(segs, w0.shape[1], w0.dtype, w0.device)
        _share(b, p, segs)
        out[group] = p
    return out


def _share(b: Block, p: Proj, segs):
    """Point each dense row block's module weight at its rows of the packed buffer."""
    params = {id(prm): prm for prm in b.parameters()}
    for name, w, fp8, _, _ in segs:
        if fp8 is None and id(w) in params:
            r, _, out, _ = p.outs[name]
            w.data = p.wd[r - p.n8:r - p.n8 + out]
