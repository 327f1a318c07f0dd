"""python -m engine.serve: an OpenAI-compatible HTTP server over one LLM.

    python -m engine.serve --model /path/to/DeepSeek-V4-Flash --port 8000
    python -m engine.serve            # the embedded tiny checkpoint (built on first use)
    python -m engine.serve --simulate-tp 8   # one rank of TP=8 at V4-Flash's dims, random weights
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

import uvicorn

from . import simulate

log = logging.getLogger("engine.serve")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m engine.serve", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded tiny checkpoint)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="launch each step before reading the previous one's tokens (default: on for CUDA at "
                        "tp=1; tp > 1: opt-in)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: the directory name)")
    # from the environment too, so a key need not show up in `ps`
    p.add_argument("--api-key", default=os.environ.get("ENGINE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $ENGINE_API_KEY, else none)")
    p.add_argument("--max-num-seqs", type=int, default=16, help="sequences decoded together")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="tokens one step feeds the model: decode rows plus several prompts' prefill chunks")
    p.add_argument("--chunk-size", type=int, default=None,
                   help="the most of one prompt a step prefills (default: --max-num-batched-tokens)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's max_position_embeddings)")
    p.add_argument("--max-waiting", type=int, default=4096,
                   help="sequences waiting for a slot; requests beyond this get 503 (keeps memory bounded)")
    p.add_argument("--max-n", type=int, default=128, help="largest n (and best_of) a request may ask for")
    p.add_argument("--max-request-seqs", type=int, default=1024,
                   help="largest number of sequences (prompts x n) in one request")
    p.add_argument("--max-body-mb", type=float, default=32, help="largest request body, in MiB (413 beyond)")
    p.add_argument("--shutdown-timeout", type=float, default=5,
                   help="seconds SIGTERM waits for connections to close before cancelling them")
    p.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda if present)")
    p.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=None,
                   help="run synthetic requests before serving, so that the first real ones do not wait on "
                        "kernel compiles (engine.warmup; default: on for CUDA)")
    simulate.add_args(p)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = p.parse_args(argv)
    simulate.check_args(p, args)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .llm import LLM, default_model_dir
    from .server.app import build_app
    from .server.state import Limits

    if args.model is None and args.simulate_tp is None:
        log.info("no --model given: using the embedded tiny checkpoint (building it if needed)")
    try:
        model = args.model or (None if args.simulate_tp else default_model_dir())
        llm = LLM(model, tp=args.tp, device=args.device, max_num_seqs=args.max_num_seqs,
                  max_waiting=args.max_waiting, enforce_eager=args.enforce_eager,
                  max_num_batched_tokens=args.max_num_batched_tokens, chunk_size=args.chunk_size,
                  max_model_len=args.max_model_len, async_scheduling=args.async_scheduling,
                  simulate_tp=args.simulate_tp, num_layers=args.num_layers,
                  simulate_collectives=args.simulate_collectives)
    except (FileNotFoundError, NotImplementedError, ValueError) as e:
        log.error("cannot start: %s", e)
        return 2
    if args.warm_up if args.warm_up is not None else llm.device.type == "cuda":
        llm.warm_up()
    limits = Limits(max_n=args.max_n, max_request_seqs=args.max_request_seqs,
                    max_body_bytes=int(args.max_body_mb * (1 << 20)))
    app = build_app(llm, args.served_model_name, api_key=args.api_key, limits=limits)
    name = app.state.server.model_name
    cache = llm.cache
    log.info("model %s served as %r on %s, tp=%d%s, %s, %s numerics", llm.model_path, name, llm.device, args.tp,
             f" (simulating one rank of tp={args.simulate_tp}: random weights)" if args.simulate_tp else "",
             str(llm.dtype).removeprefix("torch."), llm.numerics)
    usable = cache.num_blocks - 1  # block 0 is the cache's write sink
    log.info("KV cache: %d blocks x %d tokens = %d tokens; max_model_len %d, max_num_seqs %d, max_waiting %s",
             usable, cache.block_tokens, usable * cache.block_tokens, llm.max_model_len,
             llm.max_num_seqs, args.max_waiting if args.max_waiting is not None else "unlimited")
    log.info("OpenAI API at http://%s:%d/v1%s", args.host, args.port, " (API key required)" if args.api_key else "")
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout)
    _Server(config, app.state.server.engine.stop_accepting).run()
    llm.shutdown()
    return 0


class _Server(uvicorn.Server):
    """uvicorn, but SIGTERM/SIGINT also abort the requests in flight at once: uvicorn alone
    waits for every connection to close, and a long stream would hold the exit."""

    def __init__(self, config, on_exit):
        super().__init__(config)
        self.on_exit = on_exit

    def handle_exit(self, sig, frame):
        self.on_exit()
        super().handle_exit(sig, frame)


if __name__ == "__main__":
    sys.exit(main())
