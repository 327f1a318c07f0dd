"""Sparse MQA decode attention: split-K head-batched kernel vs the naive per-head kernel vs torch (CUDA).

    python bench/attention.py [--quick] [--ctx 1024 8192 32768] [--T 1 8 64] [--H 8 64] [--sweep]

Real dims: D 512, H 8 (one TP=8 rank) and 64 (TP=1), window 128. Per layer kind the keys a token
reads: CSA = window + the indexer's top-min(512, ctx/4) entries (ascending, as the indexer emits
them), HCA = window + all ctx/128 entries. Every row is its own sequence: its own ring slot and its
own shuffled pool blocks, so rows share no keys. Per (kind, ctx, H, T), do_bench medians (L2 cleared
between repetitions, so keys come from HBM) of: the torch reference (gather + attend), the naive
per-head kernel, the split-K kernel eager and under CUDA-graph replay (how decode runs it), with the
split count it chose. Bytes moved / the copy bandwidth and FLOPs / the bf16 GEMM rate, both measured
in this run, give the roofline; the achieved fractions are of the graph time.
--sweep adds a table of launch-config alternatives (tile sizes, head tile, stages, warps, splits).
"""
import argparse
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.kernels import sparse_attn as sa  # noqa: E402
from bench.timing import graphed, measured_peaks  # noqa: E402

D, W, TOPK, PB = 512, 128, 512, 32
REP = dict(warmup=25, rep=100)


def median(fn) -> float:
    return do_bench(fn, return_mode="median", **REP)                              # ms


def n_entries(kind: str, ctx: int) -> tuple[int, int]:
    """-> (compressed entries visible, entries read) for one token at the end of a ctx-long sequence."""
    n = ctx // 4 if kind == "csa" else ctx // 128
    return n, (min(TOPK, n) if kind == "csa" else n)


def inputs(kind: str, ctx: int, T: int, H: int):
    """Row t: ring slot t (a full window), its n entries in its own shuffled blocks of one pool."""
    n, k = n_entries(kind, ctx)
    nb = -(-n // PB)
    bt = (torch.randperm(T * nb, device="cuda") + 1).view(T, nb)                  # block 0 unused
    if kind == "csa":
        ent = torch.rand(T, n, device="cuda").topk(k, dim=1).indices.sort(dim=1).values
    else:
        ent = torch.arange(n, device="cuda").expand(T, n)
    idx_b = (bt.gather(1, ent // PB) * PB + ent % PB).int()
    idx_a = (torch.arange(T, device="cuda")[:, None] * W + torch.arange(W, device="cuda")).int()
    bf = dict(dtype=torch.bfloat16, device="cuda")
    return dict(q=torch.randn(T, H, D, **bf), kv_a=torch.randn(T * W, D, **bf), idx_a=idx_a,
                kv_b=torch.randn((T * nb + 1) * PB, D, **bf), idx_b=idx_b,
                sink=torch.randn(H, device="cuda"), scale=D ** -0.5)


def kernel_op(x, splits=None):
    """The split-K op with its out and workspace fixed (graph-safe) -> (thunk, splits used)."""
    T, H, _ = x["q"].shape
    K = x["idx_a"].shape[1] + x["idx_b"].shape[1]
    groups = sa.head_tiling(H)[1]
    s = splits or sa.choose_num_splits(T, K, sa.sm_count(x["q"].device), groups)
    ws = sa.Workspace.get(T, H, D, max(2, s), "cuda")
    out = torch.empty_like(x["q"])
    return (lambda: sa.sparse_mqa(**x, num_splits=s, out=out, workspace=ws)), s


def rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    return float(((a - b).abs().amax(-1) / b.abs().amax(-1).clamp(min=1e-30)).max())


def bench_one(kind, ctx, T, H, bw, peak) -> str:
    x = inputs(kind, ctx, T, H)
    K = x["idx_a"].shape[1] + x["idx_b"].shape[1]
    op, s = kernel_op(x)
    err = rel_err(op(), sa.sparse_mqa_ref(**{k: v.float() if k in ("q", "kv_a", "kv_b") else v
                                             for k, v in x.items()}))
    ref = median(lambda: sa.sparse_mqa_ref(**x))
    naive_out = torch.empty_like(x["q"])
    naive = median(lambda: sa.sparse_mqa_naive(**x, out=naive_out))
    eager = median(op)
    graph = median(graphed(op))
    nbytes, flops = sa.attention_bytes(T, H, D, K), sa.attention_flops(T, H, D, K)
    us = graph * 1e3
    roof = max(nbytes / bw, flops / peak) * 1e6
    return (f"| {kind} | {ctx // 1024}k | {H} | {T} | {K} | {s} | {ref * 1e3:.1f} | {naive * 1e3:.1f} "
            f"| {eager * 1e3:.1f} | {us:.1f} | {naive / graph:.1f}x | {ref / graph:.1f}x "
            f"| {nbytes / us / 1e3:.0f} ({nbytes / us / 1e-6 / bw:.0%}) "
            f"| {flops / us / 1e6:.1f} ({flops / us / 1e-6 / peak:.1%}) | {roof:.1f} | {err:.1e} |")


# ---------------------------------------------------------------------------------------------------
# --sweep: launch-config alternatives, each timed under graph replay

def configs():
    """(label, module overrides, splits) alternatives to the defaults."""
    yield "default", {}, None
    for bn in (16, 64):
        yield f"BLOCK_N={bn}", {"BLOCK_N": bn}, None
    for ht in (16, 64):
        yield f"HEAD_TILE={ht}", {"HEAD_TILE": ht}, None
    for mk in (32, 64):
        yield f"MIN_KEYS_PER_SPLIT={mk}", {"MIN_KEYS_PER_SPLIT": mk}, None
    yield "BLOCK_N=64, MIN_KEYS_PER_SPLIT=64", {"BLOCK_N": 64, "MIN_KEYS_PER_SPLIT": 64}, None   # one 64-key tile a split
    yield "PROGRAMS_PER_SM=4", {"PROGRAMS_PER_SM": 4}, None
    for st in (1, 3):
        yield f"NUM_STAGES={st}", {"NUM_STAGES": st}, None
    for w in (4, 8):
        yield f"num_warps={w}", {"_num_warps": (lambda bh, w=w: w)}, None
    for s in (1, 2, 3, 4, 6, 8, 12, 16, 20, 32):
        yield f"splits={s}", {}, s


SWEEP_CASES = "csa:32768:8:1,csa:32768:64:1,csa:32768:8:16,csa:32768:64:16,csa:32768:8:128,csa:32768:64:128," \
              "hca:32768:8:1,hca:32768:64:32"


def sweep(bw, cases: str = SWEEP_CASES):
    print("\n| kind | ctx | H | T | config | splits | graph us | GB/s (of copy) |")
    print("|" + " --- |" * 8)
    for case in cases.split(","):
        kind, ctx, H, T = case.split(":")
        ctx, H, T = int(ctx), int(H), int(T)
        x = inputs(kind, ctx, T, H)
        K = x["idx_a"].shape[1] + x["idx_b"].shape[1]
        for label, over, splits in configs():
            keep = {k: getattr(sa, k) for k in over}
            try:
                for k, v in over.items():
                    setattr(sa, k, v)
                op, s = kernel_op(x, splits)
                us = median(graphed(op)) * 1e3
                gbs = sa.attention_bytes(T, H, D, K) / us / 1e3
                print(f"| {kind} | {ctx // 1024}k | {H} | {T} | {label} | {s} | {us:.1f} "
                      f"| {gbs:.0f} ({gbs * 1e9 / bw:.0%}) |", flush=True)
            except Exception as e:                                   # e.g. out of shared memory
                print(f"| {kind} | {ctx // 1024}k | {H} | {T} | {label} | - | failed: {type(e).__name__} | |")
            finally:
                for k, v in keep.items():
                    setattr(sa, k, v)
        del x
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="ctx 8k, batches 1, 16, 256: under a minute")
    ap.add_argument("--ctx", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--T", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    ap.add_argument("--H", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--kinds", nargs="+", default=["csa", "hca"])
    ap.add_argument("--sweep", action="store_true", help="also compare launch-config alternatives")
    ap.add_argument("--sweep-cases", default=SWEEP_CASES, metavar="KIND:CTX:H:T,...", help="the sweep's cases")
    ap.add_argument("--sweep-only", action="store_true", help="the sweep without the main table")
    args = ap.parse_args()
    ctxs, Ts = ([8192], [1, 16, 256]) if args.quick else (args.ctx, args.T)
    if args.quick:
        REP.update(warmup=10, rep=30)
    bw, peak = measured_peaks()
    sms = sa.sm_count(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()} ({sms} SMs): copy {bw / 1e12:.2f} TB/s, "
          f"bf16 GEMM {peak / 1e12:.0f} TFLOP/s (measured); BLOCK_N {sa.BLOCK_N}, HEAD_TILE {sa.HEAD_TILE}, "
          f"stages {sa.NUM_STAGES}")
    print("| kind | ctx | H | T | keys | splits | ref us | naive us | eager us | graph us | vs naive | vs ref "
          "| GB/s (of copy) | TFLOP/s (of GEMM) | roofline us | rel err |")
    print("|" + " --- |" * 16)
    for kind in ([] if args.sweep_only else args.kinds):
        for ctx in ctxs:
            for H in args.H:
                for T in Ts:
                    print(bench_one(kind, ctx, T, H, bw, peak), flush=True)
                    torch.cuda.empty_cache()
    if args.sweep or args.sweep_only:
        sweep(bw, args.sweep_cases)


if __name__ == "__main__":
    main()
