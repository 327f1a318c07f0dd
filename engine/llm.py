"""LLM: the synchronous API, shaped like vLLM's (generate, chat)."""
from __future__ import annotations

import atexit
import logging
import os
from pathlib import Path

import torch

from . import rank
from .cache import KVCache
from .core import EngineCore, RequestOutput
from .sampler import SamplingParams

log = logging.getLogger(__name__)

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "weights" / "tiny"


def default_model_dir() -> Path:
    """The embedded tiny checkpoint, built by weights.make_tiny on first use."""
    if not (DEFAULT_MODEL_DIR / "config.json").exists():
        from weights.make_tiny import make_tiny

        log.info("no model given: building the tiny default checkpoint in %s", DEFAULT_MODEL_DIR)
        make_tiny(DEFAULT_MODEL_DIR, preset="tiny", seed=0)
    return DEFAULT_MODEL_DIR


def _default_cache_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.8)
    return 1 << 30


def _model_config(model, tp: int, simulate_tp: int | None, num_layers: int | None):
    """-> (checkpoint dir or None, ModelConfig): a checkpoint's, or a simulated rank's dims."""
    from .model.config import ModelConfig

    if simulate_tp is None:
        if num_layers is not None:
            raise ValueError("num_layers cuts a simulated model: it needs simulate_tp")
        path = Path(model) if model is not None else default_model_dir()
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json")
        return path, ModelConfig.from_file(path)
    from .simulate import check_simulate_tp, sim_config

    check_simulate_tp(simulate_tp)
    if tp != 1:
        raise ValueError(f"simulate_tp={simulate_tp} runs one rank in this process: tp must be 1, got {tp}")
    path = Path(model) if model is not None else None
    return path, sim_config(path, num_layers)


class LLM:
    def __init__(self, model: str | Path | None = None, tp: int = 1, device=None, dtype=None,
                 max_num_seqs: int = 16, max_model_len: int | None = None, kv_cache_memory: int | None = None,
                 numerics: str | None = None, chunk_size: int | None = None, max_waiting: int | None = None,
                 tp_timeout: float = 120.0, enforce_eager: bool = False, skip_tokenizer_init: bool = False,
                 max_num_batched_tokens: int = 8192, async_scheduling: bool | None = None,
                 simulate_tp: int | None = None, num_layers: int | None = None, simulate_collectives: bool = True):
        """skip_tokenizer_init: as vLLM's, no tokenizer is loaded (engine.tokenizer is not even
        imported): prompts must be token ids, outputs carry token ids and empty text.
        max_num_batched_tokens: the tokens one step feeds the model (decode rows and prefill
        chunks of several sequences together); chunk_size: the most of one prompt per step
        (None: the whole budget).
        async_scheduling: launch each step before reading the previous step's tokens, so that
        appending, detokenizing and stop checks overlap the device (engine.core); None:
        $ENGINE_ASYNC_SCHEDULING (0 or 1) if set, else on for CUDA at tp=1 (tensor-parallel
        ranks take their ids from the host's step description).
        simulate_tp: serve one rank of a TP=simulate_tp server alone on this device (engine.simulate):
        seeded random weights in the real packed formats at `model`'s dims (its config.json only,
        no weight is read; None: DeepSeek-V4-Flash's), collectives answered locally and, unless
        simulate_collectives=False, costing modelled device time. Outputs are not the model's.
        num_layers: with simulate_tp, only the first blocks (quick runs)."""
        if tp < 1:
            raise ValueError("tp must be >= 1")
        if max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")
        path, cfg = _model_config(model, tp, simulate_tp, num_layers)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        numerics = numerics or ("reference" if cfg.fp8_linears else "plain")
        cfg.check_tp(simulate_tp or tp, numerics)   # before any rank starts or reads a weight
        self.max_model_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        use_graphs = self.device.type == "cuda" and not enforce_eager
        if async_scheduling is None:   # ENGINE_ASYNC_SCHEDULING=0/1 overrides (tests force the lag on CPU)
            # tp > 1: opt-in (every step then shares its sampled ids; run on CPU ranks only so far)
            env = os.environ.get("ENGINE_ASYNC_SCHEDULING")
            async_scheduling = tp == 1 and (env != "0" if env else self.device.type == "cuda")
        self.workers, self.tp, self.simulate_tp = None, tp, simulate_tp
        sim_model = None
        if simulate_tp:   # built before the cache is sized: the cache takes what the weights leave
            from .simulate import build_rank

            sim_model = build_rank(cfg, simulate_tp, self.device, self.dtype, numerics, simulate_collectives)
            atexit.register(self.shutdown)
        if tp > 1:
            self.device, self.workers = rank.join(tp, self.device, dict(
                path=str(path), device=str(self.device), dtype=self.dtype, numerics=numerics,
                max_num_seqs=max_num_seqs, timeout=tp_timeout, graphs=use_graphs, max_model_len=self.max_model_len))
            atexit.register(self.shutdown)
        budget = kv_cache_memory or _default_cache_bytes(self.device)
        num_blocks = KVCache(cfg, max_num_seqs, budget, "meta", self.dtype).num_blocks
        if tp > 1:
            from .parallel.comm import send_step

            send_step(num_blocks)
        # the one build path every rank takes (engine.rank.build): with tp > 1 every rank captures
        # the same buckets in the same order, so the all-reduces inside the captures meet
        if sim_model is not None:
            self.model, self.cache, graphs = rank.finish(sim_model, self.device, self.dtype, max_num_seqs,
                                                         self.max_model_len, num_blocks, use_graphs)
        else:
            self.model, self.cache, graphs = rank.build(path, self.device, self.dtype, numerics, max_num_seqs,
                                                        self.max_model_len, num_blocks, use_graphs)
        self.tokenizer = None
        if not skip_tokenizer_init:
            from .tokenizer import Tokenizer

            self.tokenizer = Tokenizer.from_dir(path)   # no path (simulated real dims): the bundled one
        self.engine = EngineCore(self.model, self.tokenizer, self.cache, max_num_seqs, self.max_model_len,
                                 chunk_size, max_waiting, max_num_batched_tokens, async_scheduling)
        if tp > 1:
            self.engine.runner.broadcast = self.workers.send if self.workers is not None else rank.send_step
            if async_scheduling:   # the sampled ids every rank reads the next step's pending tokens from
                self.engine.runner.shared = torch.zeros(max_num_seqs, dtype=torch.long, device=self.device)
        self.engine.runner.graphs = graphs
        self.model_path = path or Path(f"DeepSeek-V4-Flash-sim-tp{simulate_tp}")
        self.numerics, self.max_num_seqs = numerics, max_num_seqs
        log.info("model %s on %s (%s, %s numerics): %d cache blocks of %d tokens, %d slots",
                 path, self.device, str(self.dtype).removeprefix("torch."), numerics, self.cache.num_blocks,
                 self.cache.block_tokens, max_num_seqs)

    def warm_up(self) -> float:
        """Synthetic requests through the engine, so that real ones meet compiled kernels
        (engine.warmup) -> seconds taken."""
        from .warmup import warm_up

        return warm_up(self.engine)

    def shutdown(self):
        """Stop the tensor-parallel ranks (a no-op at tp=1); leave a simulated rank's state."""
        if self.tp > 1:
            rank.stop(self.workers)
        elif self.simulate_tp:
            from .parallel import state

            self.simulate_tp = None
            state.shutdown()

    def generate(self, prompts: str | list[str] | list[int] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        if self.engine.driver is not None:
            raise RuntimeError("this LLM's engine is driven by an AsyncEngine; use that instead")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or a single one for all")
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="requests")
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    if bar:
                        bar.update(1)
        if bar:
            bar.close()
        return [done[i] for i in ids]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             thinking: bool = False, tools: list[dict] | None = None, reasoning_effort: str | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        from .chat import encode_chat

        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer: this LLM was built with skip_tokenizer_init=True")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [encode_chat(self.tokenizer, conv, thinking=thinking, tools=tools, reasoning_effort=reasoning_effort)
                   for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)
