"""Lightning indexer at decode: the Triton op vs its torch reference, against measured rooflines (CUDA).

    python bench/indexer.py [--quick] [--ctx 1024 8192 32768] [--T 1 8 64 256]

Real shapes: 64 indexer heads, d 128, top-512, 32 entries per block (128 tokens / ratio 4), every
row seeing all ctx/4 entries of its own sequence (the full-context worst case; rows share no keys).
Per (ctx, T), do_bench medians in us of: the reference (the model's torch math), the op eager,
the op under CUDA-graph replay (how decode runs it), its score kernel alone (graph), and the op
with torch.topk in place of the Triton top-k (graph). Bytes moved / the measured copy bandwidth and
FLOPs / the measured bf16 GEMM rate give the roofline time; both peaks are measured in this run.
do_bench clears L2 between repetitions, so every run reads its keys from HBM.
"""
import argparse
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.kernels import indexer as ix  # noqa: E402
from bench.timing import graphed, measured_peaks  # noqa: E402

H, D, TOPK, PB = 64, 128, 512, 32


def median(fn) -> float:
    return do_bench(fn, return_mode="median")                                    # ms


def inputs(T, N):
    """Each row's N entries live in its own shuffled blocks of one pool (block 0 never handed out)."""
    nb = -(-N // PB)
    bt = (torch.randperm(T * nb, device="cuda") + 1).view(T, nb)
    return dict(q=torch.randn(T, H, D, device="cuda").bfloat16(), w=torch.randn(T, H, device="cuda"),
                idx_k_store=torch.randn((T * nb + 1) * PB, D, device="cuda").bfloat16(),
                block_table=bt, per_block=PB, n_visible=torch.full((T,), N, dtype=torch.int32, device="cuda"))


def cost(T, N):
    """-> (bytes, FLOPs) of one call: keys once per row, q and w, the score row written and read back,
    the block table, ids and loc written."""
    nbytes = T * (N * D * 2 + H * D * 2 + H * 4 + 2 * N * 4 + -(-N // PB) * 8 + TOPK * 8)
    return nbytes, 2 * T * N * H * D


def bench_one(T, N, bw, peak):
    a = inputs(T, N)
    ids = torch.empty(T, TOPK, dtype=torch.int32, device="cuda")
    loc = torch.empty_like(ids)
    buf = torch.empty(T, N, device="cuda")
    op = lambda: ix.indexer_topk(**a, topk=TOPK, max_entries=N, out_ids=ids, out_loc=loc, score_buf=buf)  # noqa: E731
    ref = median(lambda: ix.indexer_topk_ref(**a, topk=TOPK, max_entries=N))
    eager = median(op)
    graph = median(graphed(op))
    scores = median(graphed(lambda: ix.indexer_scores(**a, max_entries=N, out=buf)))
    keep, ix.TOPK_MAX_ROW = ix.TOPK_MAX_ROW, 0                                   # force the torch.topk path
    try:
        torch_topk = median(graphed(op))
    finally:
        ix.TOPK_MAX_ROW = keep
    nbytes, flops = cost(T, N)
    roof = max(nbytes / bw, flops / peak) * 1e6                                  # us
    us = graph * 1e3
    return (f"| {N * 4 // 1024}k | {T} | {ref * 1e3:.1f} | {eager * 1e3:.1f} | {us:.1f} | {scores * 1e3:.1f} "
            f"| {torch_topk * 1e3:.1f} | {ref / graph:.1f}x | {nbytes / us / 1e3:.0f} ({nbytes / us / 1e-6 / bw:.0%}) "
            f"| {flops / us / 1e6:.0f} ({flops / us / 1e-6 / peak:.0%}) | {roof:.1f} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="contexts 1k and 32k, batches 1 and 64")
    ap.add_argument("--ctx", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--T", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    args = ap.parse_args()
    ctxs, Ts = ([1024, 32768], [1, 64]) if args.quick else (args.ctx, args.T)
    bw, peak = measured_peaks()
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s, bf16 GEMM {peak / 1e12:.0f} TFLOP/s (measured)")
    print("| ctx | T | ref us | eager us | graph us | scores us | torch.topk us | vs ref | GB/s (of copy) "
          "| TFLOP/s (of GEMM) | roofline us |")
    print("|" + " --- |" * 11)
    for ctx in ctxs:
        for T in Ts:
            print(bench_one(T, ctx // 4, bw, peak), flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
