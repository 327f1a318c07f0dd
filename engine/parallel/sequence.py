"""Sequence parallelism for prefill-sized steps: each rank keeps the streams of 1/tp of the tokens.

Under tensor parallelism every rank holds the whole residual state of every token, so mHC around
each sub-layer (mhc_pre and mhc_post read and write hc = 4 streams of D per token) and whatever
else is replicated runs tp times over. In a step of SP_MIN_T tokens or more, rank r keeps only
the streams of its own n = ceil(T / tp) tokens (r*n.., the last rank's tail zero rows): the
embedding and each sub-layer close with a reduce-scatter where the all-reduce was, and each
sub-layer opens with an all-gather of its normed input x (one stream, in the model's dtype). An
all-reduce is a reduce-scatter followed by an all-gather of the same bytes, so the collectives
cost no more; the MoE's close is cheaper, its fp32 sums scattered and x gathered in bf16. This is
Megatron-LM's sequence parallelism (Korthikanti et al., "Reducing Activation Recomputation in
Large Transformer Models", 2022), applied to the mHC streams. The head's rows come back by one
all-reduce of the rows each rank owns (zeros elsewhere: the sum is exact). What every rank
would compute alike (the replicated lightning indexer's scores and top-k, the MoE router's logits
and choices) each rank does for its own tokens, and the results are gathered. The compressors'
projections (fp32 outputs, ~5 TFLOP at 8k over the 43 layers) split by channel instead
(ChannelSplit): their pool is per channel, so each rank projects every token onto its 1/tp of the
channels, pools them, and one all-gather makes the entries (and the state's open windows) whole
for the finish, which needs every channel (CHANNEL_SPLIT; exact on the GPU on steps of
SP_MIN_T tokens on, where the unsplit step runs the same per-projection GEMMs: tests/test_gpu_prefill.py).

Decode steps never split (their collectives cost their latency, not their bytes). Exact: every
token's arithmetic is the one it has without the split, on whichever rank keeps it.
"""
import functools
import math
from dataclasses import dataclass

import torch

from .comm import all_gather, all_gather_last, all_reduce, reduce_scatter
from .state import tp_rank, tp_size

SP_MIN_T = 1024     # a step's tokens from which its streams split over the ranks (bench/levers.py: seq_parallel)
CHANNEL_SPLIT = True    # split steps: the compressors' projections by channel (False: all of them on every rank);
                        # exact on the GPU at the sizes that split (tests/test_gpu_prefill.py, bench/RESULTS.md)
SHARED = ("SP_MIN_T", "CHANNEL_SPLIT")    # what every rank must agree on to split a step alike


def settings() -> dict:
    """This process's split settings, for spawned ranks to apply(): a caller (a test, a bench
    lever) may have changed them after import."""
    return {name: globals()[name] for name in SHARED}


def apply(shared: dict):
    """Take rank 0's settings() in a spawned rank."""
    globals().update({name: shared[name] for name in SHARED})


@dataclass(frozen=True)
class SeqSplit:
    """One step's tokens T over `size` ranks: this rank keeps tokens lo .. lo + n - 1 (those < T)."""
    T: int
    size: int
    rank: int

    @property
    def n(self) -> int:
        return math.ceil(self.T / self.size)

    @property
    def lo(self) -> int:
        return self.rank * self.n


def split(T: int) -> SeqSplit | None:
    """The split of a T-token prefill step, or None (one rank, or a step under SP_MIN_T)."""
    if tp_size() == 1 or T < SP_MIN_T:
        return None
    return SeqSplit(T, tp_size(), tp_rank())


def scatter(x: torch.Tensor, sp: SeqSplit) -> torch.Tensor:
    """x [1,T,...], this rank's partial sums of every token -> [1,n,...]: the sums of its own tokens."""
    x = x[0]
    pad = sp.n * sp.size - sp.T
    if pad:
        x = torch.cat((x, x.new_zeros((pad, *x.shape[1:]))))
    return reduce_scatter(x)[None]


def gather(x: torch.Tensor, sp: SeqSplit) -> torch.Tensor:
    """x [1,n,...] of this rank's tokens -> [1,T,...] of every token."""
    return all_gather(x[0])[:sp.T][None]


def mine(x: torch.Tensor, sp: SeqSplit) -> torch.Tensor:
    """x [T,...] of every token -> this rank's rows [n,...] (the last rank's past T repeat row
    T - 1: gather drops what is made of them). For the replicated work only one rank need do."""
    if sp.lo + sp.n <= sp.T:
        return x[sp.lo:sp.lo + sp.n]
    return x[torch.arange(sp.lo, sp.lo + sp.n, device=x.device).clamp_(max=sp.T - 1)]


def rows(x: torch.Tensor, sp: SeqSplit, tokens: list[int]) -> torch.Tensor:
    """x [n,...] of this rank's tokens -> x of the step's `tokens` [L,...] on every rank: each rank
    writes the rows it keeps into zeros, one all-reduce sums them (exact: one term per row)."""
    out = x.new_zeros((len(tokens), *x.shape[1:]))
    mine = [(i, t - sp.lo) for i, t in enumerate(tokens) if sp.lo <= t < sp.lo + sp.n]
    if mine:
        i, t = (torch.tensor(v, device=x.device) for v in zip(*mine))
        out[i] = x[t]
    return all_reduce(out)


@dataclass(frozen=True)
class ChannelSplit:
    """A compressor's channels d over `size` ranks in a split step: this rank makes its projections'
    columns `channels` (of coff*d: coff = 2 halves A and B at ratio 4, each d wide, else 1)."""
    d: int
    coff: int
    size: int
    rank: int

    def channels(self, device=None) -> torch.Tensor:
        """-> [coff*d/size] columns of the projections: this rank's channels of each half, A's first
        (made once per split and device: every layer's compressors of a step ask for them)."""
        return _channels(self, torch.device(device or "cpu"))

    def gather(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Tensors [..., m*d/size], m pieces of this rank's channels each (an entry: 1; a state row:
        coff) -> [..., m*d] with every rank's channels in place: one all-gather for all of them."""
        k = self.d // self.size
        flat = torch.cat([x.reshape(-1, k) for x in xs])                # [rows, k]: each piece a row
        whole = all_gather_last(flat).split([x.numel() // k for x in xs])   # [rows_i, d]
        return [w.reshape(*x.shape[:-1], x.shape[-1] // k * self.d) for x, w in zip(xs, whole)]


@functools.lru_cache(maxsize=64)
def _channels(part: ChannelSplit, device: torch.device) -> torch.Tensor:
    k = part.d // part.size
    j = torch.arange(part.rank * k, (part.rank + 1) * k, device=device)
    return torch.cat([j + h * part.d for h in range(part.coff)])


def channel_split(sp: SeqSplit | None, d: int, coff: int) -> ChannelSplit | None:
    """A compressor's channel split in a split step (None: unsplit, or d does not divide)."""
    if sp is None or d % sp.size or not CHANNEL_SPLIT:
        return None
    return ChannelSplit(d, coff, sp.size, sp.rank)
