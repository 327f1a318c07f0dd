"""One request's state (one sequence per parallel sample): ids, cache place, output text."""
import enum
import time
from dataclasses import dataclass, field

from .sampler import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    index: int                      # which of the request's n samples
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    # one entry per prompt token recorded so far (the first is None: nothing predicts it); the
    # request's n samples share one list, so whichever prefills a chunk first records it
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int | None] | None = None   # the prompt token's rank at each position
    status: Status = Status.WAITING
    finish_reason: str | None = None
    slot: int | None = None         # cache slot while running
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0           # tokens whose KV is in the cache
    text: str = ""                  # detokenized output, stop strings cut
    detok: object = None            # an IncrementalDetokenizer
    preemptions: int = 0
    # tokens sampled on the device whose values the host has not read yet (async scheduling: the
    # next step is launched before the last one's tokens come back), and the row of the newest
    # one in the in-flight step's sampled tokens, which the next step's input gathers on the device
    pending: int = 0
    pending_row: int = -1

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_total(self) -> int:
        """Tokens including the pending ones: where the sequence really is on the device."""
        return self.num_tokens + self.pending

    @property
    def in_decode(self) -> bool:
        """All but the newest token (maybe still pending) are cached: the next step feeds that one token."""
        n_out = len(self.output_ids)   # (lengths inline, not num_total: the scheduler asks every row every step)
        return (self.status is Status.RUNNING and self.num_computed == len(self.prompt_ids) + n_out + self.pending - 1
                and bool(n_out or self.pending))

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
