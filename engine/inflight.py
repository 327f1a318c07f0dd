"""A launched step's sampled tokens on their way to the host.

Async scheduling (as vLLM's async scheduling and SGLang's overlap scheduler do it) launches
step N+1 before the host reads step N's tokens: the next step's input ids are gathered from
`token_ids` on the device (engine.runner.step_inputs), and the values come back through one
non-blocking copy into pinned memory, with a CUDA event to wait on only when the host needs
them, after step N+1 is queued behind step N. On the CPU every op has run by the time it
returns (the copies are plain copies), but the one-step lag stays the same.
"""
from dataclasses import dataclass

import torch

from .sampler import SamplerOutput
from .sequence import Sequence


@dataclass
class HostTokens:
    """What the host reads of one step's sampler output, as lists (one entry per row)."""
    token_ids: list[int]
    logprobs: list[float] | None
    top_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None


class InFlight:
    """One step's sampled rows: seqs[i] sampled row i of out. logits: a copy of the rows' logits,
    kept only for a logits hook (tests), called when the tokens are read. host: where the
    values are copied to (HostBuffers; None: a fresh set)."""

    def __init__(self, seqs: list[Sequence], out: SamplerOutput, logits: torch.Tensor | None = None,
                 host: "HostBuffers | None" = None):
        self.seqs, self.out, self.logits = seqs, out, logits
        self.token_ids = out.token_ids          # [B] long on the device: the next step gathers from it
        fields = (out.token_ids, out.logprobs, out.top_logprob_ids, out.top_logprobs)
        host = host or HostBuffers(out.token_ids.device)
        self.set = host.take()
        self.host = [None if t is None else self.set.copy(j, t) for j, t in enumerate(fields)]
        self.event = self.set.event
        if self.event is not None:
            self.event.record()

    def read(self) -> HostTokens:
        """Wait for this step's copies (not for any later step) -> host lists."""
        if self.event is not None:
            self.event.synchronize()
        ids, lp, top_i, top_v = (None if t is None else t.tolist() for t in self.host)
        self.set.busy = False   # the lists are taken: the buffers may be written again
        return HostTokens(ids, lp, top_i, top_v)


class _Set:
    """One step's host buffers (pinned where the device is a GPU) and the event its copies record."""

    def __init__(self, pin: bool):
        self.pin, self.busy = pin, False
        self.bufs: list[torch.Tensor | None] = [None] * 4
        self.event = torch.cuda.Event() if pin else None

    def copy(self, j: int, t: torch.Tensor) -> torch.Tensor:
        """A non-blocking copy of t into buffer j (grown where too small) -> its view."""
        buf = self.bufs[j]
        if buf is None or buf.dtype != t.dtype or buf.numel() < t.numel():
            # a normal tensor even when the first step runs under inference mode: a later copy
            # into it from outside (a caller without EngineCore.step's decorator) stays legal
            with torch.inference_mode(False):
                buf = self.bufs[j] = torch.empty(max(t.numel(), 64), dtype=t.dtype, pin_memory=self.pin)
        return buf[:t.numel()].view(t.shape).copy_(t, non_blocking=True)


class HostBuffers:
    """Two sets of host buffers taken in turn by the steps' InFlights, so that no step allocates
    pinned memory or an event: a set comes round again two steps later, when the step that used
    it has been read (its copies done, its lists taken). A set still unread then (not expected)
    is left to its step and a fresh one made, never waited for."""

    def __init__(self, device):
        self.pin = torch.device(device).type == "cuda"
        self.sets = [_Set(self.pin), _Set(self.pin)]
        self.turn = 0

    def take(self) -> _Set:
        i, self.turn = self.turn, self.turn ^ 1
        if self.sets[i].busy:
            self.sets[i] = _Set(self.pin)
        self.sets[i].busy = True
        return self.sets[i]
