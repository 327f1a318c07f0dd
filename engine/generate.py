"""python -m engine.generate: offline batch generation from a JSONL file.

Each input row is {"prompt": "..."} (or a list of token ids), or {"messages": [...]}
(chat-encoded), optionally with per-row sampling fields ("max_tokens", "temperature", ...)
and "thinking". --simulate-tp N runs one rank of a TP=N server on random weights
(engine.simulate): throughput figures, not text. A malformed row is reported with its
line number and skipped; the rest still runs.
"""
import argparse
import dataclasses
import json
import logging
import sys
import time

from . import simulate
from .sampler import SamplingParams

_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m engine.generate", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint dir (default: the embedded tiny checkpoint)")
    p.add_argument("--input", required=True, help="prompts, one JSON object per line")
    p.add_argument("--output", required=True, help="where to write one JSON result per input row")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--device", default=None)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="tokens one step feeds the model: decode rows plus several prompts' prefill chunks")
    p.add_argument("--chunk-size", type=int, default=None,
                   help="the most of one prompt a step prefills (default: --max-num-batched-tokens)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's max_position_embeddings)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--thinking", action="store_true", help="chat rows: thinking mode")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    simulate.add_args(p)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="launch each step before reading the previous one's tokens (default: on for CUDA at tp=1)")
    args = p.parse_args(argv)
    simulate.check_args(p, args)
    return args


def _token_ids(x) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def read_rows(path, defaults: dict):
    """-> (rows [(line, prompt or messages, params, thinking)], errors [(line, message)])."""
    rows, errors = [], []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError("a row must be a JSON object")
                if ("prompt" in row) == ("messages" in row):
                    raise ValueError("a row needs exactly one of 'prompt' or 'messages'")
                src = row.get("prompt", row.get("messages"))
                if "prompt" in row and not (isinstance(src, str) and src or _token_ids(src)):
                    raise ValueError("'prompt' must be a non-empty string or list of token ids")
                if "messages" in row and not (isinstance(src, list) and src):
                    raise ValueError("'messages' must be a non-empty list")
                unknown = set(row) - _FIELDS - {"prompt", "messages", "thinking", "id"}
                if unknown:
                    raise ValueError(f"unknown fields {sorted(unknown)}")
                params = SamplingParams(**{**defaults, **{k: v for k, v in row.items() if k in _FIELDS}})
                rows.append((n, row, params))
            except (ValueError, TypeError) as e:
                errors.append((n, str(e)))
    return rows, errors


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    defaults = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                    min_p=args.min_p, seed=args.seed, presence_penalty=args.presence_penalty,
                    frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
                    stop=args.stop or [], ignore_eos=args.ignore_eos)
    rows, errors = read_rows(args.input, defaults)
    for n, msg in errors:
        print(f"{args.input}:{n}: skipped: {msg}", file=sys.stderr)

    from .chat import encode_chat
    from .llm import LLM

    llm = LLM(args.model, tp=args.tp, device=args.device, max_num_seqs=args.max_num_seqs,
              enforce_eager=args.enforce_eager, max_num_batched_tokens=args.max_num_batched_tokens,
              chunk_size=args.chunk_size, max_model_len=args.max_model_len,
              async_scheduling=args.async_scheduling, simulate_tp=args.simulate_tp, num_layers=args.num_layers,
              simulate_collectives=args.simulate_collectives)
    prompts, params, kept = [], [], []
    for n, row, p in rows:
        try:
            if "messages" in row:
                prompts.append(encode_chat(llm.tokenizer, row["messages"], thinking=row.get("thinking", args.thinking)))
            else:
                prompts.append(row["prompt"])
            params.append(p)
            kept.append((n, row))
        except ValueError as e:
            print(f"{args.input}:{n}: skipped: {e}", file=sys.stderr)
            errors.append((n, str(e)))
    t0 = time.perf_counter()
    try:
        outs = llm.generate(prompts, params, use_tqdm=True) if prompts else []
    finally:
        llm.shutdown()   # the ranks (tp > 1) or the simulated rank's state
    dt = time.perf_counter() - t0
    with open(args.output, "w", encoding="utf-8") as f:
        for (n, row), out in zip(kept, outs):
            rec = {"line": n, "id": row.get("id"), "text": out.text, "token_ids": out.token_ids,
                   "finish_reason": out.finish_reason, "prompt_tokens": len(out.prompt_token_ids)}
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    p_tok = sum(len(o.prompt_token_ids) for o in outs)
    g_tok = sum(len(c.token_ids) for o in outs for c in o.outputs)
    print(f"requests: {len(outs)} done, {len(errors)} skipped | prompt tokens: {p_tok} | generated tokens: {g_tok} "
          f"| {dt:.2f} s, {g_tok / dt if dt > 0 else 0:.1f} generated tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
