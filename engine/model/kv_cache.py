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
import itertools
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
    and graph replay alike. Two layouts:

    decode (starts None): B rows of one new token each, ids [B,1]. Rows from `n` on are padding
    (a spare slot, position 0, the never-read block 0): they write nothing a sequence reads.

    prefill (starts given): B rows' chunks of different lengths, flattened (varlen): ids
    [1,T], row b's lens[b] tokens at positions starts[b].. follow row b-1's, T = sum(lens).
    A decode row may ride along as a chunk of one token (a mixed step). No padding."""
    ids: torch.Tensor           # [B,1] (decode) or [1,T] (prefill) long, the new tokens
    positions: torch.Tensor     # same shape, long, their absolute positions
    slots: torch.Tensor         # [B] long, the sequences' cache slots
    block_table: torch.Tensor   # [B, max_blocks] long
    block_tokens: int
    max_len: int                # host int: max over rows of (last position + 1); sizes the gathers
    starts: list[int] | None = None   # host ints, first position per row (prefill only)
    n: int | None = None        # real rows (None: all)
    lens: list[int] | None = None     # host ints, tokens per row (prefill; None: one row of all T)
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

    # ---- prefill's per-token tables: built from the host lists on first use (a few small
    # host-to-device copies per prefill step; decode and graph replay never build them), then
    # shared by every layer ----
    @property
    def row_lens(self) -> list[int]:
        return self.lens if self.lens is not None else [self.ids.shape[1]]

    @property
    def offsets(self) -> list[int]:
        """Each row's first token in the flat [T] layout."""
        return self.once("offsets", lambda: list(itertools.accumulate(self.row_lens[:-1], initial=0)))

    def _host(self, key, make) -> torch.Tensor:
        return self.once(key, lambda: torch.tensor(make(), dtype=torch.long, device=self.ids.device))

    def token_rows(self) -> torch.Tensor:
        """[T]: each token's row."""
        return self._host("token rows", lambda: [b for b, n in enumerate(self.row_lens) for _ in range(n)])

    def token_starts(self) -> torch.Tensor:
        """[T]: the first position of each token's row (its chunk starts there)."""
        return self._host("token starts", lambda: [s for s, n in zip(self.starts, self.row_lens) for _ in range(n)])

    def token_slots(self) -> torch.Tensor:
        """[T]: each token's cache slot."""
        return self.once("token slots", lambda: self.slots[self.token_rows()])

    def token_table(self) -> torch.Tensor:
        """[T, max_blocks]: each token's block table row."""
        return self.once("token table", lambda: self.block_table[self.token_rows()])

    def ring_tokens(self, W: int) -> torch.Tensor:
        """[K]: the tokens whose keys stay in a W-row window ring after this step: each row's last W."""
        return self._host(("ring tokens", W), lambda: [o + i for o, n in zip(self.offsets, self.row_lens)
                                                        for i in range(max(0, n - W), n)])

    def ring_writes(self, W: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (ring_tokens(W) [K], their flat rows slot * W + position % W of a [slots*W, d] ring),
        once per step: every sliding layer writes its ring alike."""
        def make():
            t = self.ring_tokens(W)
            return t, self.token_slots()[t] * W + self.positions[0, t] % W
        return self.once(("ring writes", W), make)

    def single_rows(self) -> list[int]:
        """Rows of one token (decode rows of a mixed step, a prompt's one-token tail): the
        compressor feeds them all at once with its decode op."""
        return [b for b, n in enumerate(self.row_lens) if n == 1]

    def multi_rows(self) -> list[int]:
        """Rows of more than one token: the compressor's torch prefill takes them all at once (varlen)."""
        return [b for b, n in enumerate(self.row_lens) if n > 1]

    def single_tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The one-token rows' tokens [m] in the flat layout, and those rows [m]."""
        offsets = self.offsets
        return (self._host("single tokens", lambda: [offsets[b] for b in self.single_rows()]),
                self._host("single rows", self.single_rows))

    def logit_tokens(self, all_logits) -> torch.Tensor:
        """The tokens whose logits the step returns, in row order: each row's last, or every one
        of a row whose all_logits flag is set (all_logits: a bool for every row, or one per row)."""
        return self._host(("logit tokens", tuple(self._flags(all_logits))), lambda: self.logit_token_list(all_logits))

    def logit_token_list(self, all_logits) -> list[int]:
        """logit_tokens as host ints."""
        return [t for o, n, f in zip(self.offsets, self.row_lens, self._flags(all_logits))
                for t in (range(o, o + n) if f else [o + n - 1])]

    def _flags(self, all_logits) -> list[bool]:
        return list(all_logits) if isinstance(all_logits, (list, tuple)) else [all_logits] * len(self.row_lens)
