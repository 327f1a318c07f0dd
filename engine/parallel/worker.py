"""Tensor-parallel ranks: rank 0 runs the scheduler and sends every step to the others.

`LLM(model, tp=N)` spawns ranks 1..N-1 (or finds itself under torchrun). Each rank loads
its own shard, builds a cache with the same block count, and runs every step rank 0
describes (engine.runner.run_step), meeting the others in the model's collectives. Only
rank 0 samples. A rank that dies is noticed before the next step; a rank that hangs fails
the collective after the group's timeout: either way an error, never a hang.
"""
import logging
import multiprocessing as mp
import socket

import torch
import torch.distributed as dist

from . import state

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else torch.device("cpu")


def send_step(step):
    """Rank 0: the step description (None = stop) to every rank."""
    dist.broadcast_object_list([step], src=0, group=state.cpu_group())


def recv_step():
    box = [None]
    dist.broadcast_object_list(box, src=0, group=state.cpu_group())
    return box[0]


def serve_steps(model, cache, device, graphs=None):
    """Ranks > 0: run steps until rank 0 says stop (decode through this rank's own graphs)."""
    from ..runner import run_step

    with torch.inference_mode():
        while (step := recv_step()) is not None:
            run_step(model, cache, step, device, graphs)


def worker_main(rank: int, size: int, init_method: str, spec: dict):
    """Entry point of a spawned rank."""
    logging.basicConfig(level=logging.WARNING)
    device = rank_device(torch.device(spec["device"]), rank)
    try:
        state.init(rank, size, init_method, device, spec["timeout"])
        model, cache, graphs = build_rank(spec, device)
        serve_steps(model, cache, device, graphs)
    except Exception:
        log.exception("tensor-parallel rank %d failed", rank)
        raise SystemExit(1)
    finally:
        state.shutdown()


def build_rank(spec: dict, device):
    """-> (model, cache, graphs or None) of this rank. Every rank captures the same buckets in the
    same order as rank 0 (engine.llm), so the collectives inside the captures meet."""
    from ..cache import KVCache
    from ..model import load_model

    num_blocks = recv_step()   # rank 0 sizes the pool; every rank must agree on block ids
    model = load_model(spec["path"], device=device, dtype=spec["dtype"], numerics=spec["numerics"]).prepare_kernels()
    cache = KVCache(model.cfg, spec["max_num_seqs"], 0, device, spec["dtype"], num_blocks=num_blocks)
    graphs = None
    if device.type == "cuda" and spec.get("graphs"):
        from ..graphs import DecodeGraphs

        graphs = DecodeGraphs(model, cache, spec["max_num_seqs"], spec["max_model_len"], cache.pad_slot)
        graphs.capture()
    return model, cache, graphs


class Workers:
    """Rank 0's handle on the spawned ranks."""

    def __init__(self, size: int, spec: dict):
        self.size, self.init_method = size, f"tcp://127.0.0.1:{free_port()}"
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=worker_main, args=(r, size, self.init_method, spec), daemon=True)
                      for r in range(1, size)]
        for p in self.procs:
            p.start()

    def check(self):
        for r, p in enumerate(self.procs, 1):
            if p.exitcode is not None:
                raise RuntimeError(f"tensor-parallel rank {r} is gone (exit code {p.exitcode})")

    def send(self, step):
        self.check()
        send_step(step)

    def stop(self):
        try:
            if all(p.exitcode is None for p in self.procs):
                send_step(None)
        except Exception:  # a broken group: the ranks are being torn down anyway
            pass
        for p in self.procs:
            p.join(timeout=10)
            if p.exitcode is None:
                p.kill()
