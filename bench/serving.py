"""Online serving: TTFT, TPOT, ITL, E2E and output tok/s of `python -m engine.serve` under load.

    python bench/serving.py [--model DIR] [--device cuda] [--max-num-seqs N] [--enforce-eager]
                            [--server-arg=--tp --server-arg=8 ...] [--concurrency 1,16,64]
                            [--input-len 1024] [--output-len 128] [--num-prompts N] [--warmup 2]
                            [--json results.json]
    python bench/serving.py --base-url http://host:8000 ...   # a server already running
    python bench/serving.py --simulate-tp 8 --input-len 8192 --output-len 1024 ...   # one rank of TP=8

Without --base-url it starts `python -m engine.serve` from this tree on a free port (no --model:
the embedded tiny checkpoint; --max-num-seqs defaults to the largest concurrency, so no level
queues in the server), waits for /health and stops it at the end. For each concurrency level it
sends --num-prompts (default max(8, 4 x concurrency)) streaming /v1/completions requests through
the official openai client, at most `concurrency` in flight (an asyncio semaphore, all requests
queued at once, as vLLM's benchmark with --max-concurrency and an infinite request rate).

Each prompt is exactly --input-len token ids: BOS, then ids drawn at random (seeded) from
DeepSeek-V4's ordinary tokens. Each asks for --output-len tokens with ignore_eos (the server
supports vLLM's extension, so every request makes exactly that many) and
stream_options.include_usage (tokens are counted from the server's usage, not from chunks).
The metric definitions are vLLM's benchmark_serving's: see bench/serving_metrics.py.

Output: a table on stdout; --json PATH writes {"run": {...}, "rows": [one per concurrency]}.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import openai  # noqa: E402

from serving_metrics import HEADER, RequestResult, format_row, make_row, read_stream  # noqa: E402

# DeepSeek-V4's tokenizer: ids 0-2 are BOS, EOS and padding, and its added special tokens start at
# 128000; prompts draw from the ids in between, so no random prompt holds a chat or tool marker.
ORDINARY_IDS = (3, 128000)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, api_key: str | None = None, timeout: float = 10) -> dict:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"(no log: {e})"


class Server:
    """`python -m engine.serve` from this tree as a child process, its output in a log file."""

    def __init__(self, args):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "engine.serve", "--host", "127.0.0.1", "--port", str(self.port),
                    "--max-num-seqs", str(args.max_num_seqs)]
        for flag, value in (("--model", args.model), ("--device", args.device)):
            if value is not None:
                self.cmd += [flag, value]
        for flag, value in (("--simulate-tp", args.simulate_tp), ("--num-layers", args.num_layers)):
            if value is not None:
                self.cmd += [flag, str(value)]
        self.cmd += ["--enforce-eager"] * args.enforce_eager + args.server_arg
        self.own_log = not args.server_log  # a temporary log goes once the run succeeded
        if args.server_log:
            self.log_path = Path(args.server_log)
        else:
            fd, name = tempfile.mkstemp(prefix="engine-serve-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        print(f"starting: {' '.join(self.cmd)}  (log: {self.log_path})", flush=True)
        self.log = open(self.log_path, "wb")
        # a file, not a pipe: nobody reads the server's output while the bench runs
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float):
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited ({self.proc.returncode}) before it was ready; "
                                 f"its log ({self.log_path}) ends:\n{log_tail(self.log_path)}")
            try:
                if get_json(f"{self.base_url}/health", timeout=2).get("status") == "ok":
                    print(f"server ready after {time.monotonic() - t0:.1f} s", flush=True)
                    return
            except OSError:
                pass
            time.sleep(0.25)
        self.stop()
        raise SystemExit(f"the server was not ready after {timeout:.0f} s (--server-timeout); "
                         f"its log ({self.log_path}) ends:\n{log_tail(self.log_path)}")

    def stop(self, keep_log: bool = True):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        if not keep_log and self.own_log:
            self.log_path.unlink(missing_ok=True)


def random_prompts(n: int, input_len: int, bos: int, vocab: int, rng: random.Random) -> list[list[int]]:
    lo, hi = ORDINARY_IDS[0], min(ORDINARY_IDS[1], vocab)
    return [[bos] + [rng.randrange(lo, hi) for _ in range(input_len - 1)] for _ in range(n)]


async def one_request(client: openai.AsyncOpenAI, model: str, prompt: list[int], args) -> RequestResult:
    start = time.perf_counter()
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=args.output_len, temperature=args.temperature, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        return await read_stream(stream, start)
    except Exception as e:  # a failed request is a number in the row, not the end of the run
        return RequestResult(error=f"{type(e).__name__}: {e}")


async def run_level(client, model: str, prompts: list[list[int]], concurrency: int, args
                    ) -> tuple[list[RequestResult], float]:
    """All prompts, at most `concurrency` in flight -> (results, wall time in s)."""
    sem = asyncio.Semaphore(concurrency)

    async def limited(p):
        async with sem:
            return await one_request(client, model, p, args)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(limited(p) for p in prompts))
    return list(results), time.perf_counter() - t0


def report_failures(results: list[RequestResult], what: str):
    failed = [r for r in results if not r.ok]
    for r in failed[:5]:
        print(f"  {what}: a request failed: {r.error}", file=sys.stderr)
    if len(failed) > 5:
        print(f"  {what}: ... and {len(failed) - 5} more", file=sys.stderr)


async def bench(base_url: str, args) -> tuple[dict, list[dict]]:
    card = get_json(f"{base_url}/v1/models", args.api_key)["data"][0]
    tok = get_json(f"{base_url}/tokenizer_info", args.api_key)
    if args.input_len + args.output_len > card["max_model_len"]:
        raise SystemExit(f"--input-len + --output-len = {args.input_len + args.output_len} is past the "
                         f"model's context ({card['max_model_len']})")
    model = card["id"]
    rng = random.Random(args.seed)

    def prompts(n):
        return random_prompts(n, args.input_len, tok["bos_token_id"], tok["vocab_size"], rng)

    # no retries: a retried request would hide a failure and stretch its latency
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=args.api_key or "none", max_retries=0,
                                timeout=args.request_timeout)
    rows = []
    async with client:
        if args.warmup:
            warm, _ = await run_level(client, model, prompts(args.warmup), max(args.concurrency), args)
            report_failures(warm, "warm-up")
            if not any(r.ok for r in warm):
                raise SystemExit(f"every warm-up request failed, e.g. {warm[0].error}")
        print(HEADER, flush=True)
        for c in args.concurrency:
            n = args.num_prompts or max(8, 4 * c)
            results, duration = await run_level(client, model, prompts(n), c, args)
            rows.append(make_row(results, duration, concurrency=c, input_len=args.input_len,
                                 output_len=args.output_len))
            print(format_row(rows[-1]), flush=True)
            report_failures(results, f"concurrency {c}")
    return card, rows


def git_commit() -> str | None:
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None  # a copy of the tree without .git (the device machine's)
    return head + ("-dirty" if dirty else "")


def device_name(device: str | None) -> str:
    """The accelerator's name as this process sees it: the server's device, where this bench started
    the server on this host; the host's first GPU where it attached to --base-url (it may be another)."""
    if device is not None and device.startswith("cpu"):
        return "cpu"
    try:
        import torch
    except ImportError:
        return "unknown"
    if not torch.cuda.is_available():
        return "cpu"
    return torch.cuda.get_device_name(torch.device(device) if device else None)


def run_info(args, base_url: str, card: dict, server: Server | None) -> dict:
    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "commit": git_commit(),
            "device": device_name(args.device if server else None), "model": card["id"],
            "model_root": card.get("root"), "max_model_len": card["max_model_len"], "base_url": base_url,
            "server_cmd": " ".join(["python"] + server.cmd[1:]) if server else None,
            "simulate_tp": args.simulate_tp, "num_layers": args.num_layers,
            "warmup": args.warmup, "seed": args.seed, "temperature": args.temperature, "ignore_eos": True}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default=None, help="attach to this server (http://host:port) instead of starting one")
    p.add_argument("--model", default=None, help="checkpoint dir for the started server (default: embedded tiny)")
    p.add_argument("--device", default=None, help="the started server's device (cuda, cuda:1, cpu)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="the started server's (default: largest concurrency)")
    p.add_argument("--enforce-eager", action="store_true", help="the started server runs without CUDA graphs")
    p.add_argument("--simulate-tp", type=int, default=None, metavar="N",
                   help="the started server serves one rank of TP=N on random weights at --model's dims (or "
                        "DeepSeek-V4-Flash's): engine.serve --simulate-tp")
    p.add_argument("--num-layers", type=int, default=None, metavar="K",
                   help="with --simulate-tp: the started server keeps only the first K blocks")
    p.add_argument("--server-arg", action="append", default=[],
                   help="one more argument for engine.serve, repeated: --server-arg=--tp --server-arg=8")
    p.add_argument("--server-timeout", type=float, default=1800, help="seconds to wait for the server's /health")
    p.add_argument("--server-log", default=None, help="the started server's log file (default: a temporary file)")
    p.add_argument("--api-key", default=os.environ.get("ENGINE_API_KEY"), help="default: $ENGINE_API_KEY")
    p.add_argument("--concurrency", default="1,16,64", help="comma list of levels")
    p.add_argument("--input-len", type=int, default=1024, help="prompt tokens, BOS included")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=None, help="per level (default: max(8, 4 x concurrency))")
    p.add_argument("--warmup", type=int, default=2, help="requests sent (and not counted) before the first level")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy, as SGLang's bench_serving sends")
    p.add_argument("--seed", type=int, default=0, help="of the random prompts")
    p.add_argument("--request-timeout", type=float, default=3600, help="seconds, per request")
    p.add_argument("--json", default=None, metavar="PATH", help="write the run info and rows as JSON")
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if min(args.concurrency) < 1 or args.input_len < 1 or args.output_len < 1:
        p.error("concurrency levels, --input-len and --output-len must be >= 1")
    if args.num_layers is not None and args.simulate_tp is None:
        p.error("--num-layers cuts a simulated model: it needs --simulate-tp")
    args.max_num_seqs = args.max_num_seqs or max(args.concurrency)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    server = None if args.base_url else Server(args)
    ok = False
    try:
        if server is not None:
            server.wait_ready(args.server_timeout)
        base_url = (args.base_url or server.base_url).rstrip("/")
        card, rows = asyncio.run(bench(base_url, args))
        ok = not any(r["failed"] for r in rows)
    finally:
        if server is not None:
            server.stop(keep_log=not ok)
    if not ok and server is not None:
        print(f"some requests failed; the server's log: {server.log_path}", file=sys.stderr)
    if args.json:
        out = {"run": run_info(args, base_url, card, server), "rows": rows}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
