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
from .model.kv_cache import StepInputs

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
        # the static inputs every graph reads, views of one flat buffer (engine.staging copies a
        # decode step's inputs in with one host-to-device copy): [ids B | positions B | slots B |
        # spare 2B (the staged pending-token rows, not read by the graphs) | block table B*W]
        W = self.max_blocks
        self.flat = torch.zeros(5 * B + B * W, dtype=torch.long, device=dev)
        ids, positions, slots, self.spare, table = self.flat.split((B, B, B, 2 * B, B * W))
        slots.fill_(pad_slot)     # all rows padding until a step copies its own in
        self.static = StepInputs(ids=ids.view(B, 1), positions=positions.view(B, 1), slots=slots,
                                 block_table=table.view(B, W), block_tokens=cache.block_tokens, max_len=max_model_len)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None
        self.ops = self.numerics = None       # the model's Ops and Numerics the graphs captured

    def _inputs(self, b: int) -> StepInputs:
        """The first b rows of the static inputs, as a fresh StepInputs (its per-step tables are
        recomputed from the buffers inside the graph)."""
        s = self.static
        return StepInputs(s.ids[:b], s.positions[:b], s.slots[:b], s.block_table[:b], s.block_tokens, s.max_len)

    @torch.inference_mode()
    def capture(self):
        """Capture (again, if the model's Ops changed) one graph per bucket."""
        t0 = time.perf_counter()
        free0 = torch.cuda.mem_get_info()[0]
        self.graphs, self.logits, self.pool = {}, {}, None
        s = self.static    # every row padding: the warm-up steps below must write nothing a sequence reads
        s.ids.zero_(), s.positions.zero_(), s.slots.fill_(self.pad_slot), s.block_table.zero_()
        for b in reversed(self.buckets):   # largest first: the others reuse its pool
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.model.forward_step(self._inputs(b), self.cache.layers)
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self.logits[b] = self.model.forward_step(self._inputs(b), self.cache.layers)
            self.pool = g.pool()
            self.graphs[b] = g
        torch.cuda.synchronize()
        self.ops, self.numerics = self.model.ops, self.model.numerics
        used = free0 - torch.cuda.mem_get_info()[0]
        log.info("captured %d decode graphs (batch %s) in %.1f s, %.1f MiB", len(self.graphs),
                 ",".join(map(str, self.buckets)), time.perf_counter() - t0, used / 2**20)

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def run(self, inp: StepInputs) -> torch.Tensor:
        """A decode step's inputs, padded to a bucket (engine.runner.step_inputs) -> logits [n, V]."""
        b, s = inp.ids.shape[0], self.static
        for dst, src in ((s.ids, inp.ids), (s.positions, inp.positions), (s.slots, inp.slots),
                         (s.block_table, inp.block_table)):
            dst[:b].copy_(src)
        return self.replay(b, inp.n)

    def replay(self, b: int, n: int) -> torch.Tensor:
        """Run bucket b on the static inputs as they are (the first n rows real) -> logits [n, V]."""
        if self.graphs and (self.model.ops is not self.ops or self.model.numerics != self.numerics):
            raise RuntimeError("the model's kernel set or numerics changed after its decode graphs were captured: "
                               "capture() again")
        if b not in self.graphs:   # not captured: the same padded batch, eagerly (what replay must equal)
            return self.model.forward_step(self._inputs(b), self.cache.layers)[:n]
        self.graphs[b].replay()
        return self.logits[b][:n]
