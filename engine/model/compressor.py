"""KV compressor: every `ratio` tokens become one entry by a per-channel softmax pool.

ratio 4 (CSA) overlaps: entry w pools the A half (channels [:d]) of window w-1's tokens
with the B half ([d:]) of window w's tokens, 2*ratio slots in all. Any other ratio (HCA)
pools its own window only. Entry w is roped at position w*ratio, and becomes visible
once token (w+1)*ratio - 1 has been seen.
"""
import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .kv_cache import entry_loc
from .linear import Linear
from .norm import RMSNorm
from .rope import apply_rope, cos_sin
from ..kernels.compressor import SIM_CODE, compress_finish_ref, compress_pool_ref
from ..numerics import PLAIN, fp4_sim_ref as fp4_sim, fp8_sim_ref as fp8_sim, hadamard, up


class Compressor(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, head_dim: int, rotate: bool, dtype=None):
        super().__init__()
        self.ratio = cfg.ratio(layer)
        self.head_dim = head_dim
        self.overlap = self.ratio == 4
        self.rotate = rotate          # indexer keys: Hadamard + FP4 in reference numerics
        self.rope_dim = cfg.rope_dim
        coff = 2 if self.overlap else 1
        self.wkv = Linear(cfg.dim, coff * head_dim, dtype=dtype)
        self.wgate = Linear(cfg.dim, coff * head_dim, dtype=dtype)
        self.ape = nn.Parameter(torch.empty(self.ratio, coff * head_dim, dtype=torch.float32), requires_grad=False)
        self.norm = RMSNorm(head_dim, cfg.norm_eps)
        self.numerics = PLAIN

    def sim_of(self, numerics) -> str | None:
        """The rounding of this compressor's entries: "fp4" (Hadamard + FP4: indexer keys),
        "fp8" (the KV's nope dims) or None."""
        if self.rotate:
            return "fp4" if numerics.indexer_fp4 else None
        return "fp8" if numerics.kv_fp8 else None

    def project(self, x: torch.Tensor, positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., D], positions [...] -> kv, score [..., coff*d] fp32 (score has its slot's ape;
        positions None: without it)."""
        xf = up(x)
        kv, score = F.linear(xf, up(self.wkv.weight)), F.linear(xf, up(self.wgate.weight))
        return kv, score if positions is None else score + self.ape[positions % self.ratio]

    def pool(self, kv: torch.Tensor, score: torch.Tensor, prev: tuple | None = None) -> torch.Tensor:
        """Complete windows kv, score [B,n,ratio,coff*d] -> entries [B,n,d] fp32.

        prev: the (kv, score) A halves [B,ratio,d] of the window before the first one, if any.
        """
        if not self.overlap:
            return self._softpool(kv, score)
        d = self.head_dim
        a_kv, a_sc = kv[..., :d], score[..., :d]
        if prev is None:
            prev = (torch.zeros_like(a_kv[:, :1]), torch.full_like(a_sc[:, :1], float("-inf")))
        else:
            prev = (prev[0][:, None], prev[1][:, None])
        a_kv = torch.cat((prev[0], a_kv[:, :-1]), dim=1)    # each window pools the one before's A half
        a_sc = torch.cat((prev[1], a_sc[:, :-1]), dim=1)
        return self._softpool(kv, score, (a_kv, a_sc))

    def _softpool(self, kv, score, a=None):
        """Windows kv, score [..., ratio, coff*d] -> [..., d]; a: (kv, score) [..., ratio, d], the A
        halves each window pools beside its own B half (overlap)."""
        if a is not None:
            d = a[0].shape[-1]                                # head_dim, or a channel split's share
            kv = torch.cat((a[0], kv[..., d:]), dim=-2)       # [..., 2*ratio, d]
            score = torch.cat((a[1], score[..., d:]), dim=-2)
        return (kv * score.softmax(dim=-2)).sum(dim=-2)

    def finish(self, c: torch.Tensor, entry: torch.Tensor, inv_freq: torch.Tensor, dtype, sim: str | None) -> torch.Tensor:
        """Pooled entries [B,n,d] at entry indices [n] or [B,n] -> normed, roped cache entries,
        rounded as `sim` says (sim_of)."""
        c = self.norm(c.to(dtype))
        cos, sin = cos_sin(entry * self.ratio, inv_freq)
        c = apply_rope(c, cos, sin)
        if sim == "fp4":
            c = fp4_sim(hadamard(c), 32)
        elif sim == "fp8":
            nope = self.head_dim - self.rope_dim
            c = torch.cat((fp8_sim(c[..., :nope], 64), c[..., nope:]), dim=-1)
        return c

    def forward(self, x: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        """Whole sequence from position 0: x [B,S,D] -> entries [B, S//ratio, d]."""
        B, S, _ = x.shape
        n = S // self.ratio
        if n == 0:
            return x.new_zeros(B, 0, self.head_dim)
        pos = torch.arange(n * self.ratio, device=x.device)
        kv, score = self.project(x[:, : n * self.ratio], pos)
        c = self.pool(kv.unflatten(1, (n, self.ratio)), score.unflatten(1, (n, self.ratio)))
        return self.finish(c, torch.arange(n, device=x.device), inv_freq, x.dtype, self.sim_of(self.numerics))

    # ---- with the engine's cache: running state per sequence slot, entries in the block pool ----
    # (decode: engine.kernels.compressor.compress_decode, called by engine.model.step.compress)
    def prefill(self, kv, score, inp, rows, kv_state, score_state, store, inv_freq, dtype, sim, part=None,
                finish=compress_finish_ref, pool=compress_pool_ref):
        """A prefill step's projections kv, score [1,T,coff*d] fp32 (the wkv / wgate GEMMs, no ape;
        StepInputs' flat layout): each of `rows`' chunk (host row ids) has its completed windows
        become entries in the flat store [rows, d] at once; the open window stays in the state.
        Varlen: a fixed number of torch ops whatever the rows (index tables from prefill_plan, once
        per step and ratio); one-token rows go through the decode op instead
        (engine.model.step.compress). prefill_ref is the same a row at a time. part: a
        parallel.sequence.ChannelSplit when kv, score hold only this rank's channels of them
        (part.channels()): the pool is per channel, so it runs on those, and one all-gather
        (part.gather) makes the pooled entries and the state's new rows whole for the finish,
        which needs every channel (norm, RoPE, rounding). finish: the op that finishes the step's
        pooled entries into the store, all at once (kernels/compressor.py: compress_finish or its
        reference, the finish method's math; the store holds the model's dtype); pool: the op that
        pools the windows and gathers the rows the state keeps (compress_pool or its reference)."""
        r, C = self.ratio, kv_state.shape[-1]
        p = prefill_plan(inp, rows, r, r if self.overlap else 0)
        ch = None if part is None else part.channels(kv.device)                 # [C'] of the C columns
        ks, ss = kv_state.view(-1, C), score_state.view(-1, C)          # [slots*coff*r, C] views
        # the pooled entries, each row's last window (ratio 4), the open tokens: this rank's channels
        made = pool(kv[0], score[0], self.ape, ks, ss, p, r, self.overlap, ch)
        E = p["E"]
        if part is not None:
            made = part.gather(made)                                    # every channel: [..., C]
        if E:
            # the entries' RoPE once per step and ratio: the compressors of one ratio share it
            assert store.dtype == dtype, (store.dtype, dtype)
            cos, sin = inp.once(("compress rope", r, tuple(rows)), lambda: cos_sin(p["entry"] * r, inv_freq))
            finish(made[0], p["loc"], store, self.norm.weight, cos, sin, self.norm.eps, SIM_CODE[sim])   # [E,d]
            if self.overlap:
                kv_state[p["emit_slot"], :r], score_state[p["emit_slot"], :r] = made[1], made[2]
        ks[p["rest_idx"]], ss[p["rest_idx"]] = made[-2], made[-1]

    def prefill_ref(self, kv, score, inp, rows, kv_state, score_state, store, inv_freq, dtype, sim):
        """prefill a row at a time (the reference tests/test_varlen_compress.py holds it to)."""
        for b in rows:
            o, n = inp.offsets[b], inp.row_lens[b]
            self._prefill_row(kv[0, o:o + n], score[0, o:o + n], b, inp.starts[b], inp, kv_state, score_state,
                              store, inv_freq, dtype, sim)

    def _prefill_row(self, kv, score, b, start, inp, kv_state, score_state, store, inv_freq, dtype, sim):
        """Row b's chunk kv, score [S,coff*d] at positions start.."""
        r, d, slot = self.ratio, self.head_dim, inp.slots[b]
        S = kv.shape[0]
        end = start + S
        score = score + self.ape[torch.arange(start, end, device=kv.device) % r]
        off = r if self.overlap else 0
        w0 = start // r
        n_old = start - w0 * r                        # the open window's tokens already in the state
        kv = torch.cat((kv_state[slot, off:off + n_old], kv))        # positions w0*r .. end-1
        score = torch.cat((score_state[slot, off:off + n_old], score))
        n_emit = end // r - w0
        if n_emit > 0:
            kvw = kv[: n_emit * r].unflatten(0, (n_emit, r))[None]
            scw = score[: n_emit * r].unflatten(0, (n_emit, r))[None]
            prev = (kv_state[slot, None, :r, :d], score_state[slot, None, :r, :d]) if self.overlap else None
            entries = torch.arange(w0, w0 + n_emit, device=kv.device)
            c = self.finish(self.pool(kvw, scw, prev), entries, inv_freq, dtype, sim)[0]
            store[entry_loc(inp.block_table[b:b + 1], inp.block_tokens, entries[None], r)[0]] = c.to(store.dtype)
            if self.overlap:
                kv_state[slot, :r], score_state[slot, :r] = kvw[0, -1], scw[0, -1]
        rest = S + n_old - n_emit * r
        kv_state[slot, off:off + rest] = kv[n_emit * r:]
        score_state[slot, off:off + rest] = score[n_emit * r:]


# ---- the varlen prefill's index tables: built on the host once per step and ratio (shared by the
# step's compressors of that ratio), one host-to-device copy ----
def _ranges(counts: torch.Tensor, begins: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Host counts, begins [m] -> (owner, i) [sum(counts)]: element j of owner k has i = begins[k] + j."""
    owner = torch.repeat_interleave(torch.arange(len(counts)), counts)
    first = counts.cumsum(0) - counts
    return owner, torch.arange(len(owner)) - first[owner] + begins[owner]


def _host_plan(inp, rows: list[int], r: int, off: int) -> dict:
    """Row b's chunk (starts[b], row_lens[b] tokens) seen from its open window's start w0*r: the
    X = n_old + n tokens ("ext"), the first n_emit*r of them complete windows, the rest stay open.
    Ext is ordered all rows' window tokens first (E windows of r), then all rows' open tokens."""
    L = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    rid = L(rows)
    s, n, o = L(inp.starts)[rid], L(inp.row_lens)[rid], L(inp.offsets)[rid]
    w0 = s // r
    n_old = s - w0 * r                                  # tokens of the open window already in the state
    n_emit = (s + n) // r - w0                          # windows this chunk completes
    W = n_emit * r
    own_w, i_w = _ranges(W, torch.zeros_like(W))
    own_r, i_r = _ranges(n_old + n - W, W)
    own, i = torch.cat((own_w, own_r)), torch.cat((i_w, i_r))
    old = i < n_old[own]
    st_pos, tk_pos = old.nonzero()[:, 0], (~old).nonzero()[:, 0]
    win_own, k = _ranges(n_emit, torch.zeros_like(n_emit))
    emit = (n_emit > 0).nonzero()[:, 0]
    ends = n_emit.cumsum(0)
    t = dict(st_pos=st_pos, st_row=rid[own[st_pos]], st_local=off + i[st_pos],
             tk_pos=tk_pos, tk_tok=(o[own] + i - n_old[own])[tk_pos], tk_ape=i[tk_pos] % r,  # pos % r = i % r
             win_row=rid[win_own], entry=w0[win_own] + k,
             emit_row=rid[emit], first_win=(ends - n_emit)[emit], last_win=(ends - 1)[emit],
             rest_row=rid[own_r], rest_local=off + i_r - W[own_r])
    # compress_pool's gathers: each extended row's source (a token, or -1: a state row), its ape
    # slot, its row; each window's first-or-not; the rows the state keeps, in made's order
    ext_tok = torch.full((len(own),), -1, dtype=torch.long)
    ext_tok[tk_pos] = t["tk_tok"]
    last = (t["last_win"][:, None] * r + torch.arange(r)).flatten() if off else torch.zeros(0, dtype=torch.long)
    E = int(n_emit.sum())
    t.update(ext_tok=ext_tok, ext_ape=i % r, ext_row=rid[own], ext_local=off + i, win_first=(k == 0).long(),
             out_x=torch.cat((last, E * r + torch.arange(len(own) - E * r))))
    return dict(t, X=len(own), E=E, n_last=len(last))


def prefill_plan(inp, rows: list[int], r: int, off: int) -> dict:
    """_host_plan's tables on the device (one copy), with slots and block tables applied: flat state
    rows (slot * coff*r + row) and store rows (entry_loc)."""
    def make():
        h = _host_plan(inp, rows, r, off)
        names = [k for k, v in h.items() if torch.is_tensor(v)]
        flat = torch.cat([h[k] for k in names]).to(inp.ids.device)
        p = dict(zip(names, flat.split([len(h[k]) for k in names])), X=h["X"], E=h["E"], n_last=h["n_last"])
        S, slots = off + r, inp.slots                        # state rows per slot
        p["st_idx"] = slots[p["st_row"]] * S + p["st_local"]
        p["rest_idx"] = slots[p["rest_row"]] * S + p["rest_local"]
        p["emit_slot"] = slots[p["emit_row"]]
        p["src"] = torch.where(p["ext_tok"] >= 0, p["ext_tok"], -(slots[p["ext_row"]] * S + p["ext_local"]) - 1)
        p["a_state"] = torch.where(p["win_first"] > 0, slots[p["win_row"]] * S, -1)
        p["loc"] = entry_loc(inp.block_table[p["win_row"]], inp.block_tokens, p["entry"][:, None], r)[:, 0]
        return p
    return inp.once(("compress plan", r, tuple(rows)), make)
