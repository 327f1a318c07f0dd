"""Fused projections (engine.kernels.proj_gemm) against the unfused GEMMs they replace, at one TP=8
rank's real dims (CUDA).

    python bench/proj.py [--M 1 16 64] [--sweep] [--copies 8] [--json out.json]

Each group as the model packs it (FP8 rows kept FP8, act-rounded inputs, bf16 and fp32 outputs).
"unfused" is what the step ran before: per projection the e4m3 rounding of x (act_sim kernel)
then cuBLAS bf16 on the dequantised weight for Linears, the bf16_gemm kernel (fp32 out) for the
compressor and router projections. Times are per group: one CUDA graph runs `copies` distinct
copies of the group back to back (as 43 layers do: no copy's weights are in L2 when it runs; the
graph's launch cost is spread over the copies), do_bench median / copies. GB/s counts the group's
weight bytes as stored (FP8 rows at 1 byte) against the copy bandwidth measured in the same run.
--sweep also times tile / split / stage variants, for choosing proj_plan's defaults. --given also
times each with x's rounding made beforehand, as the step's producers hand it over: as values
(xa, mhc_pre's act_out) and as values plus e4m3 codes and scales (xq, its act_q).
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from bench.timing import graphed, measured_peaks, median_ms  # noqa: E402
from engine.kernels import act_sim, bf16_gemm  # noqa: E402
from engine.numerics import fp8_codes_ref  # noqa: E402
from engine.kernels import proj_gemm as pg  # noqa: E402
from test_kernel_proj import REAL, group  # noqa: E402

GROUPS = {**REAL, "x_hca": ("x", 4096, dict(q_lora=1024, head_dim=512, idx_heads=0, comp=512, idx_comp=0))}


def unfused(x, segs):
    for name, w, fp8, act, lo in segs:
        xi = act_sim.fp8_sim(x, 128) if act else x
        if lo:
            F.linear(xi, w)
        else:
            bf16_gemm.bf16_gemm(xi, w)


def weight_bytes(p):
    return sum(t.numel() * t.element_size() for t in (p.w8, p.s8, p.wd) if t is not None)


def time_us(fn, copies):
    return median_ms(graphed(fn), warmup=5, rep=40) * 1e3 / copies


def variants(M, sweep):
    if not sweep:
        return [{}]
    out = [{}]
    if M >= pg.LARGE_M:    # prefill sizes: the kernel's larger-M plan (x rounded once or per tile), or cuBLAS
        return out + [dict(unfused=True), dict(unfused=False),
                      dict(unfused=False, pre_act=False),
                      dict(unfused=False, block_m=128, num_warps=8, num_stages=2),
                      dict(unfused=False, block_m=64, num_warps=4, num_stages=3, pre_act=False)]
    small = M <= 16
    for bn in (32, 64):
        for split in ((None, 4, 8, 16) if small else (None, 2, 4, 8)):
            for stages in ((4, 8) if small else (3, 4)):
                for warps in ((4,) if small else (4, 8)):
                    out.append(dict(block_n=bn, split_k=split, num_stages=stages, num_warps=warps))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--M", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--groups", default=",".join(GROUPS))
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--given", action="store_true", help="also with x's rounding given (xa; xa + xq)")
    a = ap.parse_args()
    bw, _ = measured_peaks()
    print(f"{torch.cuda.get_device_name()}  copy {bw / 1e12:.2f} TB/s")
    print(f"{'group':7} {'M':>4} {'variant':40} {'us':>8} {'GB/s':>7} {'%bw':>5} {'unfused us':>10} {'x':>5}")
    rows = []
    for name in a.groups.split(","):
        kind, K, sizes = GROUPS[name]
        packs = []
        for _ in range(a.copies):
            packs.append(group(kind, K, "cuda", sizes=sizes))
        nbytes = weight_bytes(packs[0][1])
        n_out = sum(seg[1].shape[0] for seg in packs[0][0])
        for M in a.M:
            x = torch.randn(M, K, device="cuda").bfloat16()
            base = time_us(lambda: [unfused(x, s) for s, _ in packs], a.copies)
            best = None
            given = [dict(xa=act_sim.fp8_sim(x, 128)), dict(xa=act_sim.fp8_sim(x, 128), xq=fp8_codes_ref(x, 128))]
            for kw in [dict(v, **g) for v in variants(M, a.sweep) for g in [{}] + (given if a.given else [])]:
                label = {k: v for k, v in kw.items() if k not in ("xa", "xq")}
                label = {**label, "input": "xq" if "xq" in kw else "xa"} if "xa" in kw else label
                try:
                    us = time_us(lambda: [pg.proj_gemm(x, p, **kw) for _, p in packs], a.copies)
                except Exception as e:   # a variant the shape cannot take (e.g. smem)
                    print(f"{name:7} {M:>4} {str(label):40} failed: {type(e).__name__}: {str(e)[:60]}")
                    continue
                gbs = nbytes / us / 1e3
                tflops = 2 * M * n_out * K / us / 1e6
                row = dict(group=name, M=M, variant=label or "default", us=round(us, 2), gbs=round(gbs, 1),
                           pct_bw=round(100 * gbs * 1e9 / bw, 1), unfused_us=round(base, 2), speedup=round(base / us, 2),
                           weight_bytes=nbytes, tflops=round(tflops, 1))
                rows.append(row)
                if best is None or us < best["us"]:
                    best = row
                if not label or not a.sweep or set(label) == {"input"}:
                    print(f"{name:7} {M:>4} {str(label or 'default'):40} {us:8.2f} {gbs:7.0f} {row['pct_bw']:5.1f} "
                          f"{base:10.2f} {base / us:5.2f} {tflops:7.1f} TFLOP/s")
            if a.sweep and best:
                print(f"{name:7} {M:>4} best {str(best['variant']):35} {best['us']:8.2f} {best['gbs']:7.0f} "
                      f"{best['pct_bw']:5.1f} {base:10.2f} {base / best['us']:5.2f} {best['tflops']:7.1f} TFLOP/s")
    if a.json:
        Path(a.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), copy_tbs=bw / 1e12, rows=rows),
                                           indent=1))


if __name__ == "__main__":
    main()
