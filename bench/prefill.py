"""Prefill throughput of one simulated tensor-parallel rank, through the engine's real path.

    python bench/prefill.py [--simulate-tp 8] [--model DIR] [--num-layers K] [--workloads 8192x1,1024x8]
                            [--chunk-size 512,8192] [--max-num-batched-tokens 8192] [--reps 3] [--json PATH]
                            [--by-kernel N] [--proj-before] [--ab LEVER,LEVER+LEVER]
    python bench/prefill.py --device cpu --num-layers 2 --workloads 32x1,16x2 --reps 1   # smoke run

LLM(simulate_tp=N) builds one rank of TP=N with random weights in the real packed formats, at
--model's dims (config.json only) or DeepSeek-V4-Flash's, collectives costing their modelled
device time (engine.simulate; --no-collectives: free). A workload LENxCOUNT is COUNT prompts of
LEN random token ids, run as llm.generate(prompts, max_tokens=1): the scheduler cuts them into
chunks (at most --chunk-size tokens of one prompt, --max-num-batched-tokens per step) exactly as
the server does, and each prompt's first token is sampled after its last chunk, so the wall time
(device synchronised) is the time to every first token (TTFT of the batch). One warm-up run
(Triton compiles and autotunes), then the median of --reps runs, fresh prompts each.

Reported beside each figure: the compute roofline, 2 x active params x tokens / the bf16 GEMM
peak measured in this run: the time if every weight GEMM ran at peak (active: every block's
weights but the routed experts, plus num_experts_per_tok experts' slices; not the embedding, a
lookup, nor the head, run once per prompt; attention's score FLOPs are not counted).

--device cpu without --model: engine.realdims.SMALL dims at simulate_tp 2 (a smoke test of
this script, not a figure).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent)]
sys.path.append(str(HERE))   # bench/timing.py; appended: bench/kernels.py must not shadow a `kernels` package

import torch  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from levers import LEVERS, lever_off  # noqa: E402
from engine.model.model import Transformer  # noqa: E402


def parse_workloads(text: str) -> list[tuple[int, int]]:
    """"8192x1,1024x8" -> [(8192, 1), (1024, 8)]: (prompt length, prompts)."""
    out = []
    for w in text.split(","):
        length, _, count = w.partition("x")
        out.append((int(length), int(count or 1)))
    if not out or min(min(w) for w in out) < 1:
        raise ValueError(f"bad workloads {text!r}: want LENxCOUNT,... with both >= 1")
    return out


def active_params(cfg) -> int:
    """Weights one token multiplies through on this rank (the simulated state gives the shards)."""
    with torch.device("meta"):
        m = Transformer(cfg, dtype=torch.bfloat16, with_mtp=False)
    dense = routed = 0
    for name, p in m.layers.named_parameters():
        if ".experts." in name:
            routed += p.numel()
        else:
            dense += p.numel()
    return dense + routed * cfg.n_activated_experts // cfg.n_routed_experts


def bf16_peak(device: torch.device) -> float:
    """FLOP/s of a large matmul measured now (bf16 8192^3 on CUDA; fp32 512^3 on CPU, smoke only)."""
    if device.type == "cuda":
        from timing import measured_peaks   # bench/timing.py

        return measured_peaks()[1]
    a = torch.randn(512, 512)
    a @ a
    t0 = time.perf_counter()
    for _ in range(5):
        a @ a
    return 5 * 2 * 512 ** 3 / (time.perf_counter() - t0)


def sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_prompts(rng: random.Random, length: int, count: int, vocab: int, bos: int) -> list[list[int]]:
    # ids from the ordinary tokens (bench/serving.py's range), BOS first
    return [[bos] + [rng.randrange(3, min(128000, vocab)) for _ in range(length - 1)] for _ in range(count)]


def run_once(llm: LLM, prompts: list[list[int]]) -> tuple[float, int]:
    """One batch through llm.generate with max_tokens=1 -> (seconds to every first token, engine steps)."""
    steps, step = [0], llm.engine.step

    def counted():
        steps[0] += 1
        return step()

    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    llm.engine.step = counted
    try:
        sync(llm.device)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        sync(llm.device)
        dt = time.perf_counter() - t0
    finally:
        del llm.engine.step        # the class's method again
    assert all(len(o.outputs[0].token_ids) == 1 for o in outs)
    return dt, steps[0]


def measure(llm: LLM, length: int, count: int, args, rng, flops_per_token: float, peak: float) -> dict:
    cfg = llm.model.cfg
    run_once(llm, random_prompts(rng, length, count, cfg.vocab_size, cfg.bos_token_id))        # warm-up
    runs = [run_once(llm, random_prompts(rng, length, count, cfg.vocab_size, cfg.bos_token_id))
            for _ in range(args.reps)]
    dt = statistics.median(t for t, _ in runs)
    steps = statistics.median(s for _, s in runs)
    tokens = length * count
    roofline = flops_per_token * tokens / peak
    return dict(workload=f"{length}x{count}", prompt_len=length, prompts=count, tokens=tokens, reps=args.reps,
                ttft_ms=dt * 1e3, tok_s=tokens / dt, steps=steps, ms_per_step=dt * 1e3 / steps,
                roofline_ms=roofline * 1e3, roofline_tok_s=tokens / roofline, of_roofline=roofline / dt,
                all_runs_ms=[t * 1e3 for t, _ in runs])


def profile_run(llm: LLM, length: int, count: int, rng, top: int, variant: str = "default") -> dict:
    """One more run under torch.profiler: the device's kernel time against the wall time (the rest
    is the host launching an eager forward), and the `top` kernels by total time -> those figures."""
    from torch.profiler import ProfilerActivity, profile

    cfg = llm.model.cfg
    prompts = random_prompts(rng, length, count, cfg.vocab_size, cfg.bos_token_id)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        wall, steps = run_once(llm, prompts)
    names = [(e.self_device_time_total, e.count, e.key) for e in prof.key_averages()
             if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    busy = sum(us for us, _, _ in names) / 1e3
    launches = sum(n for _, n, _ in names)
    print(f"profiled {length}x{count} ({steps} steps, {variant}): wall {wall * 1e3:.1f} ms (profiler on), "
          f"kernels {busy:.1f} ms in {launches} launches ({launches / steps:.0f} a step)")
    for us, n, key in sorted(names, reverse=True)[:top]:
        print(f"    {n:>6} x {us / n:8.2f} us = {us / 1e3:8.2f} ms  {key[:100]}")
    return dict(variant=variant, workload=f"{length}x{count}", steps=steps, wall_ms=wall * 1e3, kernel_ms=busy,
                launches=launches, launches_per_step=launches / steps,
                top=[dict(kernel=key, calls=n, ms=us / 1e3) for us, n, key in sorted(names, reverse=True)[:top]])


HEADER = (f"{'workload':>10} {'tokens':>7} {'TTFT ms':>9} {'tok/s':>9} {'steps':>5} {'ms/step':>8} "
          f"{'roofline ms':>11} {'roofline tok/s':>14} {'of roofline':>11}")


def format_row(r: dict) -> str:
    return (f"{r['workload']:>10} {r['tokens']:>7} {r['ttft_ms']:>9.1f} {r['tok_s']:>9.0f} {r['steps']:>5g} "
            f"{r['ms_per_step']:>8.2f} {r['roofline_ms']:>11.2f} {r['roofline_tok_s']:>14.0f} "
            f"{r['of_roofline']:>10.1%}")




@contextlib.contextmanager
def proj_variant(variant: str):
    """"proj kernel": the packed projections as before prefill's plans (the decode-size kernel plan
    at every M, no per-projection cuBLAS), for a before/after in one run (--proj-before); "off:
    a+b": levers.py's levers a and b off (--ab); "default": as the tree is."""
    from engine.kernels import proj_gemm as pg

    saved = pg.LARGE_M, pg.UNFUSED_M
    if variant == "proj kernel":
        pg.LARGE_M = pg.UNFUSED_M = 1 << 62
    try:
        with contextlib.ExitStack() as stack:
            for name in variant.removeprefix("off: ").split("+") if variant.startswith("off: ") else ():
                stack.enter_context(lever_off(name))
            yield
    finally:
        pg.LARGE_M, pg.UNFUSED_M = saved


def variants(args) -> list[str]:
    """The default, then --proj-before's variant, then one per --ab group of levers."""
    return (["default"] + (["proj kernel"] if args.proj_before else [])
            + [f"off: {g}" for g in args.ab.split(",") if g])


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a checkpoint dir whose config.json gives the dims "
                                                  "(default: DeepSeek-V4-Flash's; on --device cpu the SMALL dims)")
    ap.add_argument("--simulate-tp", type=int, default=None, help="the TP degree simulated (default 8; 2 on cpu)")
    ap.add_argument("--num-layers", type=int, default=None, help="only the first K blocks")
    ap.add_argument("--workloads", default="8192x1,1024x8", help="LENxCOUNT,...: COUNT prompts of LEN tokens")
    ap.add_argument("--chunk-size", default=None, help="the most of one prompt per step (default, as LLM's: "
                                                     "the step budget); a comma list runs each on the same engine")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192, help="tokens per step (LLM's default)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--collectives", action=argparse.BooleanOptionalAction, default=True,
                    help="collectives cost their modelled device time (engine.parallel.latency)")
    ap.add_argument("--graphs", action="store_true", help="also capture the decode graphs (unused by prefill)")
    ap.add_argument("--device", default=None, help="cuda (default when present) or cpu (smoke)")
    ap.add_argument("--seed", type=int, default=0, help="of the prompts")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the run info and rows")
    ap.add_argument("--proj-before", action="store_true",
                    help="also time each workload with the packed projections' previous plans (before/after)")
    ap.add_argument("--ab", default="", metavar="LEVERS",
                    help="also time each workload with levers off (bench/levers.py: " + ", ".join(LEVERS) +
                         ", pdl; a comma list, '+' joins a group): before and after in one run")
    ap.add_argument("--by-kernel", type=int, default=0, metavar="N",
                    help="then profile one run of the first workload per variant: device time against wall, "
                         "launches a step, N kernels by name")
    args = ap.parse_args(argv)
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.simulate_tp = args.simulate_tp or (8 if args.device.type == "cuda" else 2)
    args.workloads = parse_workloads(args.workloads)
    args.chunk_sizes = [int(c) for c in (args.chunk_size or str(args.max_num_batched_tokens)).split(",")]
    if min(args.chunk_sizes) < 1 or max(args.chunk_sizes) > args.max_num_batched_tokens:
        ap.error("--chunk-size values must be in [1, --max-num-batched-tokens]")
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    unknown = {n for g in args.ab.split(",") for n in g.split("+") if n} - set(LEVERS) - {"pdl"}
    if unknown:
        ap.error(f"--ab: unknown levers {sorted(unknown)}; choose from pdl, {', '.join(LEVERS)}")
    return args


def build(args, model_dir) -> LLM:
    longest = max(length for length, _ in args.workloads)
    return LLM(model_dir, device=args.device, simulate_tp=args.simulate_tp, num_layers=args.num_layers,
               simulate_collectives=args.collectives, max_num_seqs=max(c for _, c in args.workloads),
               max_model_len=longest + 8, chunk_size=args.chunk_sizes[0],
               max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=not args.graphs,
               skip_tokenizer_init=True)


def main(argv=None) -> int:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None and args.device.type == "cpu":
            from engine.realdims import SMALL

            model_dir = tmp
            Path(tmp, "config.json").write_text(json.dumps(SMALL))
        t0 = time.perf_counter()
        llm = build(args, model_dir)
        build_s = time.perf_counter() - t0
    try:
        cfg, peak = llm.model.cfg, bf16_peak(args.device)
        active = active_params(cfg)
        name = torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else "cpu"
        print(f"{name}: one rank of tp={args.simulate_tp}, {cfg.n_layers} layers, dim {cfg.dim}, built in "
              f"{build_s:.1f} s; {active / 1e9:.3f} G active params per token on this rank; matmul peak "
              f"{peak / 1e12:.1f} TFLOP/s; {args.max_num_batched_tokens} tokens/step, "
              f"collectives {'modelled' if args.collectives else 'free'}", flush=True)
        rng = random.Random(args.seed)
        rows = []
        for chunk in args.chunk_sizes:
            # the scheduler reads chunk_size per step: the same engine (weights, compiled
            # kernels) measures each chunk size
            llm.engine.scheduler.chunk_size = chunk
            print(f"chunk {chunk} tokens of one prompt per step\n{HEADER}")
            for length, count in args.workloads:
                for variant in variants(args):
                    with proj_variant(variant):
                        rows.append(dict(chunk_size=chunk, variant=variant,
                                         **measure(llm, length, count, args, rng, 2 * active, peak)))
                    print(format_row(rows[-1]) + ("" if variant == "default" else f"  {variant}"), flush=True)
        profiles = []
        if args.by_kernel and args.device.type == "cuda":
            for variant in variants(args):      # each variant's kernels and launches
                with proj_variant(variant):
                    profiles.append(profile_run(llm, *args.workloads[0], rng, args.by_kernel, variant))
    finally:
        llm.shutdown()
    if args.json:
        run = dict(device=name, simulate_tp=args.simulate_tp, layers=cfg.n_layers, dim=cfg.dim, model=args.model,
                   build_s=build_s, active_params=active, peak_flops=peak, chunk_sizes=args.chunk_sizes,
                   max_num_batched_tokens=args.max_num_batched_tokens, collectives=args.collectives,
                   numerics=llm.numerics, dtype=str(llm.dtype).removeprefix("torch."))
        Path(args.json).write_text(json.dumps(dict(run=run, rows=rows, profiles=profiles), indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
