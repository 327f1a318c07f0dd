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
        self.broadcast = None    # tensor parallel: sends each step to the other ranks first
        self.graphs = None       # engine.graphs.DecodeGraphs once captured

    # A step is described by a plain dict (host ints and lists) so that, under tensor
    # parallelism, rank 0 can send the same description to every rank (engine.rank).
    def prefill(self, seq: Sequence, start: int, n: int) -> torch.Tensor:
        """Feed seq's tokens [start, start+n) -> logits of the last one [1,V]."""
        return self.execute({
            "ids": [seq.tokens[start:start + n]], "positions": [list(range(start, start + n))],
            "slots": [seq.slot], "blocks": [seq.blocks], "starts": [start],
            "reset": [seq.slot] if start == 0 else []})

    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """Feed each sequence's newest token, all in one call -> logits [B,V]."""
        return self.execute({
            "ids": [[s.output_ids[-1]] for s in seqs], "positions": [[s.num_tokens - 1] for s in seqs],
            "slots": [s.slot for s in seqs], "blocks": [s.blocks for s in seqs], "starts": None, "reset": []})

    def execute(self, step: dict) -> torch.Tensor:
        if self.broadcast is not None:
            self.broadcast(step)
        return run_step(self.model, self.cache, step, self.device, self.graphs)

    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> SamplerOutput:
        if self.logits_hook is not None:
            self.logits_hook(seqs, logits)
        batch = SamplingBatch.build([s.params for s in seqs], [s.output_ids for s in seqs],
                                    [s.prompt_ids for s in seqs], vocab_size=self.vocab_size,
                                    device=self.device, eos_token_ids=[self.eos])
        return self.sampler(logits.float(), batch)


def run_step(model, cache: KVCache, step: dict, device, graphs=None) -> torch.Tensor:
    """Run one step description on this rank's model and cache -> logits [B,V]."""
    for slot in step["reset"]:      # a sequence starts in this slot: empty its running state
        cache.reset_slot(slot)
    if graphs is not None and step["starts"] is None and graphs.bucket(len(step["ids"])) is not None:
        return graphs.run(step)
    width = max(len(b) for b in step["blocks"])
    table = [b + [0] * (width - len(b)) for b in step["blocks"]]   # pad: the never-read block 0
    positions = torch.tensor(step["positions"], device=device)
    ctx = StepContext(
        slots=torch.tensor(step["slots"], device=device), positions=positions,
        block_table=torch.tensor(table, dtype=torch.long, device=device), block_tokens=cache.block_tokens,
        max_len=max(p[-1] for p in step["positions"]) + 1, starts=step["starts"])
    return model.forward_step(torch.tensor(step["ids"], device=device), ctx, cache.layers)
