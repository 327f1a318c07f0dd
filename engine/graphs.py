"""CUDA graphs for decode: one graph per batch bucket, replayed with padding to the bucket.

Each graph runs Transformer.forward_step on static buffers (token ids, positions, slots,
block table) with every data-dependent size fixed: gathers are sized for max_model_len,
and padding rows point at a spare cache slot and the never-read block 0, so they write
nothing a real sequence reads. Sampling stays outside the graph (it is cheap and its
batch metadata changes per step).
"""
import logging
import time

import torch

from .cache import KVCache
from .model.kv_cache import StepContext

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class DecodeGraphs:
    def __init__(self, model, cache: KVCache, max_num_seqs: int, max_model_len: int, pad_slot: int):
        self.model, self.cache, self.max_model_len, self.pad_slot = model, cache, max_model_len, pad_slot
        self.buckets = [b for b in BUCKETS if b <= max_num_seqs]
        if not self.buckets or self.buckets[-1] < max_num_seqs:
            self.buckets.append(max_num_seqs)
        dev, B = cache.device, self.buckets[-1]
        self.max_blocks = cache.blocks_needed(max_model_len)
        self.ids = torch.zeros(B, 1, dtype=torch.long, device=dev)
        self.positions = torch.zeros(B, 1, dtype=torch.long, device=dev)
        self.slots = torch.full((B,), pad_slot, dtype=torch.long, device=dev)
        self.table = torch.zeros(B, self.max_blocks, dtype=torch.long, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None

    def _ctx(self, b: int) -> StepContext:
        return StepContext(self.slots[:b], self.positions[:b], self.table[:b], self.cache.block_tokens,
                           self.max_model_len)

    @torch.inference_mode()
    def capture(self):
        t0 = time.perf_counter()
        free0 = torch.cuda.mem_get_info()[0]
        self._pad(0)
        for b in reversed(self.buckets):   # largest first: the others reuse its pool
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    self.model.forward_step(self.ids[:b], self._ctx(b), self.cache.layers)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self.logits[b] = self.model.forward_step(self.ids[:b], self._ctx(b), self.cache.layers)
            self.pool = g.pool()
            self.graphs[b] = g
        torch.cuda.synchronize()
        used = free0 - torch.cuda.mem_get_info()[0]
        log.info("captured %d decode graphs (batch %s) in %.1f s, %.1f MiB", len(self.graphs),
                 ",".join(map(str, self.buckets)), time.perf_counter() - t0, used / 2**20)

    def _pad(self, n: int):
        """Rows from n on: the spare slot, position 0, block 0."""
        self.ids[n:] = 0
        self.positions[n:] = 0
        self.slots[n:] = self.pad_slot
        self.table[n:] = 0

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def run(self, step: dict) -> torch.Tensor:
        """A decode step description (engine.runner) -> logits [n, V]."""
        n = len(step["ids"])
        b = self.bucket(n)
        dev = self.cache.device
        self.ids[:n] = torch.tensor(step["ids"], device=dev)
        self.positions[:n] = torch.tensor(step["positions"], device=dev)
        self.slots[:n] = torch.tensor(step["slots"], device=dev)
        rows = [blk + [0] * (self.max_blocks - len(blk)) for blk in step["blocks"]]
        self.table[:n] = torch.tensor(rows, dtype=torch.long, device=dev)
        self._pad(n)
        if b not in self.graphs:   # not captured: the same padded batch, eagerly (what replay must equal)
            return self.model.forward_step(self.ids[:b], self._ctx(b), self.cache.layers)[:n]
        self.graphs[b].replay()
        return self.logits[b][:n]
