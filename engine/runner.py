"""Turns a scheduler plan into model calls: batch metadata, the forward, the sampler."""
import torch

from .cache import KVCache
from .model.kv_cache import StepInputs
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
    def prefill(self, chunks: list[tuple[Sequence, int, int]], all_logits: list[bool] | None = None) -> torch.Tensor:
        """Feed each (seq, start, n) chunk's tokens [start, start+n), every chunk in one call (a
        decode row is the chunk (seq, num_tokens - 1, 1)) -> logits of each chunk's last token
        [B,V]; a chunk whose all_logits flag is set gives every one of its n instead (prompt
        logprobs), in chunk order: [L,V]."""
        step = {"ids": [seq.tokens[a:a + n] for seq, a, n in chunks],
                "positions": [list(range(a, a + n)) for _, a, n in chunks],
                "slots": [seq.slot for seq, _, _ in chunks], "blocks": [seq.blocks for seq, _, _ in chunks],
                "starts": [a for _, a, _ in chunks], "reset": [seq.slot for seq, a, _ in chunks if a == 0]}
        if all_logits is not None and any(all_logits):
            step["all_logits"] = list(all_logits)  # in the step dict, so tensor-parallel ranks gather them too
        return self.execute(step)

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


def step_inputs(step: dict, device, block_tokens: int, rows: int | None = None, width: int | None = None,
                pad_slot: int = 0) -> StepInputs:
    """A step description -> its StepInputs, in one host-to-device copy. Decode (starts None): rows
    of one token, ids [B,1]; rows / width: pad to that many rows (the spare slot, position 0, the
    never-read block 0) and block-table columns, as a CUDA graph's static buffers are shaped.
    Prefill: the rows' chunks (any lengths) flattened into ids [1,T], never padded."""
    n = len(step["ids"])
    rows, width = rows or n, width or max(len(b) for b in step["blocks"])
    table = torch.zeros(rows, width, dtype=torch.long)              # padding: the never-read block 0
    for i, blocks in enumerate(step["blocks"]):
        table[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.long)
    pad = rows - n
    flat = step["starts"] is not None
    if flat:
        lens = [len(r) for r in step["ids"]]
        ids = [t for r in step["ids"] for t in r]
        positions = [p for r in step["positions"] for p in r]
        shape = (1, len(ids))
    else:
        lens, ids = None, [r[0] for r in step["ids"]] + [0] * pad
        positions, shape = [r[0] for r in step["positions"]] + [0] * pad, (rows, 1)
    host = torch.cat((torch.tensor(ids), torch.tensor(positions),
                      torch.tensor(step["slots"] + [pad_slot] * pad), table.flatten()))
    T = len(ids)
    ids, positions, slots, table = host.to(device, non_blocking=True).split((T, T, rows, rows * width))
    return StepInputs(ids=ids.view(shape), positions=positions.view(shape), slots=slots,
                      block_table=table.view(rows, width), block_tokens=block_tokens,
                      max_len=max(p[-1] for p in step["positions"]) + 1, starts=step["starts"], n=n, lens=lens)


def run_step(model, cache: KVCache, step: dict, device, graphs=None) -> torch.Tensor:
    """Run one step description on this rank's model and cache -> logits [B,V] (prefill with
    all_logits: [L,V], engine.model.step.forward)."""
    for slot in step["reset"]:      # a sequence starts in this slot: empty its running state
        cache.reset_slot(slot)
    n = len(step["ids"])
    if graphs is not None and step["starts"] is None and graphs.bucket(n) is not None:
        inp = step_inputs(step, device, cache.block_tokens, rows=graphs.bucket(n), width=graphs.max_blocks,
                          pad_slot=cache.pad_slot)
        return graphs.run(inp)
    return model.forward_step(step_inputs(step, device, cache.block_tokens), cache.layers,
                              all_logits=step.get("all_logits", False))
