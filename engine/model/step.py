"""The engine's step: this step's tokens against the cache, one flat function per sub-layer.

Every op goes through `ops` (engine.kernels.Ops: the Triton kernel or its torch reference, chosen
once when the model was prepared) and every rounding DeepSeek's inference applies through `num`
(engine.numerics.Numerics), so this one code path runs on CPU with the references and on the GPU
with the kernels, and fusing two ops means replacing two lines here with one. Decode (one token
per row, [B,1]) and prefill (several rows' chunks of different lengths flattened into [1,T], see
StepInputs; decode rows may ride along as one-token chunks) share it; where they differ (how the
window's keys are found, the ring write, the compressor, which logits come out), the branch is on
the host-side `inp.decode`. Prefill addresses everything per token (its row's slot, block table
and chunk start), so no token is padding and no Python loop runs over tokens.

Shapes: B rows, S new tokens each (prefill: B = 1 and S = T, the step's tokens), D model width,
H query heads (this rank's), Dh = head_dim, R/2 rope frequencies, hc residual streams, E experts,
k routed per token. The cache-free whole-sequence forward of the modules (model.Transformer.forward)
stays the oracle this is tested against.
"""
import contextlib

import torch
import torch.nn.functional as F

from ..kernels import Ops
from ..kernels.compressor import SIM_CODE
from ..kernels.fused_moe import takes_shared
from ..kernels.kv_prep import fuses, together
from ..kernels.step_tables import entry_rows_ref, window_rows_ref
from ..numerics import Numerics, up
from ..parallel import sequence
from ..parallel.comm import all_reduce
from ..parallel.sequence import ChannelSplit, SeqSplit
from .attention import Attention
from .block import Block
from .compressor import Compressor
from .indexer import Indexer
from .kv_cache import LayerCache, StepInputs
from .linear import Linear
from .moe import MoE
from .projections import Q_GROUP_MAX_M, W2_GROUP_MAX_M, W2_PLAN, WO_GROUP_MAX_M, takes_codes


def forward(model, inp: StepInputs, caches: list[LayerCache], all_logits=False) -> torch.Tensor:
    """inp.ids at inp.positions -> fp32 logits; caches updated. Decode: of each row's token [B,V]
    (all_logits: [B,1,V]). Prefill: of each row's last token, in row order [B,V]; all_logits (a
    bool, or one per row) adds every token of those rows, still in order: [L,V]."""
    ops, num = model.ops, model.numerics
    sp = None if inp.decode else sequence.split(inp.ids.shape[1])   # prefill-sized: the streams split over the ranks
    h = embed(model, inp.ids, ops, sp)                          # [B,S,hc,D] (sp: [1,n,hc,D], this rank's tokens)
    layers = list(model.layers)
    head_mix = model.head_mix() if inp.decode else None     # prefill's head reads only some rows
    if inp.decode:      # the per-row tables every layer reads (StepInputs.once finds them), one launch
        inp.shared.update(ops.step_tables(inp.positions, inp.slots, inp.block_table, inp.block_tokens,
                                          tables_plan(layers, inp, caches[0].window.shape[1])))
    pre = hc_pre(layers[0], h, "attn", ops, num, sp)        # the first attention's input (its mix by a GEMM)
    for i, (layer, cache) in enumerate(zip(layers, caches)):
        nxt = layers[i + 1] if i + 1 < len(layers) else None
        h, pre, mix = block(layer, h, pre, inp, cache, ops, num, nxt, head_mix, sp)
    if sp is not None:          # the logit rows from the ranks that keep them
        return model.step_logits(sequence.rows(h[0], sp, inp.logit_token_list(all_logits)))   # [L,V]
    if not inp.decode:
        return model.step_logits(h[0, inp.logit_tokens(all_logits)])                       # [L,V]
    return model.step_logits(h if all_logits else h[:, -1], mix)


# Tokens up to which the embedding's launch writes all hc streams before the all-reduce: hc times
# its bytes, up to 512 KB at 16 tokens, where an all-reduce costs its latency, not its bytes; past
# it, the all-reduce of one copy and then the streams' copy (one launch more).
EMBED_STREAMS_MAX_T = 16


def embed(model, ids: torch.Tensor, ops: Ops, sp: SeqSplit | None = None) -> torch.Tensor:
    """ids [B,S] -> the hc residual streams [B,S,hc,D], each the token's embedding (vocab-parallel:
    every rank's rows, one all-reduce; sp: a reduce-scatter to this rank's tokens, [1,n,hc,D])."""
    e, hc = model.embed, model.cfg.hc_mult
    if sp is None and ids.numel() <= EMBED_STREAMS_MAX_T:
        return all_reduce(ops.embed(ids, e.weight, e.lo, hc))
    return close(ops.embed(ids, e.weight, e.lo, 1), sp).expand(-1, -1, hc, -1).contiguous()


def close(y: torch.Tensor, sp: SeqSplit | None) -> torch.Tensor:
    """A row-parallel op's partial sums [B,S,...] -> their sum over the ranks: of every token (an
    all-reduce), or under sequence parallelism of this rank's own tokens [1,n,...] (a reduce-scatter)."""
    return all_reduce(y) if sp is None else sequence.scatter(y, sp)


def opened(b: Block, name: str, pre, sp: SeqSplit | None, ops: Ops, num: Numerics):
    """-> the x, xa, xq of block b's `name` sub-layer from hc_pre's five. Sequence parallelism: of
    every token, x by an all-gather of each rank's own and xa (its FP8 rounding, per token as
    mhc_pre makes it) made again from it; xq is for small steps only (projections.CODES_MAX_M)."""
    x, xa, xq, _, _ = pre
    if sp is None:
        return x, xa, xq
    x = sequence.gather(x, sp)                                                              # [1,T,D]
    return x, ops.fp8_sim(x, 128) if pre_acts(b, name, num, sp.T)[0] else None, None


def block(b: Block, h: torch.Tensor, pre, inp: StepInputs, cache: LayerCache, ops: Ops, num: Numerics,
          nxt: Block | None = None, head_mix=None, sp: SeqSplit | None = None):
    """h [B,S,hc,D] and its attention input `pre` (hc_pre's x, xa, xq, post, comb) -> h [B,S,hc,D], the
    next block's attention input (nxt's; None after the last block) and the head's mix partials
    (the last block, with head_mix = (fn_hi, fn_lo, eps) of the head's mix; else None):
    attention, then MoE, each wrapped in mHC. Each sub-layer ends with hc_post_pre: its mhc_post
    and the next sub-layer's mhc_pre (one launch on small steps). sp (prefill-sized steps over
    several ranks): h, pre and the sub-layers' outputs are this rank's tokens' (n); each sub-layer
    reads every token's input (opened) and sums its output into the rank's own (close)."""
    post, comb = pre[3:]         # pre: hc_pre's five (x, xa, xq, post, comb), x [B,S,D] normed
    # post and comb may still be in the making on ops.side (hc_pre): mhc_post waits for it
    f = attention(b.attn, *opened(b, "attn", pre, sp, ops, num), b.proj, inp, cache, ops, num, sp)
    h, pre = hc_post_pre(f, h, post, comb, b, "ffn", ops, num, sp)
    post, comb = pre[3:]
    f = moe(b.ffn, *opened(b, "ffn", pre, sp, ops, num), b.proj["ffn"], inp.ids, ops, num, w2=b.proj.get("w2"),
            sp=sp)
    if nxt is not None:
        return (*hc_post_pre(f, h, post, comb, nxt, "attn", ops, num, sp), None)
    if head_mix is None:        # no mix for what reads the streams next (the head mixes itself)
        return ops.mhc_post(f, h, post, comb, after=ops.side), None, None
    h, mix = ops.mhc_post(f, h, post, comb, after=ops.side, mix=head_mix)
    return h, None, mix


def tables_plan(layers: list[Block], inp: StepInputs, W: int) -> list:
    """The per-row tables a decode step's layers read, under the keys they ask StepInputs.once
    for (kernels/step_tables.py's plan): angles per frequency set and per compressed-entry ratio,
    the window rows, HCA layers' entry rows, indexers' visible entries."""
    plan, seen = [("window rows", W)], set()
    for a in (b.attn for b in layers):
        want = [("rope", a.rope_key, a.inv_freq, None)]
        if a.compressor is not None:
            want.append(("rope", f"entry/{a.ratio}", a.inv_freq, a.ratio))
            if a.indexer is None:
                want.append(("entry rows", a.ratio, inp.max_len // a.ratio))
        if a.indexer is not None:
            want.append(("visible entries", a.indexer.ratio))
        for item in want:
            if item[:2] not in seen:
                seen.add(item[:2])
                plan.append(item)
    return plan


def pre_acts(b: Block, name: str, num: Numerics, T: int):
    """-> (act, codes) of block b's `name` sub-layer input for T tokens: whether its FP8 GEMMs take
    the input's e4m3 rounding from mhc_pre (xa), and that rounding as codes and scales (xq)."""
    if name == "attn":
        g = b.proj["attn"]
        return g.n_act > 0, takes_codes(g, T)
    g, e = b.proj["ffn"], b.ffn.experts     # the rounding feeds the shared expert's rows and the fused MoE
    act = g is not None and g.n_act > 0 or e.packed is not None and num.act_fp8 and e.quantized
    return act, takes_codes(g, T)


def act_buffers(h: torch.Tensor, act: bool, codes: bool):
    """-> xa [B,S,D] (h's dtype) or None, xq = (e4m3 codes [B,S,D], fp32 scales [B,S,D/128]) or None."""
    shape = h.shape[:-2] + h.shape[-1:]
    xa = torch.empty(shape, dtype=h.dtype, device=h.device) if act else None
    xq = (torch.empty(shape, dtype=torch.float8_e4m3fn, device=h.device),
          torch.empty(shape[:-1] + (shape[-1] // 128,), dtype=torch.float32, device=h.device)) if act and codes else None
    return xa, xq


def pre_args(b: Block, name: str) -> tuple:
    """Block b's `name` mhc_pre weights and constants: fn_hi, fn_lo, scale, base, the norm's weight,
    Sinkhorn's iterations, hc_eps, norm_eps."""
    norm = b.attn_norm if name == "attn" else b.ffn_norm
    return (*b.mix_weight(name), getattr(b, f"hc_{name}_scale"), getattr(b, f"hc_{name}_base"), norm.weight,
            b.hc_iters, b.hc_eps, b.norm_eps)


def hc_pre(b: Block, h: torch.Tensor, name: str, ops: Ops, num: Numerics, sp: SeqSplit | None = None):
    """-> the sub-layer's normed input x [B,S,D], xa = fp8_sim(x, 128) where its FP8 GEMMs take
    it (rounded once here; else None), xq = xa as (e4m3 codes [B,S,D], fp32 scales [B,S,D/128])
    for the projections' FP8 dots (else None), post [B,S,hc], comb [B,S,hc,hc] (fp32). post and
    comb are made on ops.side (CUDA), beside the sub-layer (they are mhc_post's alone): nothing
    else may read them. The mix by mhc_pre's GEMM (the first sub-layer). sp: no xa, xq (opened
    makes them after the gather)."""
    xa, xq = act_buffers(h, *pre_acts(b, name, num, h.shape[0] * h.shape[1])) if sp is None else (None, None)
    x, post, comb = ops.mhc_pre(h, *pre_args(b, name), act_out=xa, act_q=xq, side=ops.side)
    return x, xa, xq, post, comb


def hc_post_pre(f: torch.Tensor, h: torch.Tensor, post, comb, b: Block, name: str, ops: Ops, num: Numerics,
                sp: SeqSplit | None = None):
    """A sub-layer's output f [B,S,D] into the streams h (its post, comb) -> the new streams and
    block b's `name` sub-layer input as hc_pre's five: mhc_post and the next mhc_pre, one launch on
    small steps (the streams' mix partials and the collapse in mhc_post's programs). sp: as hc_pre."""
    xa, xq = act_buffers(h, *pre_acts(b, name, num, h.shape[0] * h.shape[1])) if sp is None else (None, None)
    h, (x, post, comb) = ops.mhc_post_pre(f, h, post, comb, *pre_args(b, name), after=ops.side, act_out=xa,
                                          act_q=xq, side=ops.side)
    return h, (x, xa, xq, post, comb)


def beside(ops: Ops, on: bool = True):
    """-> a context whose launches go to ops.aux (CUDA), after everything the step's stream has
    launched so far, or none (CPU, or not `on`): a chain the step's next ops do not read, run beside
    them; join(ops) (or an op's `after=ops.aux`) before the first op that reads its output. The
    chain may read what was made before it; a StepInputs memo it makes (inp.once) is on its
    stream: the step's stream must not read that before the join (make such a memo before the
    chain, as attention does with entry_cos_sin, when both read it)."""
    if ops.aux is None or not on:
        return contextlib.nullcontext()
    ops.aux.wait_stream(torch.cuda.current_stream())
    return torch.cuda.stream(ops.aux)


def join(ops: Ops):
    """The step's stream waits for what beside(ops) launched (call it only after a beside: under
    graph capture a wait on the stream's work of an earlier, uncaptured step is an error)."""
    if ops.aux is not None:
        torch.cuda.current_stream().wait_stream(ops.aux)


def linear(lin: Linear, x: torch.Tensor, ops: Ops, num: Numerics, rounded: bool = False) -> torch.Tensor:
    """x [...,in] -> [...,out] in x's dtype. DeepSeek's FP8 GEMMs take e4m3 activations (per 128
    channels) in reference numerics; the FP8 GEMM kernel rounds them itself. rounded: x is on
    that grid already (its producer rounded it)."""
    act = num.act_fp8 and lin.fp8_gemm and not rounded
    if lin.qweight is not None:
        return ops.fp8_gemm(x, lin.qweight, lin.qscale, act_quant=act, out_dtype=x.dtype)
    return F.linear(ops.fp8_sim(x, 128) if act else x, lin.weight)


# ---- attention ----
def attention(a: Attention, x: torch.Tensor, xa: torch.Tensor | None, xq, proj, inp: StepInputs,
              cache: LayerCache, ops: Ops, num: Numerics, sp: SeqSplit | None = None) -> torch.Tensor:
    """x [B,S,D] -> [B,S,D] (sp: this rank's tokens' [1,n,D], see close). Each query reads its
    window (ring rows, plus its chunk's own keys in prefill) and, in compressed layers, its
    compressed entries: flat row lists the sparse MQA kernel reads in place."""
    B, S, _ = x.shape
    cos, sin = inp.cos_sin(a.rope_key, a.inv_freq)                                        # [B,S,R/2]
    parts = channel_parts(a, sp)        # split steps: each compressor's projections on this rank's channels
    y = ops.proj_gemm(x, proj["attn"], xa=xa, xq=xq,   # wq_a, wkv, the compressors' and indexer's x projections: one GEMM
                      rows={pre + w: c.channels(x.device) for pre, c in parts.items() for w in ("wkv", "wgate")} or None)
    yq = q_up(a, y["wq_a"], proj.get("q"), ops, num, sp)                # the q latent's norm and up-projections
    n = inp.max_len // a.ratio if a.compressor is not None else 0      # entries visible to the latest token
    # decode: rope_qkv, the compressors and the indexer's queries in one launch (kernels/kv_prep.py);
    # unfused, the indexer's keys, queries, scores and top-k run beside this layer's own jobs
    fused, idx_b = fuses(inp.decode and a.compressor is not None), None
    with together(fused):
        if a.indexer is not None:
            entry_cos_sin(inp, a.ratio, a.inv_freq)      # made here: both compressors read it
            with beside(ops, inp.decode and not fused):
                iq = indexer_queries(a.indexer, y, yq["idx.wq_b"], cos, sin, inp, cache, a.inv_freq, ops, num, sp,
                                     parts.get("idx.comp."))
                if not fused:
                    idx_b = indexer_select(a.indexer, y, iq, inp, cache, n, ops, sp)             # [B*S,k]
        q = yq["wq_b"].unflatten(-1, (a.n_heads, a.head_dim))                                # [B,S,H,Dh]
        # norms, RoPE, the KV's FP8 rounding; decode also writes its key into the ring here
        ring = cache.window if inp.decode else None
        q, kv = ops.rope_qkv(q, y["wkv"], a.kv_norm.weight, a.eps, cos, sin,
                             positions=inp.positions, ring=ring, slots=inp.slots if inp.decode else None,
                             fp8=num.kv_fp8)                                                 # kv [B,S,Dh]
        if a.compressor is not None:
            compress(a.compressor, y["comp.wkv"], y["comp.wgate"], inp, cache.kv_state, cache.score_state,
                     cache.kv, a.inv_freq, x.dtype, ops, num, parts.get("comp."))
    W = cache.window.shape[1]
    if inp.decode:
        kv_a = cache.window.flatten(0, 1)
        idx_a = inp.once(("window rows", W), lambda: window_rows_ref(inp.positions, inp.slots, W))     # [B,W]
    else:
        kv_a, idx_a = chunk_window(kv, inp, cache.window)
    kv_b = cache.kv.flatten(0, 1) if a.compressor is not None else None
    if a.indexer is not None and fused:
        idx_b = indexer_select(a.indexer, y, iq, inp, cache, n, ops)                         # [B*S,k]
    elif a.indexer is not None and inp.decode:
        join(ops)               # the indexer's top-k
    elif a.compressor is not None and a.indexer is None:
        idx_b = inp.once(("entry rows", a.ratio), lambda: entry_rows(inp, a.ratio, n))         # [B*S,n]
    # the output rotated back by RoPE's inverse in the attention kernel's epilogue
    o = ops.sparse_attn(q.flatten(0, 1), kv_a, idx_a, kv_b, idx_b, a.attn_sink, a.scale,
                        rope=(cos.flatten(0, 1), sin.flatten(0, 1)))                           # [B*S,H,Dh]
    if not inp.decode:   # each chunk's last W keys go into its ring once every query has read it
        t, rows = inp.ring_writes(W)                                                        # [K], [K]
        cache.window.view(-1, kv.shape[-1]).index_copy_(0, rows, kv[0, t].to(cache.window.dtype))
    return output(a, o.view(B, S, a.n_heads, a.head_dim), proj, ops, num, sp)


def q_up(a: Attention, latent: torch.Tensor, group, ops: Ops, num: Numerics, sp: SeqSplit | None = None) -> dict:
    """The q latent [B,S,q_lora] -> {"wq_b": [B,S,H*Dh], "idx.wq_b": [B,S,h*d] (indexed layers;
    sp: of this rank's tokens [1,n,h*d], the replicated indexer's queries are its own alone) of
    rms_norm(latent). Small steps: one packed GEMM with the norm inside; larger: the norm, then
    cuBLAS (projections.Q_GROUP_MAX_M says why)."""
    if group is not None and latent.shape[0] * latent.shape[1] <= Q_GROUP_MAX_M and sp is None:
        return ops.proj_gemm(latent, group, norm=(a.q_norm.weight, a.eps))
    qr = ops.rms_norm(latent, a.q_norm.weight, a.eps)
    out = {"wq_b": linear(a.wq_b, qr, ops, num)}
    if a.indexer is not None:
        out["idx.wq_b"] = linear(a.indexer.wq_b, qr if sp is None else sequence.mine(qr[0], sp)[None], ops, num)
    return out


def output(a: Attention, o: torch.Tensor, proj, ops: Ops, num: Numerics, sp: SeqSplit | None = None) -> torch.Tensor:
    """o [B,S,H,Dh] -> [B,S,D]: grouped wo_a (bf16, as DeepSeek's converter leaves it), wo_b, and
    the sum over the ranks' heads (close). Small steps: each a packed launch (the "wo_a" and "wo"
    groups, projections.py)."""
    small = o.shape[0] * o.shape[1] <= WO_GROUP_MAX_M
    if small and proj.get("wo_a") is not None:       # one head group on this rank: a plain GEMM
        z = ops.proj_gemm(o.flatten(-2), proj["wo_a"])["wo_a"]                              # [B,S,o_lora]
    else:
        o = o.flatten(-2).unflatten(-1, (a.n_groups, -1))                                   # [B,S,G,H/G*Dh]
        z = torch.einsum("...gd,grd->...gr", o, a.wo_a.weight.unflatten(0, (a.n_groups, -1))).flatten(-2)
    if small and proj.get("wo") is not None:
        return close(ops.proj_gemm(z, proj["wo"])["wo_b"], sp)
    return close(linear(a.wo_b, z, ops, num), sp)                                           # [B,S,D]


def chunk_window(kv: torch.Tensor, inp: StepInputs, ring: torch.Tensor):
    """Prefill: keys = the B rows' ring rows [B*W,Dh] then the step's own keys [T,Dh]; each
    query's window as rows of that -> (keys, rows [T,W], -1 before position 0). The ring is
    not written yet: a chunk's earlier queries still need the rows its later keys replace."""
    W = ring.shape[1]
    keys = torch.cat((ring[inp.slots].flatten(0, 1), kv[0].to(ring.dtype)))
    return keys, inp.once(("chunk window", W), lambda: chunk_window_rows(inp, W))


def chunk_window_rows(inp: StepInputs, W: int) -> torch.Tensor:
    """-> [T,W]: each query's window keys as rows of chunk_window's keys. A key at or past its
    row's chunk start is that chunk's own (a row's tokens are consecutive, so it is the query's
    token moved back by the position gap); before it, the row's ring; -1 before position 0."""
    pos = inp.positions[0]                                                                 # [T]
    tok = torch.arange(pos.shape[0], device=pos.device)
    key_pos = pos[:, None] - W + 1 + torch.arange(W, device=pos.device)                    # [T,W]
    own = inp.slots.shape[0] * W + (tok - pos)[:, None] + key_pos
    ring = inp.token_rows()[:, None] * W + key_pos % W
    rows = torch.where(key_pos >= inp.token_starts()[:, None], own, ring)
    return torch.where(key_pos >= 0, rows, -1)


def entry_rows(inp: StepInputs, ratio: int, n: int) -> torch.Tensor:
    """HCA: every entry visible to each query as flat rows of the pool, -1 past it -> [B*S,n]
    (prefill: [T,n], each token through its own row's block table)."""
    pos, table = (inp.positions, inp.block_table) if inp.decode else (inp.positions.view(-1, 1), inp.token_table())
    return entry_rows_ref(pos, table, inp.block_tokens, ratio, n)


# ---- compressor and indexer ----
def channel_parts(a: Attention, sp: SeqSplit | None) -> dict:
    """A split step's channel split of each compressor, by its prefix in the attn group ({}: none)."""
    out = {}
    for pre, c in (("comp.", a.compressor), ("idx.comp.", a.indexer.compressor if a.indexer is not None else None)):
        part = sequence.channel_split(sp, c.head_dim, 2 if c.overlap else 1) if c is not None else None
        if part is not None:
            out[pre] = part
    return out


def compress(c: Compressor, kv: torch.Tensor, score: torch.Tensor, inp: StepInputs, kv_state: torch.Tensor,
             score_state: torch.Tensor, store: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, ops: Ops,
             num: Numerics, part: ChannelSplit | None = None):
    """Feed this step's projections kv, score [B,S,coff*d] (fp32) into the compressor's running
    state; windows that complete become entries (in the model's dtype, then `store`'s) in `store`
    [blocks, per_block, d]. Prefill: the one-token rows (a mixed step's decode rows) all at once
    through the decode op, the longer chunks through the compressor's torch prefill. part: kv and
    score hold only this rank's channels (a split step, channel_parts): the decode op gets its
    rows' every channel by an all-gather, the prefill pools the share and gathers the result."""
    sim = c.sim_of(num)
    code = SIM_CODE[sim]
    if inp.decode:
        cos, sin = entry_cos_sin(inp, c.ratio, inv_freq)
        return ops.compress_decode(kv[:, 0], score[:, 0], c.ape, kv_state, score_state, store.flatten(0, 1),
                                   inp.slots, inp.positions, inp.block_table, inp.block_tokens, c.norm.weight, cos,
                                   sin, c.norm.eps, c.ratio, code)
    single, rows = inp.single_rows(), inp.multi_rows()
    if single:
        t, b = inp.single_tokens()                                                           # [m], [m]
        cos, sin = entry_cos_sin(inp, c.ratio, inv_freq)                                     # [1,T,R/2]
        kv_t, score_t = (kv[0, t], score[0, t]) if part is None else part.gather([kv[0, t], score[0, t]])
        ops.compress_decode(kv_t, score_t, c.ape, kv_state, score_state, store.flatten(0, 1), inp.slots[b],
                            inp.positions[0, t, None], inp.block_table[b], inp.block_tokens, c.norm.weight,
                            cos[0, t], sin[0, t], c.norm.eps, c.ratio, code)
    if rows:
        c.prefill(kv, score, inp, rows, kv_state, score_state, store.flatten(0, 1), inv_freq, dtype, sim, part,
                  ops.compress_finish, ops.compress_pool)


def entry_cos_sin(inp: StepInputs, ratio: int, inv_freq: torch.Tensor):
    """RoPE at each token's compressed-entry position (memoised per ratio) -> cos, sin [B,S,R/2]."""
    return inp.cos_sin(f"entry/{ratio}", inv_freq, entry_ratio=ratio)


def indexer_queries(ix: Indexer, y: dict, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    inp: StepInputs, cache: LayerCache, inv_freq: torch.Tensor, ops: Ops, num: Numerics,
                    sp: SeqSplit | None = None, part: ChannelSplit | None = None):
    """Update the indexer keys (from its compressor's projections in y; part: their channel split,
    compress) -> its queries q [B,S,h*d] (its wq_b of the q latent; sp: this rank's tokens'
    [1,n,h*d]) roped (then Hadamard + FP4): [B,S,h,d]."""
    compress(ix.compressor, y["idx.comp.wkv"], y["idx.comp.wgate"], inp, cache.idx_kv_state, cache.idx_score_state,
             cache.idx_k, inv_freq, q.dtype, ops, num, part)
    if sp is not None:
        cos, sin = (sequence.mine(t[0], sp)[None] for t in (cos, sin))                     # [1,n,R/2]
    return ops.rope_q(q.unflatten(-1, (ix.n_heads, ix.head_dim)), cos, sin, fp4=num.indexer_fp4)


def indexer_select(ix: Indexer, y: dict, q: torch.Tensor, inp: StepInputs, cache: LayerCache, n: int,
                   ops: Ops, sp: SeqSplit | None = None) -> torch.Tensor:
    """Score each query q [B,S,h,d] (indexer_queries) against the first n entries of its sequence
    -> the top-k entries' flat pool rows [B*S,k] (-1 where none). sp: the indexer is replicated, so
    each rank scores its own tokens' queries (q is theirs already, q_up) and the rows are gathered."""
    w = y["idx.weights_proj"]                                         # [B,S,h]; scaled inside the op
    visible = inp.once(("visible entries", ix.ratio), lambda: ((inp.positions + 1) // ix.ratio).flatten())
    table = inp.block_table if inp.decode else inp.token_table()                              # [B*S,blocks]
    q, w = q.flatten(0, 1), w.flatten(0, 1)
    if sp is not None:
        w, visible, table = (sequence.mine(t, sp) for t in (w, visible, table))                # [n,...]
    k = max(1, min(ix.topk, n))
    rows = ops.indexer_topk(q.contiguous(), w.contiguous(), cache.idx_k.flatten(0, 1), table,
                            inp.block_tokens // ix.ratio, visible, k, max(n, 1),
                            w_scale=ix.head_dim ** -0.5 * ix.n_heads ** -0.5)[1]
    return rows if sp is None else sequence.gather(rows[None], sp)[0]                      # [B*S,k]


# ---- MoE ----
def moe(m: MoE, x: torch.Tensor, xa: torch.Tensor | None, xq, proj, ids: torch.Tensor, ops: Ops,
        num: Numerics, w2=None, sp: SeqSplit | None = None) -> torch.Tensor:
    """x [B,S,D] (xa: its FP8 rounding, or None; xq: that as codes and scales, or None), ids [B,S]
    (hash routing), w2: the shared expert's w2 group (or None) -> [B,S,D] fp32 (the reference casts
    it to x's dtype; mhc_post does): routed experts + shared expert, summed over the ranks (close;
    sp: this rank's tokens' [1,n,D])."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])                                                          # [T,D]
    xa = xa.reshape(x.shape) if xa is not None else None
    e, s, shared = m.experts, m.shared_experts, None
    packed = e.packed if ops.uses("fused_moe") else None      # the router sorts the pairs for the kernel only
    if sp is not None and proj is not None and "gate" in proj.outs:
        # split steps: the replicated router for this rank's tokens only, every token's choices gathered
        rest = [k for k in proj.outs if k != "gate"]
        y = ops.proj_gemm(x, proj, xa=xa, xq=xq, names=rest) if rest else {}              # shared w1, w3
        xo = sequence.mine(x, sp)                                                          # [n,D]
        logits = ops.proj_gemm(xo, proj, names=["gate"])["gate"]
        w, idx, _ = route(m.gate, xo, logits, sequence.mine(ids.reshape(-1), sp), None, ops)   # [n,k]
        w, idx, aligned = sequence.gather(w[None], sp)[0], sequence.gather(idx[None], sp)[0], None   # [T,k]
    else:
        y = ops.proj_gemm(x, proj, xa=xa, xq=xq) if proj is not None else {}   # shared w1, w3 and the router logits: one GEMM
        w, idx, aligned = route(m.gate, x, y.get("gate"), ids.reshape(-1), packed, ops)   # [T,k] fp32, ids
    inline = None                # small steps: the fused MoE's down kernel makes the shared expert's output
    if s is not None and packed is not None and s.w2.weight is not None and takes_shared(x.shape[0], s.w2.weight):
        inline = (y["w1"], y["w3"], s.w2.weight, s.limit, num.act_fp8 and s.w2.fp8_gemm)
    elif s is not None:          # w2 on the SwiGLU, added in the MoE sum; beside the routed experts
        with beside(ops):        # (which it does not read), so its split-K takes a workspace of its own
            if w2 is not None and x.shape[0] <= W2_GROUP_MAX_M:      # SwiGLU in w2's K loop: one launch
                shared = ops.proj_gemm(y["w1"], w2, swiglu=(y["w3"], s.limit), workspace="aux", **W2_PLAN)["w2"]
            else:                # SwiGLU, rounded for w2's FP8 input in one kernel; w2
                act = num.act_fp8 and s.w2.fp8_gemm
                shared = linear(s.w2, ops.swiglu_act(y["w1"], y["w3"], s.limit, act, x.dtype), ops, num, rounded=act)
    if e.packed is not None:     # W4A16: in reference numerics only the input gets the FP8 rounding (block's xa)
        xin = xa if num.act_fp8 and e.quantized else x
        out = up(ops.fused_moe(xin, w, idx, e.packed, e.limit, shared=shared, aligned=aligned, shared_expert=inline,
                               after=ops.aux if shared is not None else None))  # the sum waits for `shared`
    else:                        # the torch experts on the dequantised weights (CPU, small models)
        if s is not None:
            join(ops)
        out = e(x, w, idx) if shared is None else e(x, w, idx) + up(shared)
    return close(out.reshape(shape), sp)   # fp32: mhc_post casts it to the streams' dtype (no launch here)


def route(gate, x: torch.Tensor, logits: torch.Tensor | None, ids: torch.Tensor, packed, ops: Ops):
    """x [T,D], the gate's logits [T,E] fp32 (None: a router the kernel does not take), token ids
    [T], the fused MoE's experts (or None) -> routing weights [T,k] fp32, expert ids [T,k], and
    the pairs sorted for the fused MoE in the router's launch (or None: the MoE sorts them)."""
    if logits is None:
        return *gate(x, ids), None
    if gate.is_hash:
        out = ops.route(logits, gate.topk, gate.route_scale, tid2eid=gate.tid2eid, token_ids=ids,
                        renorm=gate.norm_topk, packed=packed)
    else:
        out = ops.route(logits, gate.topk, gate.route_scale, bias=gate.bias, renorm=gate.norm_topk, packed=packed)
    return out if packed is not None else (*out, None)
