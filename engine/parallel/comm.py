"""The collectives the model calls: no-ops on one rank, device collectives on several.

One all-reduce closes each row-parallel sublayer (attention's wo_b, the MoE); the
vocab-parallel head gathers its logit slices. Sequence-parallel prefill (parallel/sequence.py)
closes a sub-layer with a reduce-scatter instead and opens the next with an all-gather.
All are capturable in a CUDA graph (NCCL) and have the group's timeout. A SimulatedGroup (state.init_simulated) answers them
locally; tp_size() > 1 with no group raises (a misconfigured run must never skip a reduction).
Rank 0 describes every step to the other ranks with send_step / recv_step (CPU group).
"""
import torch
import torch.distributed as dist

from .state import SimulatedGroup, cpu_group, group, tp_size


def _group():
    g = group()
    if g is None:
        raise RuntimeError(f"tp_size() = {tp_size()} but no process group: join one with "
                           "engine.parallel.state.init (or init_simulated for a simulated rank)")
    return g


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if tp_size() == 1:
        return x
    g = _group()
    if isinstance(g, SimulatedGroup):
        return g.all_reduce(x)
    dist.all_reduce(x, group=g)
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's x along the last dim (rank order)."""
    if tp_size() == 1:
        return x
    g = _group()
    if isinstance(g, SimulatedGroup):
        return g.all_gather_last(x)
    parts = [torch.empty_like(x) for _ in range(tp_size())]
    dist.all_gather(parts, x.contiguous(), group=g)
    return torch.cat(parts, dim=-1)


# torch 2.13 renames the single-tensor collectives (the old names warn); the device's 2.11 has the old ones
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter(x: torch.Tensor) -> torch.Tensor:
    """x [size*n, ...], every rank's partial sums -> [n, ...]: the sums of this rank's n rows (rank r: rows r*n..)."""
    if tp_size() == 1:
        return x
    g = _group()
    if isinstance(g, SimulatedGroup):
        return g.reduce_scatter(x)
    out = x.new_empty((x.shape[0] // tp_size(), *x.shape[1:]))
    _reduce_scatter(out, x.contiguous(), group=g)
    return out


def all_gather(x: torch.Tensor) -> torch.Tensor:
    """x [n, ...] of every rank -> [size*n, ...], rank r's rows at r*n.."""
    if tp_size() == 1:
        return x
    g = _group()
    if isinstance(g, SimulatedGroup):
        return g.all_gather(x)
    out = x.new_empty((x.shape[0] * tp_size(), *x.shape[1:]))
    _all_gather(out, x.contiguous(), group=g)
    return out


def shard(n: int, what: str) -> int:
    """The local size of a dimension of n split over the ranks; it must divide evenly."""
    if n % tp_size():
        raise ValueError(f"{what} = {n} does not split over tp = {tp_size()} ranks")
    return n // tp_size()


def share_ids(buf: torch.Tensor):
    """Rank 0's buf (a step's sampled token ids) into every rank's buf, in place, on the device
    group: async scheduling's next step reads its pending tokens from them on every rank."""
    dist.broadcast(buf, src=0, group=_group())


def send_step(step):
    """Rank 0: a step description (any picklable object; None = stop) to every rank."""
    dist.broadcast_object_list([step], src=0, group=cpu_group())


def recv_step():
    """Ranks > 0: the next object rank 0 sent with send_step."""
    box = [None]
    dist.broadcast_object_list(box, src=0, group=cpu_group())
    return box[0]
