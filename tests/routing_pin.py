"""Pin the MoE routing of one run to another's, so two numerically different runs stay comparable.

Expert top-k is discrete: in a random tiny model two bf16 runs that differ by rounding choose
different experts wherever two scores are close, and the logits then jump. `record()` stores
every Gate call's expert ids; `replay()` makes the next run's Gate calls (same order: the same
prompts through the same scheduler) keep their own weights and ids where the ids agree, and
where they do not, use the recorded ids with weights from this run's own scores (torch).
`replay().pinned` counts those calls, so a test can report how often rounding flipped a choice.
"""
import contextlib

import torch
import torch.nn.functional as F

from engine.model.moe import Gate


class _Pins:
    def __init__(self):
        self.ids, self.pinned, self.calls = [], 0, 0


@contextlib.contextmanager
def record():
    pins, orig = _Pins(), Gate.forward

    def forward(self, x, ids):
        w, idx = orig(self, x, ids)
        pins.ids.append(idx.clone())
        return w, idx

    Gate.forward = forward
    try:
        yield pins
    finally:
        Gate.forward = orig


@contextlib.contextmanager
def replay(recorded: _Pins):
    pins, orig, queue = _Pins(), Gate.forward, list(recorded.ids)

    def forward(self, x, ids):
        w, idx = orig(self, x, ids)
        want = queue.pop(0).to(idx.device)
        pins.calls += 1
        if torch.equal(idx.to(want.dtype), want):
            return w, idx
        pins.pinned += 1
        scores = F.softplus(F.linear(x.float(), self.weight.float())).sqrt()
        w = scores.gather(-1, want)
        if self.norm_topk:
            w = w / w.sum(-1, keepdim=True)
        return w * self.route_scale, want

    Gate.forward = forward
    try:
        yield pins
    finally:
        Gate.forward = orig
    assert not queue, f"{len(queue)} recorded gate calls were not replayed"
