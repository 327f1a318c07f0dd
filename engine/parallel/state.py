"""Tensor-parallel state of this process: rank, size, and the groups collectives use.

The model asks `tp_rank()` / `tp_size()` when it is built, to size its shards; the
collectives in comm.py run on `group()` (NCCL on GPUs, gloo on CPU). A CPU gloo group
always exists beside it for the scheduler's step messages.
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


def simulate(rank: int, size: int):
    """Pose as one rank of `size` with no group: the model builds its shards, collectives are
    skipped (bench/decode.py times one rank and models the all-reduces)."""
    global _rank, _size, _group, _cpu_group
    _rank, _size, _group, _cpu_group = rank, size, None, None


def shutdown():
    global _rank, _size, _group, _cpu_group
    if dist.is_initialized():
        dist.destroy_process_group()
    _rank, _size, _group, _cpu_group = 0, 1, None, None
