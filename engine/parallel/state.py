"""Tensor-parallel state of this process: rank, size, and the groups collectives use.

The model asks `tp_rank()` / `tp_size()` when it is built, to size its shards; the
collectives in comm.py run on `group()`: a real process group (NCCL on GPUs, gloo on CPU,
joined by `init`) or a `SimulatedGroup` (one rank posing as rank r of N, installed by
`init_simulated`; engine.simulate and bench/decode.py run one rank that way). A CPU gloo
group always exists beside a real one for the scheduler's step messages. tp_size() > 1 with
no group at all is a misconfiguration: the collectives raise rather than skip.
"""
import datetime
import os

import torch
import torch.distributed as dist

from . import latency

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
    all_reduce returns x unchanged; all_gather_last and all_gather repeat x once per rank;
    reduce_scatter returns this rank's rows of x. The numbers are
    not the real model's (nothing is summed): it is for timing one rank and for shape tests.

    Every call is counted (`calls`) and its cost under parallel.latency's model summed
    (`modelled_us`); a CUDA graph's calls count once, at capture. With `modelled` the cost is
    also spent on the device: torch.cuda._sleep spins the stream for that many SM clock
    cycles (a kernel, so CUDA graphs capture it), converted at a rate `calibrate` measures
    before any capture. CPU tensors are never delayed. bench/decode.py leaves it off and adds
    the cost to its rows analytically."""

    def __init__(self, rank: int, size: int, modelled: bool = False):
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in [0, {size})")
        self.rank, self.size, self.modelled = rank, size, modelled
        self.calls = {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0}
        self.modelled_us = 0.0
        self.cycles_per_us = None   # the SM clock, measured by calibrate()

    def all_reduce(self, x):
        self._spend("all_reduce", latency.all_reduce_us(x.numel() * x.element_size(), self.size), x)
        return x

    def all_gather_last(self, x):
        out = x.repeat(*([1] * (x.dim() - 1)), self.size)
        self._spend("all_gather", latency.all_gather_us(out.numel() * out.element_size(), self.size), x)
        return out

    def all_gather(self, x):
        out = x.repeat(self.size, *([1] * (x.dim() - 1)))
        self._spend("all_gather", latency.all_gather_us(out.numel() * out.element_size(), self.size), x)
        return out

    def reduce_scatter(self, x):
        n = x.shape[0] // self.size
        self._spend("reduce_scatter", latency.reduce_scatter_us(x.numel() * x.element_size(), self.size), x)
        return x[self.rank * n:(self.rank + 1) * n]

    def calibrate(self, device, cycles: int = 20_000_000) -> float:
        """Measure the SM clock (cycles per us) that torch.cuda._sleep counts, by CUDA events
        (median of 3 spins of `cycles`). Must run outside any graph capture."""
        import statistics

        with torch.cuda.device(device):
            torch.cuda._sleep(1000)                    # the spin kernel loaded before timing
            rates = []
            for _ in range(3):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                torch.cuda._sleep(cycles)
                b.record()
                b.synchronize()
                rates.append(cycles / (a.elapsed_time(b) * 1e3))
        self.cycles_per_us = statistics.median(rates)
        return self.cycles_per_us

    def _spend(self, kind: str, us: float, x):
        self.calls[kind] += 1
        self.modelled_us += us
        if not (self.modelled and x.is_cuda):
            return
        if self.cycles_per_us is None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("SimulatedGroup: call calibrate(device) before capturing a graph")
            self.calibrate(x.device)
        torch.cuda._sleep(max(1, round(us * self.cycles_per_us)))

    def __repr__(self):
        return f"SimulatedGroup(rank={self.rank}, size={self.size}, modelled={self.modelled})"


def init_simulated(rank: int, size: int, modelled: bool = False) -> SimulatedGroup:
    """Pose as rank `rank` of `size` with a SimulatedGroup (no other process): shards are built
    for that rank, collectives return right-shaped tensors (modelled: and cost device time, see
    SimulatedGroup). Undo with shutdown()."""
    global _rank, _size, _group, _cpu_group
    g = SimulatedGroup(rank, size, modelled)
    _rank, _size, _group, _cpu_group = rank, size, g, None
    return g


def shutdown():
    global _rank, _size, _group, _cpu_group
    if dist.is_initialized():
        dist.destroy_process_group()
    _rank, _size, _group, _cpu_group = 0, 1, None, None
