"""What several kernels share: rounding, split-K, the SM count, the interpreter check, scratch
buffers, and the torch math their references need (RoPE, block-table addressing).

Kernels are a leaf: they import torch, triton, engine.numerics and engine.kernels.* only. The
model imports the shared torch math from here (apply_rope, cos_sin, entry_loc), not the other
way round.
"""
import contextlib
import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from engine.numerics import up

MAX_SPLIT = 64                    # the last split sums the partials serially: keep that tail short


# ----------------------------------------------------------------------------- device facts

def num_sms(device=None, cpu: int = 132) -> int:
    """SMs to fill (device None: the current CUDA device if any). Off-GPU `cpu`: by default an
    H100/H200's 132, so interpreter runs take the plans the GPU takes; the fused MoE and the
    indexer pass a few (4) so that small interpreter tests still take their split paths."""
    device = torch.device(device) if device is not None else None
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    if device is None or device.type != "cuda":
        return cpu
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def interpreting() -> bool:
    """Kernels run under the Triton interpreter (TRITON_INTERPRET=1, the CPU tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


# ----------------------------------------------------------------------------- programmatic dependent launch

def pdl_args() -> dict:
    """Launch options of every kernel: on Hopper and later (unless ENGINE_PDL=0; in model steps of
    at most PDL_MAX_TOKENS tokens, pdl_for_step) each kernel is launched as a programmatic
    dependent of the one before it (Triton's launch_pdl), so its blocks are scheduled and set up
    while the previous kernel drains; USE_GDC makes the kernel wait for
    that kernel's completion (gdc_enter) before it reads or writes any memory. Under CUDA graphs
    the dependency is captured as a programmatic edge. Off in the interpreter and on CPU."""
    return {"USE_GDC": True, "launch_pdl": True} if _pdl_on() else {}


# Steps of up to this many tokens launch with PDL. bench/decode.py --pdl-ab (H200, 43 layers, 8k
# context, graph replay, 2026-12-03): 3.7-5.6% faster at 1-8 tokens, 1-6% slower at 16-256.
PDL_MAX_TOKENS = 8
_pdl_override: bool | None = None
_pdl_step = True


def set_pdl(on: bool | None) -> None:
    """Launches from now on with PDL on or off, whatever the step (None: back to ENGINE_PDL and
    pdl_for_step); graphs captured before keep what they captured. For A/B measurements
    (bench/decode.py --pdl-ab)."""
    global _pdl_override
    _pdl_override = on


@contextlib.contextmanager
def pdl_for_step(tokens: int):
    """The launches of one model step of `tokens` tokens: PDL on up to PDL_MAX_TOKENS."""
    global _pdl_step
    prev, _pdl_step = _pdl_step, tokens <= PDL_MAX_TOKENS
    try:
        yield
    finally:
        _pdl_step = prev


def _pdl_on() -> bool:
    if not _pdl_supported() or os.environ.get("ENGINE_PDL", "1") == "0":
        return False
    return _pdl_override if _pdl_override is not None else _pdl_step


@functools.lru_cache(maxsize=None)
def _pdl_supported() -> bool:
    return not interpreting() and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


@triton.jit
def gdc_enter(USE_GDC: tl.constexpr):
    """First statement of every kernel: wait until the previous kernel in the stream has completed
    and its writes are visible (griddepcontrol.wait), then let the next kernel launch early
    (griddepcontrol.launch_dependents: it takes effect once every block of this grid has run it,
    and the next kernel waits for this one's completion in turn). Nothing is read before the wait,
    so the order of memory effects is exactly that of plain launches (except weights no kernel
    writes, which a kernel may prefetch before it: mhc_post's mix weights)."""
    if USE_GDC:
        gdc_wait()
        gdc_launch_dependents()


# ----------------------------------------------------------------------------- launches held back

_held: list | None = None       # while kv_prep.together() is open: the (kernel, grid, args, K) held back


def hold(kernel, grid, args, K) -> bool:
    """Inside kv_prep.together(): keep this launch of kernel[grid](args, K=K) for the block's one
    launch -> True; else False (launch it now). Only the program-function kernels ask."""
    if _held is None:
        return False
    _held.append((kernel, grid, args, K))
    return True


def held(jobs: list | None) -> list | None:
    """Open (a list) or close (None) the held-launch list -> the one it replaces."""
    global _held
    before, _held = _held, jobs
    return before


# ----------------------------------------------------------------------------- scratch buffers

_scratch: dict = {}     # (name, device) -> the buffer
_retired: list = []     # outgrown buffers that captured graphs may still use


def scratch(name: str, device, numel: int, dtype: torch.dtype, zero: bool = False, min_numel: int = 1) -> torch.Tensor:
    """A kernel's workspace keyed by (name, device): reused by every launch, grown (never shrunk)
    only outside CUDA-graph capture, so the eager warm-up before a capture sizes it for that step
    and replays see the same memory; a buffer outgrown later (a larger eager step) is kept alive,
    since graphs captured with it still write there. `zero`: allocated zeroed (ticket counters the kernels leave
    at zero). The buffer may be longer than `numel`."""
    device = torch.device(device)
    key = (name, device)
    buf = _scratch.get(key)
    if buf is None or buf.numel() < numel or buf.dtype != dtype:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{name}: scratch buffer must grow inside a graph capture: run this shape eagerly first")
        n = max(numel, min_numel, buf.numel() if buf is not None and buf.dtype == dtype else 0)
        if buf is not None:   # graphs captured with it may still replay: never free it
            _retired.append(buf)
        buf = _scratch[key] = (torch.zeros if zero else torch.empty)(n, dtype=dtype, device=device)
    return buf


# ----------------------------------------------------------------------------- rounding

@triton.jit
def round_to(x, dtype: tl.constexpr):
    """fp32 x -> the nearest (ties to even) value of `dtype`, still as fp32.

    Stores cast fp32 -> bf16 by truncation under TRITON_INTERPRET (RNE on the GPU); rounding
    here first makes the cast exact on both, so the interpreter tests see the GPU's numbers
    (bf16 subnormals excepted: the interpreter flushes them)."""
    if dtype == tl.bfloat16:
        b = x.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
        x = b.to(tl.float32, bitcast=True)
    return x


# ----------------------------------------------------------------------------- split-K

@dataclass(frozen=True)
class SplitPlan:
    split: int              # programs along K per output tile
    kb_per_split: int       # K blocks each split owns (the last may own fewer)


def plan_split(tiles: int, n_kb: int, sms: int, split_k=None) -> SplitPlan:
    """Enough programs for ~2 per SM, never an empty split. `split_k` forces a count (tests, tuning)."""
    want = split_k if split_k is not None else max(1, (2 * sms) // max(tiles, 1))
    want = max(1, min(want, n_kb, MAX_SPLIT))
    per = triton.cdiv(n_kb, want)
    return SplitPlan(triton.cdiv(n_kb, per), per)


class SplitKWorkspace:
    """fp32 partials and int32 tickets for split-K GEMMs; one per stream, reused by every GEMM on it.

    Tickets start at zero and every kernel leaves them at zero, so launches on one stream may share it.
    """

    def __init__(self, partial_numel: int, n_tickets: int, device, partials=None, tickets=None):
        self.partials = partials if partials is not None else torch.empty(max(partial_numel, 1), dtype=torch.float32,
                                                                          device=device)
        self.tickets = tickets if tickets is not None else torch.zeros(max(n_tickets, 1), dtype=torch.int32,
                                                                       device=device)

    def check(self, partial_numel: int, n_tickets: int):
        if partial_numel > self.partials.numel() or n_tickets > self.tickets.numel():
            raise ValueError(f"split-K workspace too small: need {partial_numel} partials and {n_tickets} "
                             f"tickets, have {self.partials.numel()} and {self.tickets.numel()}")

    @classmethod
    def sized_for(cls, needs, device):
        """needs: iterable of (partial_numel, n_tickets), e.g. from fp8_gemm_need over the decode buckets."""
        needs = list(needs)
        return cls(max((n for n, _ in needs), default=1), max((t for _, t in needs), default=1), device)


def get_workspace(workspace, partial_numel, n_tickets, device):
    """The given workspace, or the device's shared one (scratch buffers), grown to fit. Kernels on
    one stream run one after another and leave the tickets at zero, so all of them can share it;
    a GEMM that may run beside them on another stream names a shared one of its own (a str)."""
    if workspace is None or isinstance(workspace, str):
        name = "splitk" if workspace is None else f"splitk.{workspace}"
        return SplitKWorkspace(0, 0, device, partials=scratch(f"{name}.partials", device, partial_numel, torch.float32),
                               tickets=scratch(f"{name}.tickets", device, n_tickets, torch.int32, zero=True))
    workspace.check(partial_numel, n_tickets)
    return workspace


@triton.jit
def splitk_arrive(acc, part_ptr, offs, mask, ticket_ptr, n_split):
    """Store this split's fp32 partial, take the tile's ticket -> True for the tile's last split."""
    tl.store(part_ptr + offs, acc, mask=mask)
    tl.debug_barrier()                             # every thread's partial is out before the release
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
    return ticket == n_split - 1


@triton.jit
def splitk_total(part_ptr, offs, mask, slot, n_split):
    """Sum a tile's partials (any shape, like offs) in split order: the same bits whichever split
    came last. Called by the last split only, after splitk_arrive said so."""
    tl.debug_barrier()
    total = tl.zeros(offs.shape, tl.float32)
    for s in range(n_split):
        # .cg: read at L2, where the other SMs' partials landed, never a stale L1 line
        total += tl.load(part_ptr + s * slot + offs, mask=mask, other=0.0, cache_modifier=".cg")
    return total


@triton.jit
def splitk_reset(ticket_ptr):
    """The last split leaves the ticket at zero for the next GEMM (or graph replay) on the stream."""
    tl.store(ticket_ptr, 0)


# ----------------------------------------------------------------------------- torch math the references share

def cos_sin(positions: torch.Tensor, inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE angles: positions [...] int -> cos, sin [..., rope_dim/2] fp32."""
    angles = positions.float()[..., None] * inv.to(positions.device)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last 2*cos.shape[-1] channels of x (interleaved pairs, GPT-J style);
    cos/sin broadcast against x[..., :R/2]."""
    r = 2 * cos.shape[-1]
    nope, rope = x[..., :-r], up(x[..., -r:]).unflatten(-1, (r // 2, 2))
    x0, x1 = rope[..., 0], rope[..., 1]
    if inverse:
        sin = -sin
    out = torch.stack((x0 * cos - x1 * sin, x1 * cos + x0 * sin), dim=-1).flatten(-2)
    return torch.cat((nope, out.to(x.dtype)), dim=-1)


def entry_loc(block_table: torch.Tensor, block_tokens: int, entries: torch.Tensor, ratio: int) -> torch.Tensor:
    """Entry ids [B, ...] of each row's sequence -> flat rows of a [blocks * per_block, d] store.

    Entries past a row's blocks (masked by the caller) are clamped into its last block."""
    per_block = block_tokens // ratio
    B = entries.shape[0]
    blk = (entries // per_block).clamp(0, block_table.shape[1] - 1)
    rows = torch.arange(B, device=entries.device).view(B, *([1] * (entries.dim() - 1)))
    return block_table[rows, blk] * per_block + entries % per_block
