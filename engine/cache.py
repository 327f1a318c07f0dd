"""The KV cache: per-slot fixed state and a block pool for what grows with the sequence.

Capacity comes from a memory budget: the fixed state of `max_num_seqs` slots is taken
first, the rest becomes blocks of `block_tokens` positions (engine.model.kv_cache says
what a block holds). Blocks are handed out as sequences grow and given back when they
finish or are preempted; block 0 is reserved as the sink for writes that must not land.
"""
import math

import torch

from .model.config import ModelConfig
from .model.kv_cache import LayerCache
from .numerics import up_dtype


def default_block_tokens(cfg: ModelConfig) -> int:
    ratios = [r for r in cfg.compress_ratios if r] or [1]
    lcm = math.lcm(*ratios)
    return lcm * max(1, 64 // lcm)


class KVCache:
    def __init__(self, cfg: ModelConfig, max_num_seqs: int, memory_bytes: int, device, dtype,
                 block_tokens: int | None = None, num_blocks: int | None = None):
        self.cfg, self.device, self.dtype = cfg, torch.device(device), dtype
        self.block_tokens = block_tokens or default_block_tokens(cfg)
        # one spare slot past the scheduler's: the padding rows of a CUDA-graph batch write there
        self.max_num_seqs, self.pad_slot = max_num_seqs + 1, max_num_seqs
        for r in cfg.compress_ratios:
            if r and self.block_tokens % r:
                raise ValueError(f"block_tokens {self.block_tokens} is not a multiple of compress ratio {r}")
        fixed = self.slot_bytes() * self.max_num_seqs
        per_block = self.block_bytes()
        self.num_blocks = (memory_bytes - fixed) // max(per_block, 1) if per_block else 1 << 30
        if num_blocks is not None:  # tensor parallel: every rank takes rank 0's count
            self.num_blocks = num_blocks
        if self.num_blocks < 2:
            raise ValueError(f"kv_cache_memory {memory_bytes} B is too small: {fixed} B of per-sequence state "
                             f"for {max_num_seqs} sequences, then {per_block} B per block of {self.block_tokens} tokens")
        if not per_block and num_blocks is None:
            self.num_blocks = 1 << 20  # sliding-only model: blocks hold nothing, never run out
        self.layers = [self._layer(i) for i in range(cfg.n_layers)]
        self.free_blocks = list(range(self.num_blocks - 1, 0, -1))     # block 0 reserved
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))      # the pad slot is never handed out

    # ---- sizes ----
    def _shapes(self, layer: int) -> dict:
        cfg, W, bt = self.cfg, self.cfg.window_size, self.block_tokens
        r = cfg.ratio(layer)
        shapes = {"window": ((self.max_num_seqs, W, cfg.head_dim), self.dtype, "slot")}
        if r:
            coff = 2 if r == 4 else 1
            st = ((self.max_num_seqs, coff * r, coff * cfg.head_dim), up_dtype(self.dtype), "slot")
            shapes.update(kv=((bt // r, cfg.head_dim), self.dtype, "block"), kv_state=st, score_state=st)
        if r == 4:
            st = ((self.max_num_seqs, 2 * r, 2 * cfg.index_head_dim), up_dtype(self.dtype), "slot")
            shapes.update(idx_k=((bt // r, cfg.index_head_dim), self.dtype, "block"),
                          idx_kv_state=st, idx_score_state=st)
        return shapes

    def _bytes(self, kind: str) -> int:
        total = 0
        for layer in range(self.cfg.n_layers):
            for shape, dtype, k in self._shapes(layer).values():
                if k == kind:
                    n = math.prod(shape[1:]) if kind == "slot" else math.prod(shape)
                    total += n * torch.empty((), dtype=dtype).element_size()
        return total

    def slot_bytes(self) -> int:
        return self._bytes("slot")

    def block_bytes(self) -> int:
        return self._bytes("block")

    def _layer(self, layer: int) -> LayerCache:
        t = {}
        for name, (shape, dtype, kind) in self._shapes(layer).items():
            shape = (self.num_blocks, *shape) if kind == "block" else shape
            t[name] = torch.zeros(shape, dtype=dtype, device=self.device)
        return LayerCache(**t)

    # ---- allocation ----
    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_tokens)

    def can_allocate(self, n: int) -> bool:
        return len(self.free_blocks) >= n

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_blocks):
            raise RuntimeError("block pool exhausted")  # the scheduler checks first
        return [self.free_blocks.pop() for _ in range(n)]

    def free(self, blocks: list[int]):
        self.free_blocks.extend(reversed(blocks))

    def usage(self) -> float:
        return 1.0 - len(self.free_blocks) / max(self.num_blocks - 1, 1)

    def acquire_slot(self) -> int | None:
        return self.free_slots.pop() if self.free_slots else None

    def reset_slot(self, slot: int):
        """Empty a slot's compressor state (no kv, -inf scores) before a sequence starts in it.
        Every rank does this as part of the step, so only the scheduler's rank tracks slots."""
        for c in self.layers:
            for st, sc in ((c.kv_state, c.score_state), (c.idx_kv_state, c.idx_score_state)):
                if st is not None:
                    st[slot].zero_()
                    sc[slot].fill_(float("-inf"))

    def release_slot(self, slot: int):
        self.free_slots.append(slot)
