"""Turns a scheduler plan into model calls: batch metadata, the forward, the sampler."""
import torch

from .cache import KVCache
from .model.kv_cache import StepInputs
from .parallel.comm import share_ids
from .sampler import Sampler, SamplerOutput, SamplingBatch
from .sequence import Sequence
from .staging import DecodeStaging


class ModelRunner:
    def __init__(self, model, cache: KVCache, device):
        self.model, self.cache, self.device = model, cache, torch.device(device)
        self.sampler = Sampler()
        self.vocab_size, self.eos = model.cfg.vocab_size, model.cfg.eos_token_id
        self.logits_hook = None  # tests: (seqs, logits) of the rows that sampled, before their tokens append (core)
        self.broadcast = None    # tensor parallel: sends each step to the other ranks first
        self.shared = None       # tensor parallel, async scheduling: [max_num_seqs] long, where each
                                 # step's sampled ids go to every rank (share_sampled)
        self.graphs = None       # engine.graphs.DecodeGraphs once captured
        self.staging = None      # engine.staging.DecodeStaging over those graphs, made on first use

    # A step is described by a plain dict (host ints and lists) so that, under tensor
    # parallelism, rank 0 can send the same description to every rank (engine.rank).
    # Async scheduling: a row whose newest token is still on the device only (Sequence.pending)
    # gets a placeholder id 0 and, in step["src"] (one entry per token; -1: the host's id), that
    # token's row in `prev`, the in-flight step's sampled ids [B'] on the device.
    def prefill(self, chunks: list[tuple[Sequence, int, int]], all_logits: list[bool] | None = None,
                prev: torch.Tensor | None = None) -> torch.Tensor:
        """Feed each (seq, start, n) chunk's tokens [start, start+n), every chunk in one call (a
        decode row is the chunk (seq, num_total - 1, 1)) -> logits of each chunk's last token
        [B,V]; a chunk whose all_logits flag is set gives every one of its n instead (prompt
        logprobs), in chunk order: [L,V]."""
        ids, src = [], []
        for seq, a, n in chunks:
            gather = seq.pending > 0 and a >= seq.num_tokens   # only a decode row's pending token
            ids.append([0] if gather else seq.tokens[a:a + n])
            src += [seq.pending_row] if gather else [-1] * n
        step = {"ids": ids, "positions": [list(range(a, a + n)) for _, a, n in chunks],
                "slots": [seq.slot for seq, _, _ in chunks], "blocks": [seq.blocks for seq, _, _ in chunks],
                "starts": [a for _, a, _ in chunks], "reset": [seq.slot for seq, a, _ in chunks if a == 0]}
        if all_logits is not None and any(all_logits):
            step["all_logits"] = list(all_logits)  # in the step dict, so tensor-parallel ranks gather them too
        return self.execute(_with_src(step, src), prev)

    def decode(self, seqs: list[Sequence], prev: torch.Tensor | None = None) -> torch.Tensor:
        """Feed each sequence's newest token, all in one call -> logits [B,V]. With decode graphs
        (and no other rank to send the step to), the inputs are staged straight into the graphs'
        buffers (engine.staging), never built as a step dict."""
        if self.graphs is not None and self.broadcast is None and self.graphs.bucket(len(seqs)) is not None:
            if self.staging is None or self.staging.graphs is not self.graphs:
                self.staging = DecodeStaging(self.graphs)
            return self.graphs.replay(*self.staging.stage(seqs, prev))
        return self.execute(self.decode_step(seqs), prev)

    def decode_step(self, seqs: list[Sequence]) -> dict:
        """The step description of a decode step (see prefill)."""
        step = {"ids": [[0 if s.pending else s.output_ids[-1]] for s in seqs],
                "positions": [[s.num_total - 1] for s in seqs],
                "slots": [s.slot for s in seqs], "blocks": [s.blocks for s in seqs], "starts": None, "reset": []}
        return _with_src(step, [s.pending_row if s.pending else -1 for s in seqs])

    def execute(self, step: dict, prev: torch.Tensor | None = None) -> torch.Tensor:
        if self.broadcast is not None:
            if "src" in step and self.shared is None:
                raise RuntimeError("pending tokens under tensor parallelism need the sampled ids shared "
                                   "(LLM(async_scheduling=True) sets that up)")
            if self.shared is not None:   # every rank takes part in share_sampled after this step
                step["share"] = self.shared.numel()
            self.broadcast(step)
        return run_step(self.model, self.cache, step, self.device, self.graphs, prev)

    def share_sampled(self, token_ids: torch.Tensor | None):
        """Tensor parallel, async scheduling: this step's sampled ids [B] (None: it sampled none)
        to every rank, where the next step's pending tokens are gathered from (engine.rank's
        serve_steps takes part). A no-op otherwise. Device ops only: nothing waits on the host."""
        if self.shared is None:
            return
        if token_ids is not None:
            self.shared[:token_ids.numel()].copy_(token_ids)
        share_ids(self.shared)

    def sample(self, seqs: list[Sequence], logits: torch.Tensor, prev: torch.Tensor | None = None) -> SamplerOutput:
        """One sampler call for these rows. A row's pending token (in prev) counts as generated:
        in the seed's step counter and min_tokens, and, added on the device, in the penalties'
        counts, so that the tokens are exactly the synchronous path's."""
        steps = [len(s.output_ids) + s.pending for s in seqs]
        if all(s.params.argmax_only(n) for s, n in zip(seqs, steps)):
            # a greedy batch asking nothing else: one argmax, no batch tensors to build and copy
            # (on the raw logits: a float cast is exact and keeps every tie, so the same ids)
            return SamplerOutput(token_ids=logits.argmax(dim=-1))
        batch = SamplingBatch.build([s.params for s in seqs], [s.output_ids for s in seqs],
                                    [s.prompt_ids for s in seqs], vocab_size=self.vocab_size,
                                    device=self.device, eos_token_ids=[self.eos], steps=steps)
        rows = [i for i, s in enumerate(seqs) if s.pending]
        if rows and (batch.output_counts is not None or batch.seen_mask is not None):
            src = device_longs(self.device, [seqs[i].pending_row for i in rows])
            batch.count_tokens(device_longs(self.device, rows), prev.index_select(0, src))
        return self.sampler(logits.float(), batch)


def device_longs(device, values: list[int]) -> torch.Tensor:
    """Host ints -> a long tensor on device, with no host sync (pageable memory is staged at once)."""
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


def _with_src(step: dict, src: list[int]) -> dict:
    if any(i >= 0 for i in src):
        step["src"] = src
    return step


def step_inputs(step: dict, device, block_tokens: int, rows: int | None = None, width: int | None = None,
                pad_slot: int = 0, prev: torch.Tensor | None = None) -> StepInputs:
    """A step description -> its StepInputs, in one host-to-device copy. Decode (starts None): rows
    of one token, ids [B,1]; rows / width: pad to that many rows (the spare slot, position 0, the
    never-read block 0) and block-table columns, as a CUDA graph's static buffers are shaped.
    Prefill: the rows' chunks (any lengths) flattened into ids [1,T], never padded.
    step["src"] (async scheduling): per token, the row of prev [B'] (the last step's sampled ids,
    on the device) that holds its id, or -1; the gather is a device op, so nothing waits."""
    n = len(step["ids"])
    rows, width = rows or n, width or max(len(b) for b in step["blocks"])
    table = torch.zeros(rows, width, dtype=torch.long)              # padding: the never-read block 0
    lens_b = torch.tensor([len(b) for b in step["blocks"]])
    # every row's blocks at once (a row-major mask fill), not one small tensor per row: host time per step
    table[:n][torch.arange(width) < lens_b[:, None]] = torch.tensor([b for r in step["blocks"] for b in r], dtype=torch.long)
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
    src = step.get("src")
    parts = [torch.tensor(ids), torch.tensor(positions), torch.tensor(step["slots"] + [pad_slot] * pad), table.flatten()]
    if src is not None:
        parts.append(torch.tensor(src + [-1] * (len(ids) - len(src))))
    T = len(ids)
    host = torch.cat(parts)
    if torch.device(device).type == "cuda":   # pinned: the copy is queued, never waits on the step before
        host = host.pin_memory()
    ids, positions, slots, table, *src = host.to(device, non_blocking=True).split(
        (T, T, rows, rows * width) + ((T,) if src is not None else ()))
    if src:   # pending tokens: gathered from the previous step's sampled ids, on the device
        if prev is None:
            raise RuntimeError("a step with pending tokens needs the previous step's sampled ids")
        ids = torch.where(src[0] >= 0, prev.index_select(0, src[0].clamp(min=0)), ids)
    return StepInputs(ids=ids.view(shape), positions=positions.view(shape), slots=slots,
                      block_table=table.view(rows, width), block_tokens=block_tokens,
                      max_len=max(p[-1] for p in step["positions"]) + 1, starts=step["starts"], n=n, lens=lens)


def run_step(model, cache: KVCache, step: dict, device, graphs=None, prev: torch.Tensor | None = None) -> torch.Tensor:
    """Run one step description on this rank's model and cache -> logits [B,V] (prefill with
    all_logits: [L,V], engine.model.step.forward)."""
    for slot in step["reset"]:      # a sequence starts in this slot: empty its running state
        cache.reset_slot(slot)
    n = len(step["ids"])
    if graphs is not None and step["starts"] is None and graphs.bucket(n) is not None:
        inp = step_inputs(step, device, cache.block_tokens, rows=graphs.bucket(n), width=graphs.max_blocks,
                          pad_slot=cache.pad_slot, prev=prev)
        return graphs.run(inp)
    return model.forward_step(step_inputs(step, device, cache.block_tokens, prev=prev), cache.layers,
                              all_logits=step.get("all_logits", False))
