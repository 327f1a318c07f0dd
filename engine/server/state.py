"""What every handler needs: the one engine loop, the tokenizer, the model's limits, metrics."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from ..async_engine import AsyncEngine
from ..tokenizer import Tokenizer
from .errors import APIError
from .metrics import ServerMetrics


@dataclass
class Limits:
    """What one request may take, so that no single request can hold the server: n (and
    best_of) as OpenAI caps them, sequences per request (prompts x n), and the body's bytes."""
    max_n: int = 128
    max_request_seqs: int = 1024
    max_body_bytes: int = 32 << 20


@dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: Tokenizer
    model_name: str
    model_root: str
    max_model_len: int
    vocab_size: int
    metrics: ServerMetrics
    limits: "Limits" = None
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        self.limits = self.limits or Limits()

    @property
    def max_n(self) -> int:
        return self.limits.max_n

    @property
    def max_request_seqs(self) -> int:
        return self.limits.max_request_seqs

    def check_overload(self):
        # The engine checks too (and a stream is primed, so that 503 still arrives as a status);
        # this early check spares tokenizing a request that cannot be queued.
        core = self.engine.core
        limit = core.scheduler.max_waiting
        if limit is not None and core.num_waiting() >= limit:
            raise APIError(503, f"the server is overloaded: {core.num_waiting()} requests are waiting "
                                f"(limit {limit})", code="overloaded")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
