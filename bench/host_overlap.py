"""Exposed host time per decode step, async scheduling on vs off (issue 16: "host work overlapped").

    python bench/host_overlap.py [--model DIR] [--batches 1,16,64] [--steps 200] [--warmup 20]
                                 [--input-len 32] [--temperature 0] [--enforce-eager] [--json PATH]
    python bench/host_overlap.py --device cpu --batches 1,4 --steps 5 --warmup 2    # a smoke run

One engine (no --model: the embedded tiny checkpoint) decodes B requests (random prompts of
--input-len ids, ignore_eos, max_tokens past the window) through EngineCore.step, as LLM.generate
and the server's loop drive it. Once every row decodes and --warmup steps have run, --steps steps
are timed, each mode on the same engine:

  step_ms    wall time per step.step() call, end to end (median; mean_ms: the window's total
             over steps, a synchronize at its end): what a decoding sequence waits per token.
  device_ms  the model call's device time (runner.decode: the input copy and the CUDA-graph
             replay), median of CUDA-event pairs around it; on the CPU, its wall time.
  exposed_ms step_ms - device_ms: host time the device waits for (scheduling, inputs, the
             sampler's launches and its device time, reading tokens, detokenizing, stop checks).
             The issue's target: < 0.1 ms at B=64 with async scheduling.
  wait_ms    time the host spent blocked on the previous step's tokens (InFlight.read): the
             part of the step in which the host had nothing to do; host_ms = step_ms - wait_ms.

Output: a table on stdout; --json PATH writes {"run": {...}, "rows": [one per batch and mode]}.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine import inflight  # noqa: E402


class Probe:
    """Times the model calls (runner.decode, runner.prefill: the inputs' copies and the model or
    its graph's replay) and the host's waits on sampled tokens."""

    def __init__(self, llm):
        self.runner, self.cuda = llm.engine.runner, llm.device.type == "cuda"
        self.decode, self.prefill, self.read = self.runner.decode, self.runner.prefill, inflight.InFlight.read
        self.calls, self.waits, self.prefills = [], [], 0
        self.runner.decode = lambda seqs, prev=None: self._timed(self.decode, seqs, prev)
        self.runner.prefill = self._prefill
        probe = self

        def read(step):
            t0 = time.perf_counter()
            out = probe.read(step)
            probe.waits.append(time.perf_counter() - t0)
            return out
        inflight.InFlight.read = read

    def _prefill(self, *args, **kwargs):
        self.prefills += 1
        return self._timed(self.prefill, *args, **kwargs)

    def _timed(self, call, *args, **kwargs):
        if not self.cuda:
            t0 = time.perf_counter()
            out = call(*args, **kwargs)
            self.calls.append(time.perf_counter() - t0)
            return out
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = call(*args, **kwargs)
        b.record()
        self.calls.append((a, b))
        return out

    def reset(self):
        self.calls, self.waits, self.prefills = [], [], 0

    def device_ms(self) -> float:
        if not self.cuda:
            return 1e3 * statistics.median(self.calls)
        torch.cuda.synchronize()
        return statistics.median(a.elapsed_time(b) for a, b in self.calls)

    def close(self):
        self.runner.decode, self.runner.prefill, inflight.InFlight.read = self.decode, self.prefill, self.read


def sync(llm):
    if llm.device.type == "cuda":
        torch.cuda.synchronize()


def measure(llm, probe, batch: int, overlap: bool, args) -> dict:
    eng = llm.engine
    eng.async_scheduling = overlap
    rng = random.Random(args.seed + batch)
    V = llm.model.cfg.vocab_size
    params = SamplingParams(temperature=args.temperature, seed=None if args.temperature == 0 else args.seed,
                            max_tokens=args.warmup + args.steps + 8, ignore_eos=True)
    rids = [eng.add_request([0] + [rng.randrange(2, V) for _ in range(args.input_len - 1)], params)
            for _ in range(batch)]
    while eng.scheduler.waiting or not all(s.in_decode for s in eng.scheduler.running):   # the prefill
        eng.step()
    for _ in range(args.warmup):
        eng.step()
    sync(llm)
    probe.reset()
    stamps = [time.perf_counter()]
    for _ in range(args.steps):
        eng.step()
        stamps.append(time.perf_counter())
    sync(llm)
    end = time.perf_counter()
    if probe.prefills or len(probe.calls) != args.steps:
        raise RuntimeError(f"the timed window was not {args.steps} decode-only steps")
    step_ms = 1e3 * statistics.median(b - a for a, b in zip(stamps, stamps[1:]))
    device_ms, wait_ms = probe.device_ms(), 1e3 * statistics.median(probe.waits)
    for r in rids:
        eng.abort(r)
    while eng.has_unfinished():
        eng.step()
    return dict(batch=batch, overlap=overlap, step_ms=step_ms, mean_ms=1e3 * (end - stamps[0]) / args.steps,
                device_ms=device_ms, exposed_ms=step_ms - device_ms, wait_ms=wait_ms, host_ms=step_ms - wait_ms,
                tok_s=batch / step_ms * 1e3)


HEADER = f"{'B':>4} {'async':>5} {'step_ms':>8} {'mean_ms':>8} {'device_ms':>9} {'exposed_ms':>10} " \
         f"{'wait_ms':>8} {'host_ms':>8} {'tok/s':>9}"


def fmt(r: dict) -> str:
    return (f"{r['batch']:>4} {'on' if r['overlap'] else 'off':>5} {r['step_ms']:8.3f} {r['mean_ms']:8.3f} "
            f"{r['device_ms']:9.3f} {r['exposed_ms']:10.3f} {r['wait_ms']:8.3f} {r['host_ms']:8.3f} {r['tok_s']:9.0f}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint dir (default: the embedded tiny checkpoint)")
    p.add_argument("--device", default=None, help="cuda (default where present) or cpu (a smoke run)")
    p.add_argument("--batches", default="1,16,64", help="comma list of decode batch sizes")
    p.add_argument("--steps", type=int, default=200, help="timed decode steps per batch and mode")
    p.add_argument("--warmup", type=int, default=20, help="decode steps run (not timed) before the window")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens, BOS included")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else seeded sampling")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default="off,on", help="async scheduling off, on, or both (in this order)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--no-detokenize", action="store_true", help="token ids only (skip_tokenizer_init)")
    p.add_argument("--kv-cache-gib", type=float, default=2.0)
    p.add_argument("--json", default=None, metavar="PATH", help="write the run info and rows as JSON")
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    args.modes = [{"off": False, "on": True}[m] for m in args.modes.split(",")]
    if min(args.batches) < 1 or args.steps < 1 or args.warmup < 0 or args.input_len < 1:
        p.error("batches and --steps, --input-len must be >= 1, --warmup >= 0")
    return args


def run_info(args, llm) -> dict:
    try:
        commit = subprocess.run(["git", "-C", str(HERE.parent), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    dev = torch.cuda.get_device_name() if llm.device.type == "cuda" else "cpu"
    return dict(device=dev, commit=commit, model=str(llm.model_path), dtype=str(llm.dtype),
                graphs=llm.engine.runner.graphs is not None, detokenize=llm.tokenizer is not None, steps=args.steps, warmup=args.warmup,
                input_len=args.input_len, temperature=args.temperature, date=time.strftime("%Y-%m-%d %H:%M"))


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    kw = {} if device.type == "cuda" else dict(dtype=torch.float32, numerics="plain")
    kw.update(model=args.model, device=device, max_num_seqs=max(args.batches), enforce_eager=args.enforce_eager,
              kv_cache_memory=int(args.kv_cache_gib * 2**30), async_scheduling=False)
    try:   # detokenizing is part of the host work being measured
        llm = LLM(skip_tokenizer_init=args.no_detokenize, **kw)
    except ImportError as e:   # a GPU machine without the tokenizer's wheels (bench/gpu_wheels.sh fetches them)
        print(f"no tokenizer ({e}): token ids only, nothing is detokenized", file=sys.stderr)
        llm = LLM(skip_tokenizer_init=True, **kw)
    probe = Probe(llm)
    print(f"{run_info(args, llm)['device']}: graphs {'on' if llm.engine.runner.graphs else 'off'}")
    print(HEADER)
    rows = []
    try:
        for batch in args.batches:
            for overlap in args.modes:
                rows.append(measure(llm, probe, batch, overlap, args))
                print(fmt(rows[-1]), flush=True)
    finally:
        probe.close()
    if args.json:
        Path(args.json).write_text(json.dumps({"run": run_info(args, llm), "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
