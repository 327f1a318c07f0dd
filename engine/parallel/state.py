"""Tensor-parallel state of this process: rank, size, and the groups collectives use.

The model asks `tp_rank()` / `tp_size()` when it is built, to size its shards; the
collectives in comm.py run on `group()`: a real process group (NCCL on GPUs, gloo on CPU,
joined by `init`) or a `SimulatedGroup` (one rank posing as rank r of N, installed by
`init_simulated`; bench/decode.py times one rank that way). A CPU gloo group always exists
beside a real one for the scheduler's step messages. tp_size() > 1 with no group at all is a
misconfiguration: the collectives raise rather than skip.
"""
import datetime
import os

import torch
import torch.distributed as dist

_rank, _size = 0, 1
_group = None       # the collectives' group (None: single process)
_cpu_group = None   # step metadata from rank 0


def tp_rank() -> int:
    return _rank


def tp_size() -> int:
    return _size


def group():
    return _group


def cpu_group():
    return _cpu_group


def init(rank: int, size: int, init_method: str, device: torch.device, timeout_s: float = 60.0):
    """Join the tensor-parallel group; a rank that never arrives fails this after timeout_s."""
    global _rank, _size, _group, _cpu_group
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout)
    _rank, _size = rank, size
    _group = dist.group.WORLD
    _cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else _group


def from_torchrun() -> tuple[int, int] | None:
    """(rank, world size) when launched by torchrun, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


class SimulatedGroup:
    """A stand-in process group for one rank of `size` run alone: the model builds its shards
    and every collective returns a tensor of the right shape without talking to anyone.
    all_reduce returns x unchanged; all_gather_last repeats x once per rank. The numbers are
    not the real model's (nothing is summed): it is for timing one rank and for shape tests."""

    def __init__(self, rank: int, size: int):
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in [0, {size})")
        self.rank, self.size = rank, size

    def all_reduce(self, x):
        return x

    def all_gather_last(self, x):
        return x.repeat(*([1] * (x.dim() - 1)), self.size)

    def __repr__(self):
        return f"SimulatedGroup(rank={self.rank}, size={self.size})"


def init_simulated(rank: int, size: int) -> SimulatedGroup:
    """Pose as rank `rank` of `size` with a SimulatedGroup (no other process): shards are built
    for that rank, collectives return right-shaped tensors. Undo with shutdown()."""
    global _rank, _size, _group, _cpu_group
    g = SimulatedGroup(rank, size)
    _rank, _size, _group, _cpu_group = rank, size, g, None
    return g


def shutdown():
    global _rank, _size, _group, _cpu_group
    if dist.is_initialized():
        dist.destroy_process_group()
    _rank, _size, _group, _cpu_group = 0, 1, None, None
