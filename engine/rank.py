"""One tensor-parallel rank: how every rank (rank 0 inside LLM, the others here) builds its
model, cache and decode graphs, and the loop ranks > 0 run.

`LLM(model, tp=N)` spawns ranks 1..N-1 (Workers) or finds itself under torchrun. Each rank
loads its own shard through `build` (the same function LLM.__init__ calls), builds a cache
with the block count rank 0 sends, captures the same decode buckets in the same order, then
runs every step rank 0 describes (engine.runner.run_step), meeting the others in the model's
collectives. Only rank 0 samples. A rank that dies is noticed before the next step; a rank
that hangs fails the collective after the group's timeout: either way an error, never a hang.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import socket
from pathlib import Path

import torch

from .cache import KVCache
from .model import load_model
from .model.config import ModelConfig
from .parallel import sequence, state
from .parallel.comm import recv_step, send_step

log = logging.getLogger(__name__)


def build(path: str | Path, device: torch.device, dtype: torch.dtype, numerics: str, max_num_seqs: int,
          max_model_len: int, num_blocks: int, graphs: bool):
    """-> (model, cache, DecodeGraphs or None) of this process's rank: load its shard, prepare the
    kernels' layouts, build the cache of num_blocks blocks and capture the decode graphs
    (CUDA only, when graphs). Every rank runs this with the same arguments, so the captures
    (and the collectives inside them) meet bucket by bucket."""
    ModelConfig.from_file(path).check_tp(state.tp_size(), numerics)   # before reading any weight
    model = load_model(path, device=device, dtype=dtype, numerics=numerics).prepare_kernels()
    return finish(model, device, dtype, max_num_seqs, max_model_len, num_blocks, graphs)


def finish(model, device: torch.device, dtype: torch.dtype, max_num_seqs: int, max_model_len: int,
           num_blocks: int, graphs: bool):
    """A prepared model -> (model, cache, DecodeGraphs or None): the cache of num_blocks blocks and
    the decode graphs (CUDA only, when graphs). A simulated rank (engine.simulate) joins here."""
    cache = KVCache(model.cfg, max_num_seqs, 0, device, dtype, num_blocks=num_blocks)
    decode_graphs = None
    if graphs and device.type == "cuda":
        from .graphs import DecodeGraphs

        decode_graphs = DecodeGraphs(model, cache, max_num_seqs, max_model_len, cache.pad_slot)
        decode_graphs.capture()
    return model, cache, decode_graphs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else torch.device("cpu")


def build_rank(spec: dict, device):
    """Ranks > 0: -> (model, cache, graphs or None), with the block count rank 0 sends."""
    num_blocks = recv_step()   # rank 0 sizes the pool; every rank must agree on block ids
    return build(spec["path"], device, spec["dtype"], spec["numerics"], spec["max_num_seqs"],
                 spec["max_model_len"], num_blocks, spec.get("graphs", False))


def serve_steps(model, cache, device, graphs=None):
    """Ranks > 0: run steps until rank 0 says stop (decode through this rank's own graphs). Async
    scheduling: a step marked "share" is followed by rank 0's sampled ids (ModelRunner.
    share_sampled), which the next step's pending tokens are gathered from, as on rank 0."""
    from .parallel.comm import share_ids
    from .runner import run_step

    prev = None
    with torch.inference_mode():
        while (step := recv_step()) is not None:
            run_step(model, cache, step, device, graphs, prev)
            if step.get("share"):
                if prev is None or prev.numel() != step["share"]:
                    prev = torch.zeros(step["share"], dtype=torch.long, device=device)
                share_ids(prev)


def worker_main(rank: int, size: int, init_method: str, spec: dict):
    """Entry point of a spawned rank."""
    logging.basicConfig(level=logging.WARNING)
    sequence.apply(spec["sequence"])    # every rank must split the same steps, and the same way, as rank 0
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


class Workers:
    """Rank 0's handle on the spawned ranks."""

    def __init__(self, size: int, spec: dict):
        self.size, self.init_method = size, f"tcp://127.0.0.1:{free_port()}"
        spec = {**spec, "sequence": sequence.settings()}
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


def join(tp: int, device: torch.device, spec: dict):
    """Start (or, under torchrun, join) the tensor-parallel group -> (this process's device,
    Workers or None). Ranks > 0 under torchrun build, serve steps until rank 0 shuts down, and exit."""
    env = state.from_torchrun()
    if env is None:
        workers = Workers(tp, spec)
        device = rank_device(device, 0)
        state.init(0, tp, workers.init_method, device, spec["timeout"])
        return device, workers
    rank, size = env
    if size != tp:
        raise ValueError(f"tp={tp} but torchrun started {size} ranks")
    device = rank_device(device, rank)
    state.init(rank, size, "env://", device, spec["timeout"])
    if rank > 0:
        try:
            model, cache, graphs = build_rank(spec, device)
            serve_steps(model, cache, device, graphs)
        finally:
            state.shutdown()
        raise SystemExit(0)
    return device, None


def stop(workers: Workers | None):
    """Rank 0: stop the other ranks and leave the group (a no-op at tp=1)."""
    if state.tp_size() <= 1:
        return
    if workers is not None:
        workers.stop()
    else:
        try:
            send_step(None)
        except Exception:
            pass
    state.shutdown()
