"""Turns a scheduler plan into model calls: batch metadata, the forward, the sampler."""
import torch

from .cache import KVCache
from .model.kv_cache import StepContext
from .sampler import Sampler, SamplerOutput, SamplingBatch
from .sequence import Sequence


class ModelRunner:
    def __init__(self, model, cache: KVCache, device):
        self.model, self.cache, self.device = model, cache, torch.device(device)
        self.sampler = Sampler()
        self.vocab_size, self.eos = model.cfg.vocab_size, model.cfg.eos_token_id
        self.logits_hook = None  # tests: called with (seqs, logits) before sampling

    def _block_table(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max(len(s.blocks) for s in seqs)
        rows = [s.blocks + [0] * (width - len(s.blocks)) for s in seqs]   # pad: the never-read block 0
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def prefill(self, seq: Sequence, start: int, n: int) -> torch.Tensor:
        """Feed seq's tokens [start, start+n) -> logits of the last one [1,V]."""
        ids = torch.tensor([seq.tokens[start:start + n]], device=self.device)
        ctx = StepContext(
            slots=torch.tensor([seq.slot], device=self.device),
            positions=torch.arange(start, start + n, device=self.device)[None],
            block_table=self._block_table([seq]), block_tokens=self.cache.block_tokens,
            max_len=start + n, starts=[start])
        return self.model.forward_step(ids, ctx, self.cache.layers)

    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """Feed each sequence's newest token, all in one call -> logits [B,V]."""
        ids = torch.tensor([[s.output_ids[-1]] for s in seqs], device=self.device)
        pos = torch.tensor([[s.num_tokens - 1] for s in seqs], device=self.device)
        ctx = StepContext(
            slots=torch.tensor([s.slot for s in seqs], device=self.device), positions=pos,
            block_table=self._block_table(seqs), block_tokens=self.cache.block_tokens,
            max_len=max(s.num_tokens for s in seqs))
        return self.model.forward_step(ids, ctx, self.cache.layers)

    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> SamplerOutput:
        if self.logits_hook is not None:
            self.logits_hook(seqs, logits)
        batch = SamplingBatch.build([s.params for s in seqs], [s.output_ids for s in seqs],
                                    [s.prompt_ids for s in seqs], vocab_size=self.vocab_size,
                                    device=self.device, eos_token_ids=[self.eos])
        return self.sampler(logits.float(), batch)
