"""The collectives the model calls: no-ops on one rank, device collectives on several.

One all-reduce closes each row-parallel sublayer (attention's wo_b, the MoE); the
vocab-parallel head gathers its logit slices. All are capturable in a CUDA graph
(NCCL) and have the group's timeout.
"""
import torch
import torch.distributed as dist

from .state import group, tp_size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if tp_size() > 1 and group() is not None:   # no group: a simulated rank (bench)
        dist.all_reduce(x, group=group())
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's x along the last dim (rank order)."""
    if tp_size() == 1:
        return x
    if group() is None:                          # a simulated rank: right shape, copies of x
        return x.repeat(*([1] * (x.dim() - 1)), tp_size())
    parts = [torch.empty_like(x) for _ in range(tp_size())]
    dist.all_gather(parts, x.contiguous(), group=group())
    return torch.cat(parts, dim=-1)


def shard(n: int, what: str) -> int:
    """The local size of a dimension of n split over the ranks; it must divide evenly."""
    if n % tp_size():
        raise ValueError(f"{what} = {n} does not split over tp = {tp_size()} ranks")
    return n // tp_size()
