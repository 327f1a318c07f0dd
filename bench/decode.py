"""The whole decode step of one tensor-parallel rank at DeepSeek-V4-Flash's real dims.

    python bench/decode.py [--tp 8] [--layers 43] [--contexts 1024,8192,32768] [--batches 1,4,16,64]
                           [--experts mxfp4|nvfp4] [--baseline DIR] [--quick] [--out results.json]

One rank of TP=N is built in memory with random weights in the real formats (FP8 attention
projections and shared expert; routed experts rounded onto the MXFP4 (or NVFP4) grid, so they
pack for the fused MoE kernel as a checkpoint's do: any expert left on the torch fallback is an
error), the collectives answered by a simulated process group (engine.parallel.state.init_simulated,
its modelled delay off) and their cost added to the rows from engine/parallel/latency.py's model.
The dims and grid rounding are engine/realdims.py's (engine.simulate builds its ranks from them).
For each context and batch: step time eager and under a CUDA graph (median of CUDA-event
timings after warm-up) at the last position of the context, where every compressor's window
completes (the worst step: each CSA and HCA layer pools an entry), with --average N also the
mean graph step over the N positions up to it (CSA pools every 4th token, HCA every 128th),
tok/s, kernel launches per step (and per layer), bytes the step must read against the measured
HBM bandwidth (roofline_ms, achieved_tbs), and a torch.profiler breakdown by kernel class of one
eager step.

--baseline DIR: DIR is a checkout of an older commit (`git worktree add /tmp/base c478b5a`). The
same measurement then runs first with DIR's engine in a subprocess (this script, with DIR first on
the path: the grid rounding and bookkeeping are this tree's, the model and kernels DIR's) and the
rows print side by side, labelled by variant ("HEAD" and DIR's commit).

--compiled: also the baseline a user would pick instead, in a subprocess: the torch reference step
(kernels off, the routed experts dequantised to bf16) under torch.compile and a CUDA graph
(compile_step), at --compiled-batches (1 and 64), labelled "compiled".

--ab post_mix,attn_splits,...: one lever's before and after in one run on one model: the step is
captured once more with the lever off (LEVERS: the module constant it reads at launch; on, for a
lever off by default) and the two graphs replay in alternation; "a+b" turns a group off together. --pdl-ab is --ab pdl.
"""
import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# the engine under test: this tree, or the --baseline tree a parent run points us at; then this
# tree's bench helpers as top-level modules (the baseline tree has none of them)
TREE = Path(os.environ.get("DECODE_BENCH_TREE") or HERE.parent).resolve()
sys.path[:0] = [str(TREE), str(HERE)]

import torch  # noqa: E402

from decode_grid import (init_random, real_dict, round_experts_mxfp4, round_experts_nvfp4,  # noqa: E402
                         round_fp8_linears, unpacked_experts)
from decode_rows import classify, format_row, make_row, side_by_side, HEADER  # noqa: E402
from levers import LEVERS, lever_off  # noqa: E402
from timing import graphed  # noqa: E402

from engine.cache import KVCache  # noqa: E402
from engine.kernels import set_kernels  # noqa: E402
from engine.model import formats  # noqa: E402
from engine.model.config import ModelConfig  # noqa: E402
from engine.model import kv_cache  # noqa: E402
from engine.model.model import Transformer  # noqa: E402
from engine.parallel import state  # noqa: E402

def measure_bandwidth() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    t = timed(lambda: y.copy_(x), reps=20)
    return 2 * x.numel() / t            # bytes read + written per second


def measure_bf16_peak() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = timed(lambda: a @ a, reps=10)
    return 2 * 8192 ** 3 / t


def timed(fn, reps=30, warmup=3) -> float:
    """Median seconds of fn over reps, by CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def simulate_rank(rank: int, tp: int):
    """One rank of tp with no other process: this tree's explicit simulated group, or an older
    tree's state.simulate (a baseline run)."""
    init = getattr(state, "init_simulated", None)
    (init or state.simulate)(rank, tp)


def build(layers: int, tp: int, experts: str = "mxfp4", kernels=None):
    """-> (cfg, model) of one rank in the real formats, prepared with `kernels` (None: the default
    set, whose fused MoE must take every expert; "none": the references, experts left in bf16)."""
    # nvfp4: W4A16 experts as NVIDIA's checkpoint declares them (no FP8 rounding of their inputs)
    cfg = ModelConfig.from_dict({**real_dict(layers), "expert_dtype": "nvfp4" if experts == "nvfp4" else "fp4"})
    simulate_rank(0, tp)        # collectives answered at no cost: make_row adds their modelled cost
    with torch.device("meta"):
        model = Transformer(cfg, dtype=torch.bfloat16, with_mtp=False)
    model = model.to_empty(device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    init_random(model.named_parameters(), model.named_buffers(), g, cfg.n_routed_experts)
    from engine.model.rope import layer_inv_freq

    for layer in model.layers:   # rotary tables were built on meta: rebuild them
        layer.attn.inv_freq = layer_inv_freq(cfg, layer.layer).cuda()
    # the experts on the FP4 grid, so that prepare_kernels packs them for the fused MoE kernel
    if experts == "nvfp4":
        round_experts_nvfp4(model, formats.nvfp4_quant, formats.nvfp4_dequant)
    else:
        round_experts_mxfp4(model, formats.mxfp4_quant, formats.mxfp4_dequant)
    # FP8 projections on the e4m3 grid, as a checkpoint's: the packed projections keep them as FP8
    round_fp8_linears(model, formats.fp8_block_quant, getattr(formats, "fp8_block_dequant", None) or _dequant())
    model.set_numerics("reference").eval()
    model.prepare_kernels(*([] if kernels is None else [kernels]))     # (an older tree's takes no set)
    left = unpacked_experts(model) if kernels != "none" else []
    if left:
        raise RuntimeError(f"{len(left)} experts modules did not pack for the fused MoE kernel ({left[:3]} ...): "
                           "the bench would time the torch fallback, not the engine's decode step")
    return cfg, model


def _dequant():
    from engine.numerics import fp8_block_dequant
    return fp8_block_dequant


def step_bytes(model, cfg, tp: int, batch: int, ctx_len: int) -> int:
    """Bytes one decode step must read at least: weights touched once (as the step holds them:
    packed projections' FP8 rows at one byte), plus each sequence's keys."""
    total = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if "experts.w" in name or name.endswith(("embed.weight", "inv_freq", "tid2eid")) or t is None:
            continue
        total += t.numel() * t.element_size()
    for m in model.modules():
        if getattr(m, "qweight", None) is not None:
            total += m.qweight.numel() + m.qscale.numel()
    for layer in model.layers:          # FP8 rows of the packed projections replace their bf16 weights
        for p in (getattr(layer, "proj", None) or {}).values():
            if p is not None and p.w8 is not None:
                bf16_rows = sum(out for r, _, out, _ in p.outs.values() if r < p.n8)
                total += p.w8.numel() + p.s8.numel() - bf16_rows * p.K * 2
    E, k = cfg.n_routed_experts, cfg.n_activated_experts
    touched = E * (1 - (1 - 1 / E) ** (batch * k))                  # expected distinct experts
    ex = model.layers[0].ffn.experts
    p = ex.packed
    if p is not None:
        per_expert = sum(t.numel() * t.element_size() for t in (p.w13, p.s13, p.w2, p.s2)) // p.E
    else:      # the reference's experts (the --compiled baseline): as held, bf16
        per_expert = sum(w[0].numel() * w.element_size() for w in (ex.w1, ex.w3, ex.w2))
    total += int(cfg.n_layers * touched * per_expert)
    kv = 0
    for i in range(cfg.n_layers):
        r = cfg.ratio(i)
        kv += 128 * cfg.head_dim * 2
        if r == 4:
            kv += min(cfg.index_topk, ctx_len // 4) * cfg.head_dim * 2 + ctx_len // 4 * cfg.index_head_dim * 2
        elif r:
            kv += ctx_len // r * cfg.head_dim * 2
    return total + batch * kv


def breakdown(run, by_kernel: int = 0) -> dict:
    """Kernel time (ms) by class over one eager step, and the launches; by_kernel: also print
    that many kernels by name (launches, us) -- where the glue is."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    out, count, names = {}, 0, []
    for e in prof.key_averages():
        if e.device_type.name != "CUDA" or e.self_device_time_total <= 0:
            continue
        c = classify(e.key)
        out[c] = out.get(c, 0.0) + e.self_device_time_total / 1e3       # ms
        count += e.count
        names.append((e.self_device_time_total, e.count, e.key))
    for us, n, key in sorted(names, reverse=True)[:by_kernel]:
        print(f"    {n:>5} x {us / n:7.2f} us = {us / 1e3:7.3f} ms  {key[:110]}")
    out["kernels"] = count
    return out


def use_kernels(model, kset: str):
    """This tree: the model's Ops are chosen at prepare_kernels (and graphs capture them); an older
    tree (a --baseline run) read a global switch while the step was traced."""
    names = None if kset == "default" else kset
    if hasattr(model, "ops"):
        model.prepare_kernels(names)
    else:
        set_kernels(names)


def step_fn(model, cache, ids, slots, positions, table, ctx_len):
    """One decode step at the given buffers, with fresh per-step inputs each call (as the runner
    makes one per step: they memoise the rope tables): StepInputs here, StepContext in an older tree."""
    if hasattr(kv_cache, "StepInputs"):
        return lambda: model.forward_step(kv_cache.StepInputs(ids, positions, slots, table, cache.block_tokens, ctx_len),
                                          cache.layers)
    return lambda: model.forward_step(ids, kv_cache.StepContext(slots, positions, table, cache.block_tokens, ctx_len),
                                      cache.layers)


def average_step(replay, positions, ctx_len: int, n: int) -> float:
    """Mean seconds of the captured step over the n positions ending at ctx_len - 1: each
    position copied into the graph's input before its replays (the windows complete in their
    share of them); the position is left at ctx_len - 1."""
    times = []
    for p in range(ctx_len - n, ctx_len):
        positions.fill_(p)
        times.append(timed(replay, reps=3, warmup=1))
    positions.fill_(ctx_len - 1)
    return statistics.mean(times)


def ab(run, replay_on, ctx_len, B, levers: str, rounds=5) -> dict:
    """The same step captured again with each lever (or '+'-joined group of levers) flipped; each
    replayed in alternation with the step as it is (rounds of 20), so drift hits both alike ->
    {levers: (on ms, off ms)} medians, printed."""
    out = {}
    for group in levers.split(","):
        with contextlib.ExitStack() as stack:
            for name in group.split("+"):
                stack.enter_context(lever_off(name))
            replay_off = graphed(run)
        on, off = [], []
        for _ in range(rounds):
            on.append(timed(replay_on, reps=20))
            off.append(timed(replay_off, reps=20))
        a, b = statistics.median(on) * 1e3, statistics.median(off) * 1e3
        out[group] = (a, b)
        print(f"  A/B ctx {ctx_len} B {B}: as is {a:.3f} ms, {group} off {b:.3f} ms "
              f"({(a - b):+.3f} ms from {group})", flush=True)
        del replay_off
    return out


def measure(model, cfg, args, cache, ids, table, B, ctx_len, bw, kset) -> dict:
    """One (context, batch, kernel set): eager and graph step times, the profile, the roofline."""
    slots, positions = torch.arange(B, device="cuda"), torch.full((B, 1), ctx_len - 1, device="cuda")
    run = step_fn(model, cache, ids, slots, positions, table, ctx_len)
    with torch.inference_mode():
        if args.compile:     # the first call compiles: report how long, outside the timings
            t0 = time.perf_counter()
            run()
            torch.cuda.synchronize()
            print(f"  ctx {ctx_len} B {B}: first (compiling) step {time.perf_counter() - t0:.1f} s", flush=True)
        t_eager = timed(run, reps=10)
        t_graph = t_avg = ab_ms = None
        if not args.no_graphs:
            replay = graphed(run)
            t_graph = timed(replay, reps=20)
            if args.average:
                t_avg = average_step(replay, positions, ctx_len, min(args.average, ctx_len))
            levers = ",".join(x for x in (args.ab, "pdl" if args.pdl_ab else "") if x)
            ab_ms = ab(run, replay, ctx_len, B, levers) if levers else None
            del replay
        br = breakdown(run, args.by_kernel)
    row = make_row(ctx=ctx_len, batch=B, variant=args.variant, kernel_set=kset, layers=cfg.n_layers, tp=args.tp,
                   eager_s=t_eager, graph_s=t_graph, nbytes=step_bytes(model, cfg, args.tp, B, ctx_len),
                   bandwidth=bw, breakdown=br)
    if t_avg is not None:
        row.update(avg_graph_ms=t_avg * 1e3, avg_positions=min(args.average, ctx_len))
    if ab_ms:
        row["ab_ms"] = {k: {"as_is": a, "off": b} for k, (a, b) in ab_ms.items()}
    print(format_row(row), flush=True)
    return row


def compile_step():
    """The baseline a user would reach for: the torch reference step (kernels off) with every
    block under torch.compile (inductor, specialised shapes; one graph per kind of layer and batch,
    the collectives and data-dependent sizes breaking it where they must), the whole step then
    captured in a CUDA graph as ours is (measure's `graphed`)."""
    import torch._dynamo

    from engine.model import kv_cache, step
    from engine.parallel.state import SimulatedGroup

    cfg = torch._dynamo.config                       # 43 blocks of several kinds, at each batch
    setattr(cfg, "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit", 256)
    if hasattr(cfg, "accumulated_recompile_limit"):
        cfg.accumulated_recompile_limit = 4096
    # the step's memo (rope tables made by the first layer that asks) left out of the traces: traced,
    # its dict's contents are guarded, and every layer that finds another set of keys recompiles
    kv_cache.StepInputs.once = torch._dynamo.disable(kv_cache.StepInputs.once)
    # the simulated rank's collectives break the graph where NCCL's would (their call counters, traced,
    # would recompile every call)
    for name in ("all_reduce", "all_gather_last"):
        setattr(SimulatedGroup, name, torch._dynamo.disable(getattr(SimulatedGroup, name)))
    step.block = torch.compile(step.block, dynamic=False)


def run_all(args, bw) -> list[dict]:
    cfg, model = build(args.layers, args.tp, args.experts, "none" if args.compile else None)
    if args.compile:
        compile_step()
    rows = []
    print(HEADER)
    for ctx_len in [int(c) for c in args.contexts.split(",")]:
        for B in [int(b) for b in args.batches.split(",")]:
            per_seq = KVCache(cfg, 1, 1 << 30, "meta", torch.bfloat16)
            need = per_seq.slot_bytes() * (B + 1) + per_seq.block_bytes() * (per_seq.blocks_needed(ctx_len) * B + 2)
            if need > torch.cuda.mem_get_info()[0] * 0.8:
                print(f"{ctx_len:>6} {B:>4}  skipped: the cache needs {need / 2**30:.1f} GiB")
                continue
            cache = KVCache(cfg, B, need, "cuda", torch.bfloat16)
            nb = cache.blocks_needed(ctx_len)
            table = torch.tensor([cache.allocate(nb) for _ in range(B)], device="cuda")
            for c in cache.layers:
                for t in (c.window, c.kv, c.idx_k):
                    if t is not None:
                        t.normal_()
            ids = torch.randint(0, cfg.vocab_size, (B, 1), device="cuda")
            for kset in args.kernel_sets.split(";"):
                use_kernels(model, kset)
                rows.append(measure(model, cfg, args, cache, ids, table, B, ctx_len, bw, kset))
            if not args.compile:      # (prepare_kernels with the fused MoE would pack its bf16 experts)
                use_kernels(model, "default")
            del cache
            torch.cuda.empty_cache()
    del model
    torch.cuda.empty_cache()
    return rows


def tree_label(tree: Path) -> str:
    """A tree's short commit, or its folder name where it is no git checkout (git archive: git
    would answer with the commit of a checkout around it)."""
    if not (tree / ".git").exists():
        return tree.name
    try:
        out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=30)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return tree.name


def child_command(args, label: str, out: str) -> list[str]:
    """This script, rerun for a --baseline tree: the same measurement, labelled `label`, into `out`."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--tp", str(args.tp), "--layers", str(args.layers),
           "--contexts", args.contexts, "--batches", args.batches, "--kernel-sets", args.kernel_sets,
           "--experts", args.experts, "--variant", label, "--out", out]
    return cmd + (["--no-graphs"] if args.no_graphs else []) + (["--average", str(args.average)] if args.average else [])


def run_compiled(args) -> list[dict]:
    """The torch.compile baseline (compile_step) at --compiled-batches, in a subprocess of this tree
    (its model holds the experts in bf16: no room beside ours) -> its rows."""
    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "rows.json")
        cmd = child_command(argparse.Namespace(**{**vars(args), "batches": args.compiled_batches,
                                                  "kernel_sets": "none"}), "compiled", out)
        print("--- torch.compile baseline (kernels off) ---", flush=True)
        done = subprocess.run(cmd + ["--compile"])
        if done.returncode != 0:      # ours still measured; the missing rows said loudly
            print(f"!!! the torch.compile baseline failed (exit {done.returncode}): no compiled rows", flush=True)
            return []
        return json.loads(Path(out).read_text())["rows"]


def run_baseline(args) -> list[dict]:
    """The same measurement with the --baseline tree's engine, in a subprocess -> its rows."""
    tree = Path(args.baseline).resolve()
    if not (tree / "engine" / "__init__.py").exists():
        raise SystemExit(f"--baseline {tree}: no engine/ there (make one with `git worktree add {tree} <commit>`)")
    label = tree_label(tree)
    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "rows.json")
        env = {**os.environ, "DECODE_BENCH_TREE": str(tree),
               "PYTHONPATH": os.pathsep.join([str(tree)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
        print(f"--- baseline {label} ({tree}) ---", flush=True)
        subprocess.run(child_command(args, label, out), env=env, check=True)
        print(f"--- {args.variant} ({TREE}) ---", flush=True)
        return json.loads(Path(out).read_text())["rows"]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="one TP rank's decode step at V4-Flash dims (CUDA)")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--layers", type=int, default=43)
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--quick", action="store_true", help="a few layers, batches and contexts")
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--kernel-sets", default="default",
                    help="';'-separated ENGINE_KERNELS values run side by side on the same model, e.g. "
                         "'sparse_attn,indexer,bf16_gemm,fused_moe;default' (before/after the glue kernels)")
    ap.add_argument("--experts", choices=("mxfp4", "nvfp4"), default="mxfp4",
                    help="the grid the random routed experts are rounded onto (the fused MoE packs either)")
    ap.add_argument("--baseline", default=None, metavar="DIR",
                    help="also measure the engine of this checkout (an older commit), side by side")
    ap.add_argument("--compiled", action="store_true",
                    help="also time the torch reference step under torch.compile + CUDA graphs (compile_step)")
    ap.add_argument("--compiled-batches", default="1,64", help="the batches of --compiled")
    ap.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)   # the --compiled child
    ap.add_argument("--variant", default="HEAD", help="this tree's label in the rows")
    ap.add_argument("--out", default=None, help="write the rows (all variants) as JSON")
    ap.add_argument("--pdl-ab", action="store_true", help="also time each graph captured with PDL off, alternating")
    ap.add_argument("--ab", default="", metavar="LEVERS",
                    help="also time each graph captured with a lever off, alternating with it on: a comma list of "
                         "pdl, " + ", ".join(LEVERS) + ", or '+'-joined groups of them (this tree only)")
    ap.add_argument("--average", type=int, default=0, metavar="N",
                    help="also the mean graph step over the N positions up to the last (the typical step)")
    ap.add_argument("--by-kernel", type=int, default=0, metavar="N",
                    help="print each row's N costliest kernels by name (launches x us)")
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, args.contexts, args.batches = min(args.layers, 4), "1024,8192", "1,16,64"
    return args


def main(argv=None):
    args = parse_args(argv)
    logging_setup()
    import engine

    print(f"engine under test: {Path(engine.__file__).parent} (variant {args.variant})", flush=True)
    bw, peak = measure_bandwidth(), measure_bf16_peak()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s")
    rows = run_baseline(args) if args.baseline else []     # first: one model in GPU memory at a time
    rows += run_compiled(args) if args.compiled else []
    rows += run_all(args, bw)
    if args.baseline or args.compiled:
        print("\n".join(side_by_side(rows)))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), bandwidth=bw, bf16_peak=peak, tp=args.tp,
                           layers=args.layers, experts=args.experts, rows=rows), f, indent=1)


def logging_setup():
    import logging

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")


if __name__ == "__main__":
    main()
