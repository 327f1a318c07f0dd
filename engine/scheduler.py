"""Continuous batching: who runs this step.

Each step runs every sequence that is past its prefill (one token each) and, within a token
budget (`max_num_batched_tokens`, the decode rows counted first), prefill chunks of as many
sequences as fit: first those already running (the next chunk of a long prompt, or a
preempted sequence's recompute), then the waiting queue in order. A chunk is at most
`chunk_size` tokens (default: the whole budget). A chunk may run past the budget by up to the
step's decode rows to finish its prompt, so that a prompt which fits the budget alone is not cut
to leave a tail of that many tokens for a step of its own (an eager prefill step costs its
launches whatever its size); the step's prefill tokens stay within the budget. The runner feeds
all of it to the model in one call.
Cache blocks are taken as sequences grow; when the pool runs dry the most recently
arrived running sequence is preempted (its cache freed, its tokens recomputed later).
A prefill never preempts: it waits for blocks.

Under async scheduling a sequence may have a token sampled on the device that the host has
not read yet (Sequence.pending): the plan counts it (the next decode row feeds it, gathered on
the device), leaves out a sequence that this token surely finishes (max_tokens, the context),
and never gives a chunk to a sequence with pending tokens (a recompute needs their values).
"""
from collections import deque
from dataclasses import dataclass, field

from .cache import KVCache
from .sequence import Sequence, Status


@dataclass
class Plan:
    # (seq, first position, token count): one chunk per sequence, running ones first
    prefill: list[tuple[Sequence, int, int]] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)  # ended by the scheduler (no room ever)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


PROMPT_LOGITS_TOKENS = 512   # prompt tokens a step may return logits for: 512 x 129280 x 4 B = 265 MB


class Scheduler:
    def __init__(self, cache: KVCache, max_num_seqs: int, max_model_len: int, chunk_size: int | None = None,
                 max_waiting: int | None = None, max_num_batched_tokens: int = 8192):
        if max_num_batched_tokens < max_num_seqs:   # else the decode rows alone could starve every prefill
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({max_num_seqs})")
        self.cache, self.max_num_seqs, self.max_model_len = cache, max_num_seqs, max_model_len
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        # None: one prompt may take the whole budget (an 8k prompt in one step: bench/RESULTS.md)
        self.chunk_size, self.max_waiting = chunk_size or max_num_batched_tokens, max_waiting
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def logit_tokens(self) -> int:
        """Prompt-logprob chunks share fewer tokens a step: each costs a [V] fp32 logits row."""
        return min(self.chunk_size, PROMPT_LOGITS_TOKENS)

    def add(self, seq: Sequence):
        if len(seq.prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(seq.prompt_ids)} tokens does not fit max_model_len {self.max_model_len}")
        if self.cache.blocks_needed(len(seq.prompt_ids) + 1) > self.cache.num_blocks - 1:
            raise ValueError(f"prompt of {len(seq.prompt_ids)} tokens does not fit the KV cache")
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the plan for one step ----
    def schedule(self) -> Plan:
        plan = Plan()
        plan.decode = self._grow_decoders(plan)
        plan.prefill = self._prefills(self.max_num_batched_tokens - len(plan.decode),
                                      len(plan.decode) < len(self.running), slack=len(plan.decode))
        return plan

    def _decoders(self) -> tuple[list[Sequence], list[int]]:
        """The running sequences that decode this step, and the blocks each still needs for its
        next token. A sequence decodes when all but its newest token (maybe pending) are cached
        (Sequence.in_decode) and it is not capped: its pending token ends it by length once the
        host reads it, so it gets no step now. One pass: it runs over every row every step."""
        decoders, needs, need_for, max_len = [], [], self.cache.blocks_needed, self.max_model_len
        for s in self.running:
            if not s.in_decode:
                continue
            n_out, n = len(s.output_ids), s.pending
            total = len(s.prompt_ids) + n_out + n
            if n and (s.params.max_tokens is not None and n_out + n >= s.params.max_tokens or total >= max_len):
                continue   # capped
            decoders.append(s)
            needs.append(need_for(total) - len(s.blocks))
        return decoders, needs

    def _grow_decoders(self, plan: Plan) -> list[Sequence]:
        """Every decoding sequence needs blocks for one more token; preempt until they fit ->
        the sequences that decode this step, in running order."""
        decoders, needs = self._decoders()
        if self.cache.can_allocate(sum(n for n in needs if n > 0)):   # room for all (the common case): no sort
            for seq, need in zip(decoders, needs):
                if need > 0:
                    seq.blocks += self.cache.allocate(need)
            return decoders
        ready = set()
        for seq, need in sorted(zip(decoders, needs), key=lambda d: d[0].arrival):
            if seq.status is not Status.RUNNING:
                continue  # preempted while making room for an earlier one (its own blocks never change else)
            while need > 0 and not self.cache.can_allocate(need):
                victim = max(self.running, key=lambda s: s.arrival)
                if victim is seq and len(self.running) == 1:
                    if not seq.pending:   # (a pending token is still its own: end it once that is read)
                        self.finish(seq, "length")  # alone and still no room: the pool is this small
                        plan.finished.append(seq)
                    break
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING or need > 0 and not self.cache.can_allocate(need):
                continue   # preempted, ended, or alone with a pending token and no room (it waits)
            if need > 0:
                seq.blocks += self.cache.allocate(need)
            ready.add(id(seq))
        return [s for s in self.running if id(s) in ready]

    def _prefills(self, budget: int, partial: bool = True, slack: int = 0) -> list[tuple[Sequence, int, int]]:
        """Chunks within `budget` tokens: running sequences' next chunks, then new ones from the
        waiting queue while slots last. Stops at the first that has no blocks (first come, first
        served: a later, smaller prompt does not overtake it). Chunks that may record prompt
        logprobs share at most logit_tokens a step (chunk_size, at most PROMPT_LOGITS_TOKENS): each
        of their tokens costs a [V] fp32 logits row. partial: whether any running sequence is not
        decoding this step (else, the steady state, none has a chunk to look for). slack: tokens
        past the budget a chunk may take to finish its prompt (the decode rows'), once in all."""
        chunks, logit_room = [], self.logit_tokens
        queue = [s for s in self.running if s.num_computed < s.num_tokens and not s.in_decode] if partial else []
        while budget > 0:
            if queue:
                seq = queue.pop(0)
            elif (self.waiting and len(self.running) < self.max_num_seqs and self.cache.free_slots
                  and not self.waiting[0].pending):   # a preempted sequence's last token is not read yet
                seq = self.waiting[0]
            else:
                break
            logits = seq.prompt_logprobs is not None and seq.num_computed < len(seq.prompt_ids)
            cap = min(budget, logit_room) if logits else budget
            if cap == 0 or (chunk := self._chunk(seq, cap, 0 if logits else slack)) is None:
                break
            chunks.append(chunk)
            slack -= max(0, chunk[2] - cap)
            budget -= chunk[2]
            logit_room -= chunk[2] if logits else 0
        return chunks

    def _chunk(self, seq: Sequence, budget: int, slack: int = 0) -> tuple[Sequence, int, int] | None:
        """seq's next chunk of at most `budget` tokens (`slack` more where that finishes its prompt),
        its blocks taken (a waiting sequence is admitted: slot, running) -> (seq, start, n), or None
        where the pool has no room for it."""
        rest = seq.num_tokens - seq.num_computed
        n = min(self.chunk_size, rest, budget)
        if n < rest <= min(self.chunk_size, budget + slack):
            n = rest
        need = self.cache.blocks_needed(seq.num_computed + n) - len(seq.blocks)
        if need > 0 and not self.cache.can_allocate(need):
            return None  # wait for decoders to finish; never preempt for a prefill
        if seq.status is Status.WAITING:
            self.waiting.popleft()
            seq.slot = self.cache.acquire_slot()
            seq.status = Status.RUNNING
            self.running.append(seq)
        if need > 0:
            seq.blocks += self.cache.allocate(need)
        return seq, seq.num_computed, n

    # ---- state changes ----
    def preempt(self, seq: Sequence):
        self._release(seq)
        seq.status, seq.num_computed = Status.WAITING, 0
        seq.preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str):
        if seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason

    def _release(self, seq: Sequence):
        if seq in self.running:
            self.running.remove(seq)
        if seq.blocks:
            self.cache.free(seq.blocks)
            seq.blocks = []
        if seq.slot is not None:
            self.cache.release_slot(seq.slot)
            seq.slot = None
