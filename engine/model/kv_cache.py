"""How attention state is laid out for the engine, and how it is addressed.

Per layer, per sequence slot (fixed size): the sliding-window ring (slot p % window)
and each compressor's running state (the raw kv/score of the open window, plus for
ratio 4 the previous window, whose A half the next entry still pools).
Per layer, in the shared block pool (grows with the sequence): compressed KV entries
(CSA, HCA) and indexer keys (CSA). A block covers `block_tokens` positions, so it holds
block_tokens / ratio entries of a ratio-r layer; entry e of a sequence lives in block
block_table[e // per_block] at offset e % per_block. Block 0 is never handed out: writes
that must not land (an entry that is not complete yet) go there, so a step needs no
data-dependent branch.
"""
from dataclasses import dataclass, field

import torch

from ..kernels.common import cos_sin, entry_loc  # noqa: F401 (entry_loc: the block-table addressing)


@dataclass
class LayerCache:
    window: torch.Tensor                       # [slots, W, Dh]
    kv: torch.Tensor | None = None             # [blocks, block_tokens // ratio, Dh]
    kv_state: torch.Tensor | None = None       # [slots, coff*ratio, coff*Dh] fp32
    score_state: torch.Tensor | None = None    # same, fp32, -inf where empty
    idx_k: torch.Tensor | None = None          # [blocks, block_tokens // 4, index_head_dim]
    idx_kv_state: torch.Tensor | None = None
    idx_score_state: torch.Tensor | None = None


@dataclass
class StepInputs:
    """One model call, built once per step (engine.runner.step_inputs) and read by the eager step
    and graph replay alike: B rows with S new tokens each (decode: S == 1). Rows from `n` on are
    padding (a spare slot, position 0, the never-read block 0): they write nothing a sequence reads."""
    ids: torch.Tensor           # [B,S] long, the new tokens
    positions: torch.Tensor     # [B,S] long, their absolute positions
    slots: torch.Tensor         # [B] long, the sequences' cache slots
    block_table: torch.Tensor   # [B, max_blocks] long
    block_tokens: int
    max_len: int                # host int: max over rows of (last position + 1); sizes the gathers
    starts: list[int] | None = None   # host ints, first position per row (prefill only)
    n: int | None = None        # real rows (None: all)
    shared: dict = field(default_factory=dict)   # what every layer of this step derives alike

    def once(self, key, make):
        """make() the first time this step asks for `key`, the same tensors after: per-step
        tables (rope angles, window and entry rows) that 43 layers would otherwise rebuild."""
        if key not in self.shared:
            self.shared[key] = make()
        return self.shared[key]

    def cos_sin(self, key: str, inv_freq: torch.Tensor, entry_ratio: int | None = None):
        """cos, sin [B,S,R/2] at this step's positions (entry_ratio r: at the start of each
        position's r-token window, where a compressed entry is roped), once per step and `key`:
        the layers share two frequency sets (plain, compressed), and the compressors of one
        ratio share their entries' positions."""
        pos = lambda: self.positions if entry_ratio is None else self.positions // entry_ratio * entry_ratio  # noqa: E731
        return self.once(("rope", key), lambda: cos_sin(pos(), inv_freq))

    @property
    def decode(self) -> bool:
        return self.positions.shape[1] == 1 and self.starts is None


