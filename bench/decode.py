"""The whole decode step of one tensor-parallel rank at DeepSeek-V4-Flash's real dims.

    python bench/decode.py [--tp 8] [--layers 43] [--contexts 1024,8192,32768] [--batches 1,4,16,64]
                           [--quick] [--out results.json]

One rank of TP=N is built in memory with random weights in the real formats (FP8 attention
projections and shared expert, experts as the MoE path holds them), the collectives
skipped (engine.parallel.state.simulate) and their cost added from a latency model. For
each context and batch: step time eager and under a CUDA graph (median of CUDA-event
timings after warm-up), tok/s, bytes the step must read against the measured HBM
bandwidth, and a torch.profiler breakdown by kernel class of one eager step.
"""
import argparse
import json
import math
import re
import statistics

import torch

from engine.cache import KVCache
from bench.timing import graphed
from engine.kernels import set_kernels
from engine.model.config import ModelConfig
from engine.model.kv_cache import StepContext
from engine.model.model import Transformer
from engine.parallel import state

REAL = dict(vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=43,
            num_attention_heads=64, head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8,
            o_lora_rank=1024, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=6, num_hash_layers=3,
            routed_scaling_factor=1.5, swiglu_limit=10.0, sliding_window=128, index_n_heads=64, index_head_dim=128,
            index_topk=512, hc_mult=4, hc_sinkhorn_iters=20, rope_theta=10000, compress_rope_theta=160000,
            rope_scaling=dict(type="yarn", factor=16, original_max_position_embeddings=65536, beta_fast=32, beta_slow=1),
            max_position_embeddings=1048576, num_nextn_predict_layers=0, expert_dtype="fp4",
            quantization_config=dict(quant_method="fp8", fmt="e4m3", scale_fmt="ue8m0", weight_block_size=[128, 128]))
RATIOS = [0, 0] + [4, 128] * 20 + [4]

CLASSES = [("attention", r"sparse_mqa|_split_kernel|_combine_kernel|_naive"),
           ("indexer", r"_score_kernel|_topk_kernel|indexer"),
           ("moe", r"moe|_gate_up|_down"),
           ("dense_gemm", r"fp8_gemm|gemm|gemv|cutlass|sm90_|ampere|Kernel2|splitK|bmm|matmul"),
           ("glue", r".")]


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


def build(layers: int, tp: int):
    cfg = ModelConfig.from_dict({**REAL, "num_hidden_layers": layers, "compress_ratios": RATIOS[:layers],
                                 "num_hash_layers": min(3, layers)})
    state.simulate(0, tp)
    with torch.device("meta"):
        model = Transformer(cfg, dtype=torch.bfloat16, with_mtp=False)
    model = model.to_empty(device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dtype.is_floating_point:
                fan_in = p.shape[-1] if p.dim() > 1 else 1
                p.normal_(0, 1 / math.sqrt(fan_in), generator=g)
                if name.endswith(("norm.weight", "hc_attn_scale", "hc_ffn_scale", "hc_head_scale")):
                    p.add_(1)
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.randint(0, cfg.n_routed_experts, b.shape, device="cuda", generator=g))
            elif name.endswith("inv_freq"):
                pass
    for layer in model.layers:   # rotary tables were built on meta: rebuild them
        from engine.model.rope import layer_inv_freq

        layer.attn.inv_freq = layer_inv_freq(cfg, layer.layer).cuda()
    model.set_numerics("reference").eval()
    model.prepare_kernels()
    return cfg, model


def step_bytes(model, cfg, tp: int, batch: int, ctx_len: int) -> int:
    """Bytes one decode step must read at least: weights touched once, plus each sequence's keys."""
    total = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if "experts.w" in name or name.endswith(("embed.weight", "inv_freq", "tid2eid")) or t is None:
            continue
        total += t.numel() * t.element_size()
    for m in model.modules():
        if getattr(m, "qweight", None) is not None:
            total += m.qweight.numel() + m.qscale.numel()
    E, k = cfg.n_routed_experts, cfg.n_activated_experts
    touched = E * (1 - (1 - 1 / E) ** (batch * k))                  # expected distinct experts
    experts = model.layers[0].ffn.experts
    if experts.packed is not None:
        p = experts.packed
        per_expert = sum(t.numel() * t.element_size() for t in (p.w13, p.s13, p.w2, p.s2)) // p.E
    else:
        per_expert = sum(getattr(experts, w)[0].numel() * getattr(experts, w).element_size() for w in ("w1", "w2", "w3"))
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


def classify(name: str) -> str:
    for cls, pat in CLASSES:
        if re.search(pat, name, re.IGNORECASE):
            return cls
    return "glue"


def breakdown(run) -> dict:
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    out, count = {}, 0
    for e in prof.key_averages():
        if e.device_type.name != "CUDA" or e.self_device_time_total <= 0:
            continue
        c = classify(e.key)
        out[c] = out.get(c, 0.0) + e.self_device_time_total / 1e3       # ms
        count += e.count
    out["kernels"] = count
    return out


def allreduce_us(batch: int, layers: int, tp: int, alpha_us=8.0, beta_gbs=150.0) -> float:
    """Assumed NCCL all-reduce cost (no multi-GPU machine was lent to measure it): alpha + bytes/beta
    per call, 2 per layer (attention, MoE) plus the embedding; bf16 [batch, 4096] messages."""
    if tp == 1:
        return 0.0
    msg = batch * 4096 * 2
    per = alpha_us + 2 * (tp - 1) / tp * msg / (beta_gbs * 1e3)
    return (2 * layers + 1) * per


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--layers", type=int, default=43)
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--quick", action="store_true", help="a few layers, batches and contexts")
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--kernel-sets", default="default",
                    help="';'-separated ENGINE_KERNELS values run side by side on the same model, e.g. "
                         "'sparse_attn,indexer,bf16_gemm,fused_moe;default' (before/after the glue kernels)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.layers, args.contexts, args.batches = min(args.layers, 4), "1024,8192", "1,16,64"
    bw, peak = measure_bandwidth(), measure_bf16_peak()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s")
    cfg, model = build(args.layers, args.tp)
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    print(f"{'ctx':>6} {'B':>4} {'eager ms':>9} {'graph ms':>9} {'x':>5} {'tok/s':>8} {'+AR tok/s':>9} "
          f"{'roofline ms':>11} {'ach TB/s':>8}  breakdown (eager, ms)")
    for ctx_len in contexts:
        for B in batches:
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
                set_kernels(None if kset == "default" else kset)
                rows.append(measure(model, cfg, args, cache, ids, table, B, ctx_len, bw, kset))
            del cache
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), bandwidth=bw, bf16_peak=peak, tp=args.tp,
                           layers=args.layers, rows=rows), f, indent=1)


def measure(model, cfg, args, cache, ids, table, B, ctx_len, bw, kset) -> dict:
    """One (context, batch, kernel set): eager and graph step times, the profile, the roofline."""
    slots, positions = torch.arange(B, device="cuda"), torch.full((B, 1), ctx_len - 1, device="cuda")
    # a fresh StepContext per call, as the runner makes one per step (it memoises the rope tables)
    run = lambda: model.forward_step(ids, StepContext(slots, positions, table, cache.block_tokens, ctx_len),  # noqa: E731
                                     cache.layers)
    with torch.inference_mode():
        t_eager = timed(run, reps=10)
        t_graph = None
        if not args.no_graphs:
            replay = graphed(run)
            t_graph = timed(replay, reps=20)
            del replay
        br = breakdown(run)
    t = t_graph or t_eager
    ar = allreduce_us(B, cfg.n_layers, args.tp) / 1e6
    nbytes = step_bytes(model, cfg, args.tp, B, ctx_len)
    row = dict(ctx=ctx_len, batch=B, kernels=kset, eager_ms=t_eager * 1e3, graph_ms=t_graph and t_graph * 1e3,
               tok_s=B / t, tok_s_with_allreduce=B / (t + ar), allreduce_ms=ar * 1e3,
               bytes=nbytes, roofline_ms=nbytes / bw * 1e3, achieved_tbs=nbytes / t / 1e12, breakdown=br)
    bd = " ".join(f"{k}={v:.2f}" if k != "kernels" else f"kernels={v}" for k, v in br.items())
    print(f"{ctx_len:>6} {B:>4} {t_eager * 1e3:>9.2f} {(t_graph or 0) * 1e3:>9.2f} "
          f"{t_eager / t:>5.1f} {B / t:>8.1f} {B / (t + ar):>9.1f} {nbytes / bw * 1e3:>11.2f} "
          f"{nbytes / t / 1e12:>8.2f}  [{kset}] {bd}", flush=True)
    return row


if __name__ == "__main__":
    main()
