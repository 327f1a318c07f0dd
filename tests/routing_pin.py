"""Pin the MoE routing of one run to another's, so two numerically different runs stay comparable.

Expert top-k is discrete: in a random tiny model two bf16 runs that differ by rounding choose
different experts wherever two scores are close, and the logits then jump. `record()` stores
the expert ids of every routing call of the engine's step (engine.model.step.route); `replay()`
makes the next run's calls (same order: the same prompts through the same scheduler) keep their
own weights and ids where the ids agree, and where they do not, use the recorded ids with
weights from this run's own scores (torch).
`replay().pinned` counts those calls, so a test can report how often rounding flipped a choice.
"""
import contextlib

import torch
import torch.nn.functional as F

from engine.model import step


class _Pins:
    def __init__(self):
        self.ids, self.pinned, self.calls = [], 0, 0


@contextlib.contextmanager
def record():
    pins, orig = _Pins(), step.route

    def route(gate, x, logits, ids, packed, ops):
        out = orig(gate, x, logits, ids, packed, ops)
        pins.ids.append(out[1].clone())
        return out

    step.route = route
    try:
        yield pins
    finally:
        step.route = orig


@contextlib.contextmanager
def replay(recorded: _Pins):
    assert recorded.ids, "no routing call was recorded: is engine.model.step.route still the step's router?"
    pins, orig, queue = _Pins(), step.route, list(recorded.ids)

    def route(gate, x, logits, ids, packed, ops):
        out = orig(gate, x, logits, ids, packed, ops)
        want = queue.pop(0).to(out[1].device)
        pins.calls += 1
        if torch.equal(out[1].to(want.dtype), want):
            return out
        pins.pinned += 1
        scores = F.softplus(F.linear(x.float(), gate.weight.float())).sqrt()
        w = scores.gather(-1, want.long())
        if gate.norm_topk:
            w = w / w.sum(-1, keepdim=True)
        return w * gate.route_scale, want, None     # (None: the fused MoE sorts the pinned pairs itself)

    step.route = route
    try:
        yield pins
    finally:
        step.route = orig
    assert not queue, f"{len(queue)} recorded gate calls were not replayed"
