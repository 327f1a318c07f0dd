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
        if self.overlap:
            d = self.head_dim
            a_kv, a_sc = kv[..., :d], score[..., :d]
            if prev is None:
                prev = (torch.zeros_like(a_kv[:, :1]), torch.full_like(a_sc[:, :1], float("-inf")))
            else:
                prev = (prev[0][:, None], prev[1][:, None])
            a_kv = torch.cat((prev[0], a_kv[:, :-1]), dim=1)
            a_sc = torch.cat((prev[1], a_sc[:, :-1]), dim=1)
            kv = torch.cat((a_kv, kv[..., d:]), dim=2)       # [B,n,2*ratio,d]
            score = torch.cat((a_sc, score[..., d:]), dim=2)
        return (kv * score.softmax(dim=2)).sum(dim=2)

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
    def prefill(self, kv, score, inp, rows, kv_state, score_state, store, inv_freq, dtype, sim):
        """A prefill step's projections kv, score [1,T,coff*d] fp32 (the wkv / wgate GEMMs, no ape;
        StepInputs' flat layout): each of `rows`' chunk (host row ids) has its completed windows
        become entries in the flat store [rows, d] at once; the open window stays in the state.
        Torch, a Python loop over rows (not tokens): one-token rows go through the decode op
        instead (engine.model.step.compress); one varlen pooling over every chunk is still to do."""
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
