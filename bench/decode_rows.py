"""bench/decode.py's bookkeeping, CUDA-free: the all-reduce latency model, kernel classes, result
rows (JSON) and the side-by-side table of variants (this tree vs a --baseline tree)."""
import re

from decode_grid import latency

CLASSES = [("attention", r"sparse_mqa|_split_kernel|_combine_kernel|_naive"),
           ("indexer", r"_score_kernel|_topk_kernel|indexer"),
           ("moe", r"moe|_gate_up|_down"),
           ("dense_gemm", r"fp8_gemm|gemm|gemv|cutlass|sm90_|ampere|Kernel2|splitK|bmm|matmul"),
           ("glue", r".")]


def classify(name: str) -> str:
    for cls, pat in CLASSES:
        if re.search(pat, name, re.IGNORECASE):
            return cls
    return "glue"


def allreduce_us(batch: int, layers: int, tp: int, alpha_us=None, beta_gbs=None) -> float:
    """Assumed NCCL all-reduce cost of one step (engine/parallel/latency.py's model): 2 calls per
    layer (attention, MoE) plus the embedding, each a bf16 [batch, 4096] message."""
    return (2 * layers + 1) * latency.all_reduce_us(batch * 4096 * 2, tp, alpha_us, beta_gbs)


def make_row(*, ctx: int, batch: int, variant: str, kernel_set: str, layers: int, tp: int, eager_s: float,
             graph_s: float | None, nbytes: int, bandwidth: float, breakdown: dict) -> dict:
    """One measurement -> the JSON row. Times in ms; achieved_tbs = bytes the step must read / its
    time; roofline_ms = those bytes at the measured copy bandwidth; kernels = launches per step
    (profiled eagerly: a graph replays the same launches)."""
    t = graph_s or eager_s
    ar = allreduce_us(batch, layers, tp) / 1e6
    kernels = int(breakdown.get("kernels", 0))
    return dict(ctx=ctx, batch=batch, variant=variant, kernel_set=kernel_set,
                eager_ms=eager_s * 1e3, graph_ms=graph_s * 1e3 if graph_s else None,
                kernels=kernels, kernels_per_layer=kernels / layers,
                tok_s=batch / t, tok_s_with_allreduce=batch / (t + ar), allreduce_ms=ar * 1e3,
                bytes=nbytes, roofline_ms=nbytes / bandwidth * 1e3, achieved_tbs=nbytes / t / 1e12,
                breakdown={k: v for k, v in breakdown.items() if k != "kernels"})


HEADER = (f"{'variant':>10} {'ctx':>6} {'B':>4} {'eager ms':>9} {'graph ms':>9} {'tok/s':>8} {'+AR tok/s':>9} "
          f"{'roofline ms':>11} {'ach TB/s':>8} {'kernels':>7} {'/layer':>6}  breakdown (eager, ms)")


def format_row(r: dict) -> str:
    bd = " ".join(f"{k}={v:.2f}" for k, v in r["breakdown"].items())
    ks = "" if r["kernel_set"] == "default" else f" [{r['kernel_set']}]"
    return (f"{r['variant'][:10]:>10} {r['ctx']:>6} {r['batch']:>4} {r['eager_ms']:>9.2f} {r['graph_ms'] or 0:>9.2f} "
            f"{r['tok_s']:>8.1f} {r['tok_s_with_allreduce']:>9.1f} {r['roofline_ms']:>11.2f} "
            f"{r['achieved_tbs']:>8.2f} {r['kernels']:>7} {r['kernels_per_layer']:>6.1f} {bd}{ks}"
            + (f" | avg over {r['avg_positions']} positions {r['avg_graph_ms']:.2f} ms" if r.get("avg_graph_ms") else ""))


def side_by_side(rows: list[dict]) -> list[str]:
    """Rows of every variant and kernel set grouped by (ctx, batch), variants in first-seen order,
    each after the first with its graph-time speedup over the first."""
    order = list(dict.fromkeys((r["variant"], r["kernel_set"]) for r in rows))
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["ctx"], r["batch"]), {})[(r["variant"], r["kernel_set"])] = r
    lines = [HEADER]
    for key in sorted(groups):
        g, first = groups[key], None
        for v in order:
            if v not in g:
                continue
            r, line = g[v], format_row(g[v])
            t = r["graph_ms"] or r["eager_ms"]
            if first is None:       # the group's first row present is what the others compare with
                first, label = t, v[0] if v[1] == "default" else f"{v[0]} [{v[1]}]"
            else:
                line += f"  x{first / t:.2f} vs {label}"
            lines.append(line)
    return lines
