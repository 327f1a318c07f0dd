"""The engine loop's body: add requests, run one step, collect what each request produced.

One step = one scheduler plan = one model call: every decoding sequence's next token and the
prefill chunks the token budget admits, together (a decode-only step replays a CUDA graph);
then one sampler call for every row that produced a token. After sampling, each sequence's
new token is detokenized incrementally and checked against EOS, stop ids, stop strings,
max_tokens and the context length.

Async scheduling (async_scheduling=True) reorders the same work: a step is launched (the plan,
the model call, the sampler: no host sync) before the previous step's tokens are read, and
those are then appended, detokenized and stop-checked while the device runs the new step
(engine.inflight). The plan counts each sequence's unread token (Sequence.pending) and the
model gathers it on the device. A sequence that its unread token ends (EOS, a stop id or
string, an abort) has been given one step too many: that row's token is dropped when read,
never emitted. Its cache is freed right away, as every later use of its slot and blocks is a
later step on the same stream. Off, each step's tokens are read before step() returns.
"""
import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from .cache import KVCache
from .inflight import HostBuffers, HostTokens, InFlight
from .runner import ModelRunner, device_longs
from .sampler import SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence, Status

log = logging.getLogger(__name__)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: dict = field(default_factory=dict)
    # with SamplingParams.prompt_logprobs: one entry per prompt token, the first None; and the
    # rank of each prompt token in its position's distribution (1 = the model's best)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int | None] | None = None

    # the first sample, for the common n == 1 case
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    seqs: list[Sequence]
    arrival: float
    first_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


class EngineOverloaded(RuntimeError):
    """The waiting queue is over its limit (a server answers 503)."""


class EngineCore:
    def __init__(self, model, tokenizer, cache: KVCache, max_num_seqs: int, max_model_len: int,
                 chunk_size: int | None = None, max_waiting: int | None = None, max_num_batched_tokens: int = 8192,
                 async_scheduling: bool = False):
        self.model, self.tokenizer, self.cache = model, tokenizer, cache
        self.async_scheduling = async_scheduling
        self.inflight: InFlight | None = None   # the launched step whose tokens the host has not read
        self.host = HostBuffers(cache.device)   # where launched steps' tokens are copied to, reused
        self.max_model_len = max_model_len
        self.scheduler = Scheduler(cache, max_num_seqs, max_model_len, chunk_size, max_waiting, max_num_batched_tokens)
        self.runner = ModelRunner(model, cache, cache.device)
        self.requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0}
        self._last_step = None      # perf_counter at the previous step's start (the debug step trace)
        self.driver = None  # the AsyncEngine whose thread steps this core, if any

    # ---- requests ----
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = params or SamplingParams()
        limit = self.scheduler.max_waiting
        if limit is not None and len(self.scheduler.waiting) >= limit:
            raise EngineOverloaded(f"{len(self.scheduler.waiting)} requests are waiting (limit {limit})")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer: this engine was built with "
                                 "skip_tokenizer_init=True; pass token ids instead")
            text, ids = prompt, self.tokenizer.encode(prompt, add_bos=True)
        else:
            text, ids = None, [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt is empty")
        if self.tokenizer is None and params.stop:
            raise ValueError("stop strings need a tokenizer (skip_tokenizer_init=True); use stop_token_ids")
        vocab = self.model.cfg.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already running")
        now = time.monotonic()
        seqs = [Sequence(rid, i, list(ids), params.for_child(i) if params.n > 1 else params, arrival=now,
                         detok=self._detokenizer(params)) for i in range(params.n)]
        if params.prompt_logprobs is not None:
            shared, ranks = [None], [None]
            for s in seqs:
                s.prompt_logprobs, s.prompt_ranks = shared, ranks
        for s in seqs:
            self.scheduler.add(s)
        self.requests[rid] = _Request(rid, text, list(ids), seqs, now)
        self.stats["prompt_tokens"] += len(ids)
        return rid

    def _detokenizer(self, params: SamplingParams):
        if self.tokenizer is None:   # token ids only: outputs carry empty text
            return None
        from .tokenizer import IncrementalDetokenizer

        return IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens)

    def abort(self, request_id: str) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        for s in req.seqs:
            if not s.finished:
                self.scheduler.finish(s, "abort")
        return True

    def has_unfinished(self) -> bool:
        """Requests to serve, or a launched step still to read (its rows may all be dropped)."""
        return bool(self.requests) or self.inflight is not None

    # ---- one step ----
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Plan and launch a step; read the tokens of the step before it (async scheduling) or
        of this one -> the outputs of the requests that advanced or ended."""
        touched = set()
        if self.inflight is not None and not self.async_scheduling:   # switched off with a step in flight
            self._read(self.inflight, touched)
            self.inflight = None
        plan = self.scheduler.schedule()
        if log.isEnabledFor(logging.DEBUG):
            self._trace(plan)
        touched |= {s.request_id for s in plan.finished}
        launched = None if plan.empty else self._launch(plan, touched)
        done, self.inflight = (self.inflight, launched) if self.async_scheduling else (launched, None)
        if done is not None:
            self._read(done, touched)
        return self._collect(touched)

    def _trace(self, plan):
        """--log-level debug: one line a step, what it carries and the wall time since the last
        one began (the pace of the loop: device time when the host waits on the step before)."""
        now = time.perf_counter()
        gap = f"{(now - self._last_step) * 1e3:.1f} ms after the last" if self._last_step is not None else "first"
        self._last_step = now
        chunks = [n for _, _, n in plan.prefill]
        log.debug("step: %d decode rows, %d prefill chunks (%d tokens: %s), %d waiting; %s", len(plan.decode),
                  len(chunks), sum(chunks), chunks[:8], len(self.scheduler.waiting), gap)

    def _launch(self, plan, touched: set[str]) -> InFlight | None:
        """The plan's model call and sampler call, queued on the device -> its sampled rows."""
        prev = self.inflight.token_ids if self.inflight is not None else None
        logits = self._forward(plan, prev)                            # [rows,V]: decode rows, then chunks
        for seq in plan.decode:
            seq.num_computed += 1
        rows = [(seq, i) for i, seq in enumerate(plan.decode)]        # (sequence, its logits row) that sample
        for i, (seq, start, n) in enumerate(plan.prefill, len(plan.decode)):
            seq.num_computed = start + n
            if seq.num_computed < seq.num_tokens:           # more of the prompt to come
                continue
            if seq.params.max_tokens == 0:                  # prefill only (prompt logprobs)
                self.scheduler.finish(seq, "length")
                touched.add(seq.request_id)
            else:
                rows.append((seq, i))
        if not rows:
            self.runner.share_sampled(None)              # tensor parallel: the other ranks wait for it
            return None
        seqs, idx = [s for s, _ in rows], [i for _, i in rows]
        logits = logits if len(idx) == logits.shape[0] else _take(logits, idx)
        out = self.runner.sample(seqs, logits, prev)
        self.runner.share_sampled(out.token_ids)         # tensor parallel: the next step's pending ids
        for i, seq in enumerate(seqs):
            seq.pending, seq.pending_row = seq.pending + 1, i
        return InFlight(seqs, out, logits.clone() if self.runner.logits_hook is not None else None, self.host)

    def _read(self, step: InFlight, touched: set[str]):
        """Read a launched step's tokens and append them; rows of sequences that ended since
        it was launched are dropped."""
        got = step.read()
        live = []
        for i, seq in enumerate(step.seqs):
            seq.pending -= 1
            if seq.pending == 0:
                seq.pending_row = -1
            if seq.status is not Status.FINISHED:
                live.append(i)
        if self.runner.logits_hook is not None and live:
            self.runner.logits_hook([step.seqs[i] for i in live], step.logits[live])
        self.stats["generation_tokens"] += len(live)
        for i in live:
            seq = step.seqs[i]
            self._append(seq, got, i)
            touched.add(seq.request_id)

    def _forward(self, plan, prev: torch.Tensor | None) -> torch.Tensor:
        """The plan's one model call -> logits of each row's last token [rows,V] (decode rows
        first), recording the prompt logprobs a chunk carries on the way. prev: the in-flight
        step's sampled ids, where pending tokens are read from on the device."""
        if not plan.prefill:
            return self.runner.decode(plan.decode, prev)
        chunks = [(s, s.num_total - 1, 1) for s in plan.decode] + plan.prefill
        want, claimed = [], set()
        for seq, start, _ in chunks:   # a request's samples share one list: one chunk records it
            want.append(_records_prompt_logprobs(seq, start) and id(seq.prompt_logprobs) not in claimed)
            if want[-1]:
                claimed.add(id(seq.prompt_logprobs))
        logits = self.runner.prefill(chunks, want, prev)
        if not claimed:
            return logits
        last, i = [], 0
        for (seq, start, n), w in zip(chunks, want):
            if w:
                _record_prompt_logprobs(seq, start, logits[i:i + n])
            i += n if w else 1
            last.append(i - 1)
        return _take(logits, last)

    def _collect(self, touched: set[str]) -> list[RequestOutput]:
        results = [self._output(self.requests[r]) for r in touched if r in self.requests]
        for r in results:
            if r.finished:
                del self.requests[r.request_id]
        return results

    def _append(self, seq: Sequence, got: HostTokens, row: int):
        tok = got.token_ids[row]
        p = seq.params
        seq.output_ids.append(tok)
        if p.logprobs is not None:
            lp = {tok: got.logprobs[row]}
            if p.logprobs:  # logprobs=0: the chosen token only (the sampler then returns no top-k)
                for t, v in zip(got.top_ids[row][:p.logprobs], got.top_logprobs[row][:p.logprobs]):
                    lp.setdefault(t, v)
            seq.logprobs.append(lp)
        req = self.requests[seq.request_id]
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        reason = None
        if tok == self.model.cfg.eos_token_id and not p.ignore_eos or tok in p.stop_token_ids:
            reason = "stop"
        elif seq.detok is not None:
            seq.text += seq.detok.push(tok)
            if p.stop and len(seq.output_ids) >= p.min_tokens:
                cut = min((i for i in (seq.text.find(s) for s in p.stop) if i >= 0), default=-1)
                if cut >= 0:
                    seq.text, reason = seq.text[:cut], "stop"
        n_out = len(seq.output_ids)
        if reason is None and (p.max_tokens is not None and n_out >= p.max_tokens
                               or len(seq.prompt_ids) + n_out >= self.max_model_len):
            reason = "length"
        if reason is not None:
            if reason == "length" and seq.detok is not None:
                seq.text += seq.detok.flush()
            self.scheduler.finish(seq, reason)

    def _output(self, req: _Request) -> RequestOutput:
        seqs = req.seqs   # (every request, every step it advances: the common n == 1 without a loop)
        outs = [_completion(seqs[0])] if len(seqs) == 1 else [_completion(s) for s in seqs]
        metrics = {"arrival": req.arrival, "first_token": req.first_token_time}
        first = seqs[0]
        plp = list(first.prompt_logprobs) if first.prompt_logprobs is not None else None
        ranks = list(first.prompt_ranks) if first.prompt_ranks is not None else None
        finished = first.status is Status.FINISHED if len(seqs) == 1 else req.finished
        return RequestOutput(req.request_id, req.prompt, req.prompt_ids, outs, finished, metrics, plp, ranks)

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)


def _completion(s: Sequence) -> CompletionOutput:
    return CompletionOutput(s.index, s.text, s.output_ids[:], s.finish_reason,
                            s.logprobs[:] if s.params.logprobs is not None else None)


def _take(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits[rows] with the index sent without a host sync ([L,V] -> [len(rows),V])."""
    return logits.index_select(0, device_longs(logits.device, rows))


# ---- prompt logprobs ----
_LOGSOFTMAX_ROWS = 64  # rows log-softmaxed at once: at most this many [V] fp32 rows extra


def _records_prompt_logprobs(seq: Sequence, start: int) -> bool:
    """Whether the chunk from `start` carries the next prompt logprobs still missing (a recompute
    after preemption, or a sibling sample that prefilled the chunk first, records nothing)."""
    got = seq.prompt_logprobs
    return got is not None and len(got) == start + 1 and start + 1 < len(seq.prompt_ids)


def _record_prompt_logprobs(seq: Sequence, start: int, logits: torch.Tensor):
    """logits [n,V] of positions start.. -> entries for the prompt tokens they predict.

    Position j's logits give token j+1's logprob (raw log-softmax, as for generated tokens)
    and the k best alternatives. Row blocks keep the extra fp32 memory small; only the
    chosen and top-k values leave the device, in one transfer."""
    k = seq.params.prompt_logprobs
    m = min(logits.shape[0], len(seq.prompt_ids) - 1 - start)
    targets = torch.tensor(seq.prompt_ids[start + 1:start + 1 + m], device=logits.device)
    chosen, ranks, top_v, top_i = [], [], [], []
    for r in range(0, m, _LOGSOFTMAX_ROWS):
        lp = torch.log_softmax(logits[r:min(m, r + _LOGSOFTMAX_ROWS)].float(), dim=-1)
        chosen.append(lp.gather(1, targets[r:r + lp.shape[0], None])[:, 0])
        ranks.append((lp > chosen[-1][:, None]).sum(-1) + 1)
        if k:
            v, i = lp.topk(k, dim=-1)
            top_v.append(v)
            top_i.append(i)
    chosen = torch.cat(chosen).tolist()
    seq.prompt_ranks.extend(torch.cat(ranks).tolist())
    tops_v = torch.cat(top_v).tolist() if k else [[]] * m
    tops_i = torch.cat(top_i).tolist() if k else [[]] * m
    for t, lp, ids, vals in zip(seq.prompt_ids[start + 1:start + 1 + m], chosen, tops_i, tops_v):
        entry = {t: lp}
        for tid, v in zip(ids, vals):
            entry.setdefault(tid, v)
        seq.prompt_logprobs.append(entry)
