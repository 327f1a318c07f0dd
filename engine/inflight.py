"""A launched step's sampled tokens on their way to the host.

Async scheduling (as vLLM's async scheduling and SGLang's overlap scheduler do it) launches
step N+1 before the host reads step N's tokens: the next step's input ids are gathered from
`token_ids` on the device (engine.runner.step_inputs), and the values come back through one
non-blocking copy into pinned memory, with a CUDA event to wait on only when the host needs
them, after step N+1 is queued behind step N. On the CPU every op has run by the time it
returns, so this degenerates to plain tensors, but the one-step lag stays the same.
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
    kept only for a logits hook (tests), called when the tokens are read."""

    def __init__(self, seqs: list[Sequence], out: SamplerOutput, logits: torch.Tensor | None = None):
        self.seqs, self.out, self.logits = seqs, out, logits
        self.token_ids = out.token_ids          # [B] long on the device: the next step gathers from it
        fields = (out.token_ids, out.logprobs, out.top_logprob_ids, out.top_logprobs)
        self.event = None
        if out.token_ids.device.type == "cuda":
            self.host = [None if t is None else _pinned_copy(t) for t in fields]
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = list(fields)

    def read(self) -> HostTokens:
        """Wait for this step's copies (not for any later step) -> host lists."""
        if self.event is not None:
            self.event.synchronize()
        ids, lp, top_i, top_v = (None if t is None else t.tolist() for t in self.host)
        return HostTokens(ids, lp, top_i, top_v)


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
