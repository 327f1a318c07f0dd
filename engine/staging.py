"""A decode step's inputs, staged straight into the decode graphs' static buffers.

engine.runner.step_inputs builds a step from scratch: lists of every row's ids, positions and
blocks, a fresh table, a fresh pinned tensor, and then a copy per static buffer. At B=64 that is
most of the host's time per decode step. Here a decode step writes into a host buffer laid out
as DecodeGraphs.flat ([ids | positions | slots | pending rows, their sources | block table]) and
is sent with one host-to-device copy. Block-table rows are written incrementally: a row is
rewritten only where its sequence or its block count changed since the buffer last held it
(a sequence's blocks only grow in place; a release gives it a new list).

Async scheduling: a row whose token is pending (Sequence.pending) gets it from `prev`, the
in-flight step's sampled ids, by one copy where every row's token sits in its own row of prev
(the batch did not change), else by a gather and an index_copy_ into the static ids: as
step_inputs' where-gather, with nothing waiting on the host.

Two host buffers take turns: a buffer is rewritten two decode steps later, when the host has
read the tokens of the step that used it, so its copy has run (every decode step samples and is
read before the step after next is built). Its event makes that a checked fact, never a wait.
"""
import numpy as np
import torch

from .sequence import Sequence


class _HostBuffer:
    def __init__(self, size: int, B: int, W: int, pin: bool):
        self.tensor = torch.zeros(size, dtype=torch.long, pin_memory=pin)
        a = self.tensor.numpy()
        self.ids, self.positions, self.slots = a[:B], a[B:2 * B], a[2 * B:3 * B]
        self.rows, self.src, self.table = a[3 * B:4 * B], a[4 * B:5 * B], a[5 * B:].reshape(B, W)
        self.owner: list[list[int] | None] = [None] * B   # the blocks list each table row holds
        self.held = [0] * B                               # how many of its entries are written
        self.event = torch.cuda.Event() if pin else None

    def table_row(self, i: int, blocks: list[int] | None):
        """Make table row i hold `blocks` (None: padding, all block 0), writing only what changed."""
        n, old = (0 if blocks is None else len(blocks)), self.held[i]
        if self.owner[i] is blocks and n >= old:          # the same list, grown (or not) in place
            if n > old:
                self.table[i, old:n] = blocks[old:]
        else:
            if n:
                self.table[i, :n] = blocks
            if old > n:
                self.table[i, n:old] = 0
        self.owner[i], self.held[i] = blocks, n


class DecodeStaging:
    def __init__(self, graphs):
        self.graphs = graphs
        self.B, self.W = graphs.buckets[-1], graphs.max_blocks
        pin = graphs.flat.device.type == "cuda"
        self.bufs = [_HostBuffer(graphs.flat.numel(), self.B, self.W, pin) for _ in range(2)]
        self.turn = 0
        self.pad_slot = graphs.pad_slot
        self.arange = list(range(self.B))

    def stage(self, seqs: list[Sequence], prev: torch.Tensor | None) -> tuple[int, int]:
        """Copy the decode step of `seqs` (one newest token each) into the static inputs, padded
        to its bucket -> (bucket, rows) for DecodeGraphs.replay."""
        n = len(seqs)
        b = self.graphs.bucket(n)
        buf = self.bufs[self.turn]
        self.turn ^= 1
        if buf.event is not None:
            buf.event.synchronize()   # recorded two decode steps ago, whose tokens have been read: done
        # a few comprehensions (each one pass in C-speed bytecode), not one loop of many appends
        ids = [0 if s.pending else s.output_ids[-1] for s in seqs]
        positions = [s.num_computed for s in seqs]      # a decode row: all but its newest token cached
        slots = [s.slot for s in seqs]
        src = [s.pending_row if s.pending else -1 for s in seqs]
        owner, held = buf.owner, buf.held
        for i, s in enumerate(seqs):
            if owner[i] is not s.blocks or held[i] != len(s.blocks):
                buf.table_row(i, s.blocks)
        for i in range(n, b):        # padding: the spare slot, position 0, the never-read block 0
            if buf.owner[i] is not None:
                buf.table_row(i, None)
        buf.ids[:n], buf.positions[:n], buf.slots[:n] = ids, positions, slots
        buf.ids[n:b], buf.positions[n:b], buf.slots[n:b] = 0, 0, self.pad_slot
        aligned = src == self.arange[:n]   # every row's token pending in its own row of prev (an unchanged batch)
        if aligned:
            k = n
        else:
            pend_rows = [i for i, r in enumerate(src) if r >= 0]
            k = len(pend_rows)
            buf.rows[:k], buf.src[:k] = pend_rows, [src[i] for i in pend_rows]
        size = 5 * self.B + b * self.W           # the table rows past the bucket are not read
        flat = self.graphs.flat
        flat[:size].copy_(buf.tensor[:size], non_blocking=True)
        if buf.event is not None:
            buf.event.record()
        if k:   # pending tokens: gathered from the previous step's sampled ids, on the device
            if prev is None:
                raise RuntimeError("a step with pending tokens needs the previous step's sampled ids")
            static_ids = self.graphs.static.ids.view(-1)
            if aligned:   # the steady state: one copy, not a gather and a scatter
                static_ids[:n].copy_(prev[:n])
            else:
                spare = self.graphs.spare
                static_ids.index_copy_(0, spare[:k], prev.index_select(0, spare[self.B:self.B + k]))
        return b, n
