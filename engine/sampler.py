"""Batched token sampler: penalties, greedy, temperature, top-k, top-p, min-p.

All math runs on the logits' device with no per-request Python loop and no
device->host sync; the caller does the one `.tolist()` it needs.

Logprob semantics (vLLM V1 default, "raw logprobs"): reported logprobs are the
log-softmax of the raw model logits, before penalties, min_tokens masking,
temperature and any truncation. That is the model's own distribution, what
OpenAI-style clients expect. `Sampler(logprobs_mode="processed")` instead
reports log-softmax of the penalised/masked logits, still before temperature.

Randomness: each row draws Exp(1) noise q and picks argmax(probs / q), which is
an exact sample from probs (exponential race). Seeded rows get q from a
counter-based hash of (seed, step, token id) computed on device, so a seeded
request samples the same tokens whatever its row and its batch neighbours.
Unseeded rows draw q from one global torch.Generator.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from itertools import chain
from typing import Sequence

import numpy as np
import torch

# Temperatures below this are treated as greedy (as vLLM does): dividing by
# them only overflows towards a one-hot distribution anyway.
GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
_MASK32 = 0xFFFFFFFF


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to the context limit
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to return
    prompt_logprobs: int | None = None  # per prompt token: its logprob and this many top alternatives
    skip_special_tokens: bool = True

    def __post_init__(self):
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self):
        # `not (x >= a)` style comparisons also reject NaN.
        def bad(name, why):
            raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        if not (self.n >= 1):
            bad("n", "must be >= 1")
        if not (self.temperature >= 0):
            bad("temperature", "must be >= 0")
        if not (0 < self.top_p <= 1):
            bad("top_p", "must be in (0, 1]")
        if not (self.top_k >= -1):
            bad("top_k", "must be -1 (off), 0 (off) or >= 1")
        if not (0 <= self.min_p <= 1):
            bad("min_p", "must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (-2 <= getattr(self, name) <= 2):
                bad(name, "must be in [-2, 2]")
        if not (self.repetition_penalty > 0):
            bad("repetition_penalty", "must be > 0")
        if self.max_tokens is not None and not (self.max_tokens >= 0):
            bad("max_tokens", "must be >= 0 (0: the prompt is only prefilled, e.g. for prompt_logprobs)")
        if not (self.min_tokens >= 0):
            bad("min_tokens", "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and not (0 <= getattr(self, name) <= MAX_LOGPROBS):
                bad(name, f"must be in [0, {MAX_LOGPROBS}]")
        if self.seed is not None and not (isinstance(self.seed, int) and -(1 << 63) <= self.seed < 1 << 63):
            bad("seed", "must be an int64 or None")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must hold non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must hold non-negative ints")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def argmax_only(self, step: int) -> bool:
        """Whether this row's token, `step` tokens into its output, is the plain argmax of the
        raw logits and nothing else is asked of the sampler: greedy, no penalty, no min_tokens
        ban, no logprobs (top-k/p, min-p and seeds change nothing for a greedy row)."""
        return (self.temperature < GREEDY_EPS and self.logprobs is None and step >= self.min_tokens
                and not self.presence_penalty and not self.frequency_penalty and self.repetition_penalty == 1.0)

    def for_child(self, index: int) -> "SamplingParams":
        """Params for the index-th of n parallel samples: n=1, and a distinct
        seed so seeded children do not all produce the same text."""
        # wrapped into int64 (the sampler hashes the seed's 64 bits, so this is the same stream)
        seed = None if self.seed is None else (self.seed + index + (1 << 63)) % (1 << 64) - (1 << 63)
        return dataclasses.replace(self, n=1, seed=seed)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] f32, of the chosen token
    top_logprob_ids: torch.Tensor | None = None  # [B, K] int64, best first
    top_logprobs: torch.Tensor | None = None  # [B, K] f32, descending


@dataclass
class SamplingBatch:
    """Per-step device tensors for a batch. Optional tensors are None when no
    row uses the feature, so the sampler skips that work entirely."""

    temperature: torch.Tensor  # [B] f32, 1.0 on greedy rows (never divides by 0)
    greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    any_greedy: bool
    top_k: torch.Tensor | None  # [B] int64, vocab_size where off
    max_top_k: int
    top_p: torch.Tensor | None  # [B] f32
    min_p: torch.Tensor | None  # [B] f32
    presence: torch.Tensor | None  # [B] f32
    frequency: torch.Tensor | None  # [B] f32
    repetition: torch.Tensor | None  # [B] f32
    output_counts: torch.Tensor | None  # [B, V] int32
    seen_mask: torch.Tensor | None  # [B, V] bool, token in prompt or output
    seeded_rows: torch.Tensor | None  # [S] int64
    seed_lo: torch.Tensor | None  # [S] int64, low 32 bits of the seed
    seed_hi: torch.Tensor | None  # [S] int64, high 32 bits
    seed_step: torch.Tensor | None  # [S] int64, tokens generated so far
    any_unseeded: bool
    ban_rows: torch.Tensor | None  # [M] int64, (row, token) pairs held at -inf
    ban_tokens: torch.Tensor | None  # [M] int64
    max_num_logprobs: int | None  # None: no row wants logprobs
    vocab_size: int

    @classmethod
    def build(
        cls,
        params_list: Sequence[SamplingParams],
        output_token_ids_list: Sequence[Sequence[int]],
        prompt_token_ids_list: Sequence[Sequence[int]] | None = None,
        *,
        vocab_size: int,
        device: torch.device | str,
        steps: Sequence[int] | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> "SamplingBatch":
        """steps[i]: tokens request i has generated (the seed counter and the
        min_tokens count); defaults to len(output_token_ids_list[i])."""
        B, V = len(params_list), vocab_size
        if steps is None:
            steps = [len(o) for o in output_token_ids_list]

        pack = _Pack()
        vec = pack.add   # every per-row vector goes to the device in one copy (each its own costs host time)

        P = params_list
        greedy = [p.greedy for p in P]
        temperature = [1.0 if g else p.temperature for p, g in zip(P, greedy)]

        top_k = [p.top_k if 0 < p.top_k < V else V for p in P]
        k_on = [k for k in top_k if k < V]
        top_p = [p.top_p for p in P]
        min_p = [p.min_p for p in P]
        pres = [p.presence_penalty for p in P]
        freq = [p.frequency_penalty for p in P]
        rep = [p.repetition_penalty for p in P]
        need_counts = any(pres) or any(freq)
        need_seen = any(r != 1.0 for r in rep)

        counts = seen = None
        if need_counts or need_seen:
            counts = _token_counts(output_token_ids_list, V, device)
        if need_seen:
            prompts = prompt_token_ids_list or [[] for _ in range(B)]
            seen = (_token_counts(prompts, V, device) > 0) | (counts > 0)

        seeded = [i for i, p in enumerate(P) if p.seed is not None]
        seeds = [P[i].seed & ((1 << 64) - 1) for i in seeded]

        ban_rows, ban_tokens = [], []
        for i, (p, s) in enumerate(zip(P, steps)):
            if s < p.min_tokens:
                stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
                ban_tokens += sorted(stops)
                ban_rows += [i] * len(stops)

        wants = [p.logprobs for p in P if p.logprobs is not None]
        return cls(**pack.send(device, dict(
            temperature=vec(temperature, torch.float32),
            greedy=vec(greedy, torch.bool),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            top_k=vec(top_k, torch.int64) if k_on else None,
            max_top_k=max(k_on, default=0),
            top_p=vec(top_p, torch.float32) if any(p < 1.0 for p in top_p) else None,
            min_p=vec(min_p, torch.float32) if any(min_p) else None,
            presence=vec(pres, torch.float32) if need_counts else None,
            frequency=vec(freq, torch.float32) if need_counts else None,
            repetition=vec(rep, torch.float32) if need_seen else None,
            output_counts=counts if need_counts else None,
            seen_mask=seen,
            seeded_rows=vec(seeded, torch.int64) if seeded else None,
            seed_lo=vec([s & _MASK32 for s in seeds], torch.int64) if seeded else None,
            seed_hi=vec([s >> 32 for s in seeds], torch.int64) if seeded else None,
            seed_step=vec([steps[i] & _MASK32 for i in seeded], torch.int64) if seeded else None,
            any_unseeded=len(seeded) < B,
            ban_rows=vec(ban_rows, torch.int64) if ban_rows else None,
            ban_tokens=vec(ban_tokens, torch.int64) if ban_rows else None,
            max_num_logprobs=max(wants) if wants else None,
            vocab_size=V,
        )))


    def count_tokens(self, rows: torch.Tensor, tokens: torch.Tensor):
        """Count one more generated token per row (rows [k], tokens [k] long, on the device), as
        if the host had it in its output ids: async scheduling's pending tokens, whose values
        the host has not read yet when this batch is built."""
        flat = rows * self.vocab_size + tokens           # scatter on the flat view: a plain kernel, no sync
        if self.output_counts is not None:
            self.output_counts.view(-1).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        if self.seen_mask is not None:
            self.seen_mask.view(-1).scatter_(0, flat, True)


_NUMPY = {torch.float32: np.float32, torch.int64: np.int64, torch.bool: np.bool_}


class _Slot(int):
    """A vector's place in a _Pack, standing in for its device tensor until the pack is sent."""


class _Pack:
    """Per-row host vectors (any dtypes) sent to the device in one host-to-device copy: packed,
    each 8-byte aligned, into one byte buffer, then viewed back as their dtypes on the device."""

    def __init__(self):
        self.parts: list[tuple[int, np.ndarray, torch.dtype]] = []
        self.size = 0

    def add(self, values, dtype: torch.dtype) -> _Slot:
        a = np.asarray(values, dtype=_NUMPY[dtype])
        self.parts.append((self.size, a, dtype))
        self.size += -(-a.nbytes // 8) * 8
        return _Slot(len(self.parts) - 1)

    def send(self, device, fields: dict) -> dict:
        """fields with each _Slot replaced by its device tensor."""
        if not self.parts:
            return fields
        buf = np.zeros(self.size, dtype=np.uint8)
        for off, a, _ in self.parts:
            buf[off:off + a.nbytes] = a.view(np.uint8)
        # non_blocking: pageable memory is staged at once, and nothing waits for the device
        dev = torch.from_numpy(buf).to(device, non_blocking=True)
        got = [dev[off:off + a.nbytes].view(dtype) for off, a, dtype in self.parts]
        return {k: got[v] if isinstance(v, _Slot) else v for k, v in fields.items()}


def _token_counts(token_lists, V: int, device) -> torch.Tensor:
    """[B, V] int32 occurrence counts, built from one flat host->device copy."""
    B = len(token_lists)
    counts = torch.zeros(B, V, dtype=torch.int32, device=device)
    lens = [len(t) for t in token_lists]
    if sum(lens) == 0:
        return counts
    toks = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(B), torch.tensor(lens))
    ones = torch.ones(toks.numel(), dtype=torch.int32, device=device)
    counts.view(-1).scatter_add_(0, (rows * V + toks).to(device, non_blocking=True), ones)   # no sync
    return counts


# ---------------------------------------------------------------- logit processing


def apply_penalties(
    logits: torch.Tensor,  # [B, V] f32
    output_counts: torch.Tensor | None,  # [B, V] int
    seen_mask: torch.Tensor | None,  # [B, V] bool
    presence: torch.Tensor | None,  # [B]
    frequency: torch.Tensor | None,  # [B]
    repetition: torch.Tensor | None,  # [B]
) -> torch.Tensor:
    """vLLM semantics, out of place. Repetition (prompt + output tokens):
    positive logits / r, non-positive * r; then over output tokens only:
    logit -= frequency * count + presence * (count > 0)."""
    if repetition is not None and seen_mask is not None:
        r = torch.where(seen_mask, repetition[:, None], 1.0)  # [B, V]
        logits = torch.where(logits > 0, logits / r, logits * r)
    if output_counts is not None:
        c = output_counts.to(logits.dtype)
        if frequency is not None:
            logits = logits - frequency[:, None] * c
        if presence is not None:
            logits = logits - presence[:, None] * (c > 0).to(logits.dtype)
    return logits


def apply_top_k_top_p(
    logits: torch.Tensor,  # [B, V]
    top_k: torch.Tensor | None,  # [B] int64, V = off
    top_p: torch.Tensor | None,  # [B] f32, 1.0 = off
    max_top_k: int = 0,
) -> torch.Tensor:
    """Masks dropped tokens to -inf. Ties at the k-th value are all kept."""
    if top_k is None and top_p is None:
        return logits
    V = logits.shape[-1]
    if top_p is None:
        # top-k alone: topk(max k) is much cheaper than a full vocab sort.
        vals = logits.topk(max_top_k, dim=-1).values  # [B, max_k]
        kth = vals.gather(1, (top_k.clamp(max=max_top_k) - 1)[:, None])  # [B, 1]
        kth = torch.where(top_k[:, None] < V, kth, float("-inf"))
        return logits.masked_fill(logits < kth, float("-inf"))

    srt, idx = logits.sort(dim=-1)  # ascending [B, V]
    if top_k is not None:
        # Row off (k = V) -> index 0, the smallest value: masks nothing.
        kth = srt.gather(1, (V - top_k)[:, None])
        srt = srt.masked_fill(srt < kth, float("-inf"))
    cum = srt.softmax(dim=-1).cumsum(dim=-1)
    # Drop the low tail whose mass is <= 1 - p; the top token always stays.
    drop = cum <= (1 - top_p[:, None])
    drop[:, -1] = False
    srt = srt.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, idx, srt)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    """Drop tokens with prob < min_p * max prob. Done in log space:
    logit < max_logit + log(min_p); min_p = 0 gives -inf, masking nothing."""
    if min_p is None:
        return logits
    thresh = logits.amax(dim=-1, keepdim=True) + min_p[:, None].log()  # [B, 1]
    return logits.masked_fill(logits < thresh, float("-inf"))


# ---------------------------------------------------------------- counter-based RNG


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32), split into 16-bit halves of c so
    no int64 product overflows (signed overflow is not defined behaviour)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3 finaliser: a bijection on 32-bit values with full avalanche."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def hash_exponential(
    seed_lo: torch.Tensor,  # [S] int64 in [0, 2**32)
    seed_hi: torch.Tensor,  # [S]
    step: torch.Tensor,  # [S]
    vocab_size: int,
) -> torch.Tensor:
    """[S, V] Exp(1) noise that is a pure function of (seed, step, token id)."""
    k1 = _mix32(seed_lo ^ _mix32(step ^ _mix32(seed_hi ^ 0x9E3779B9)))  # [S]
    k2 = _mix32(k1 ^ 0x7F4A7C15)
    tok = torch.arange(vocab_size, device=seed_lo.device, dtype=torch.int64)
    # Two keyed rounds, so rows whose keys differ in few bits still decorrelate.
    h = _mix32(_mix32(tok[None, :] ^ k1[:, None]) ^ k2[:, None])  # [S, V]
    # 23 bits + 0.5 is exact in fp32 and lies strictly inside (0, 1): q > 0.
    u = ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))
    return -u.log()


# ---------------------------------------------------------------- sampler


class Sampler(torch.nn.Module):
    def __init__(self, logprobs_mode: str = "raw", generator: torch.Generator | None = None):
        super().__init__()
        if logprobs_mode not in ("raw", "processed"):
            raise ValueError(f"logprobs_mode must be 'raw' or 'processed', got {logprobs_mode!r}")
        self.logprobs_mode = logprobs_mode
        self.generator = generator  # for unseeded rows; None = torch's default

    def process_logits(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """min_tokens bans then penalties; never modifies `logits` in place."""
        x = logits
        if batch.ban_rows is not None:
            # new_full is a device fill; torch.tensor(..., device=) would be a sync copy.
            x = x.index_put((batch.ban_rows, batch.ban_tokens), x.new_full((), float("-inf")))
        return apply_penalties(
            x, batch.output_counts, batch.seen_mask, batch.presence, batch.frequency, batch.repetition
        )

    def _exponential(self, like: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.any_unseeded:
            q = torch.empty_like(like).exponential_(generator=self.generator)
            # Guard against a 0 draw: probs / 0 would yield inf or NaN winners.
            q.clamp_(min=torch.finfo(q.dtype).tiny)
        else:
            q = torch.empty_like(like)
        if batch.seeded_rows is not None:
            q[batch.seeded_rows] = hash_exponential(
                batch.seed_lo, batch.seed_hi, batch.seed_step, batch.vocab_size
            )
        return q

    def sample(self, x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """x: processed logits [B, V] -> token ids [B] int64."""
        if batch.all_greedy:
            return x.argmax(dim=-1)
        t = x / batch.temperature[:, None]
        t = apply_top_k_top_p(t, batch.top_k, batch.top_p, batch.max_top_k)
        t = apply_min_p(t, batch.min_p)
        probs = t.softmax(dim=-1)
        # Exponential race: argmax(p_i / q_i) with q_i ~ Exp(1) is distributed
        # exactly as p, and needs no cumsum/search (nor a multinomial sync).
        tokens = (probs / self._exponential(probs, batch)).argmax(dim=-1)
        if batch.any_greedy:
            tokens = torch.where(batch.greedy, x.argmax(dim=-1), tokens)
        return tokens

    def forward(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        raw = logits.float()  # [B, V]
        x = self.process_logits(raw, batch)
        tokens = self.sample(x, batch)
        out = SamplerOutput(token_ids=tokens)
        if batch.max_num_logprobs is None:
            return out
        lp = (raw if self.logprobs_mode == "raw" else x).log_softmax(dim=-1)  # [B, V]
        out.logprobs = lp.gather(1, tokens[:, None]).squeeze(1)
        if batch.max_num_logprobs > 0:
            # Rows that asked for fewer than K take a prefix (already sorted).
            vals, ids = lp.topk(batch.max_num_logprobs, dim=-1)
            out.top_logprobs, out.top_logprob_ids = vals, ids
        return out

