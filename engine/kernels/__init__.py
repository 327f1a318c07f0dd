"""Triton kernels, one per file, each with its torch reference `<op>_ref` beside it; and `Ops`,
the table the model's step calls through.

`Ops.select(device, dtype, kernels)` picks, once, the Triton launcher or the torch reference
of every op: the kernels run for bf16 on CUDA (their target), or on CPU when a test
interprets them (CPU_INTERPRETED); everything else takes the references. The model is
prepared with one Ops (engine.model.Transformer.prepare_kernels) and CUDA graphs capture it:
a different kernel set means new graphs (DecodeGraphs.run refuses to replay stale ones), never
a switch read while the step is traced.

Which kernels: ENGINE_KERNELS=none (all off), all, or a comma list of the kernels to keep on
(e.g. ENGINE_KERNELS=sparse_attn,indexer); set_kernels(...) sets the same default in process
for models prepared after it. The default leaves fp8_gemm off: under CUDA graphs on the H200
it matches cuBLAS bf16 on the dequantised weights at batch 1 but loses at batch 64
(bench/RESULTS.md), so it is opt-in until its tiles are tuned for that."""
import os
from dataclasses import dataclass, fields
from importlib import import_module
from typing import Callable

import torch

KERNELS = ("sparse_attn", "indexer", "fp8_gemm", "bf16_gemm", "fused_moe", "mhc", "rope_kv", "router", "act_sim",
           "compressor", "rms_norm", "rope_q", "proj_gemm", "swiglu", "step_tables", "embed")
DEFAULT = tuple(k for k in KERNELS if k != "fp8_gemm")
_default: frozenset[str] | None = None
# CPU tests run the whole model through the kernels under TRITON_INTERPRET=1 by setting this
CPU_INTERPRETED = False


def kernel_set(names) -> frozenset[str]:
    """names: None (ENGINE_KERNELS, else DEFAULT), 'all', 'none', a comma list or an iterable."""
    if names is None:
        return _default if _default is not None else kernel_set(os.environ.get("ENGINE_KERNELS", ",".join(DEFAULT)))
    if names == "all":
        return frozenset(KERNELS)
    if names == "none":
        return frozenset()
    names = frozenset(n for n in (names.split(",") if isinstance(names, str) else names) if n)
    unknown = names - set(KERNELS)
    if unknown:
        raise ValueError(f"unknown kernels {sorted(unknown)}; choose from {KERNELS}")
    return names


def set_kernels(names) -> None:
    """The default kernel set of models prepared from now on (None: back to ENGINE_KERNELS).
    A model already prepared keeps its Ops (prepare_kernels again, then capture its graphs again)."""
    global _default
    _default = kernel_set(names) if names is not None else None


def runs_here(device, dtype) -> bool:
    """Do the kernels run for this device and dtype: bf16 on CUDA, or any dtype on CPU when a
    test interprets them."""
    device = torch.device(device)
    return device.type == "cuda" and dtype == torch.bfloat16 or device.type == "cpu" and CPU_INTERPRETED


def _divisible(kernel, ref):
    """act_sim's kernels take whole blocks of channels; other widths take the reference."""
    return lambda x, block: kernel(x, block) if x.shape[-1] % block == 0 else ref(x, block)


@dataclass(frozen=True)
class Ops:
    """One callable per op of the step; each is the kernel or its reference (same signature).
    The comment names the kernel switch and the file that holds both."""
    kernels: frozenset          # the kernels that run (empty: all references)
    sparse_attn: Callable       # sparse_attn: sparse_mqa(q, kv_a, idx_a, kv_b, idx_b, sink, scale, rope) -> o
    indexer_topk: Callable      # indexer: (q, w, keys, table, per_block, visible, k, n) -> (ids, rows, ...)
    gemm: Callable              # bf16_gemm: (a, b) -> a @ b^T, fp32 out (fp64 for fp64 models)
    fp8_gemm: Callable          # fp8_gemm: (x, e4m3 weight, E8M0 scales, act_quant, out_dtype) -> y
    mhc_pre: Callable           # mhc: the mix projection (bf16_gemm.py), Sinkhorn, stream collapse, RMSNorm
    mhc_post: Callable          # mhc: expand and mix back into the streams
    mhc_post_pre: Callable      # mhc: mhc_post, then the next sub-layer's mhc_pre (mhc_post.py: one launch, small steps)
    mhc_head: Callable          # mhc: the head's stream collapse and final RMSNorm (mhc_pre.py)
    rope_qkv: Callable          # rope_kv: q/kv norms, RoPE, the KV's FP8 rounding, the ring write
    rope_q: Callable            # rope_q: RoPE on heads (the indexer's queries, Hadamard + FP4; the inverse on o)
    rms_norm: Callable          # rms_norm
    route: Callable             # router: scores, top-k or hash ids, renormalise
    fp8_sim: Callable           # act_sim: e4m3 round trip per block
    compress_decode: Callable   # compressor: the compressor's decode step after its projections
    compress_finish: Callable   # compressor: a prefill step's pooled entries, finished into the pool
    compress_pool: Callable     # compressor: a prefill step's windows pooled, the rows its state keeps
    fused_moe: Callable         # fused_moe: routed experts on packed MXFP4 / NVFP4 codes
    proj_gemm: Callable         # proj_gemm: (x, Proj) -> {name: y}, the projections sharing x in one GEMM
    swiglu_act: Callable        # swiglu: (g, u, limit, fp8, dtype) -> the shared expert's w2 input
    step_tables: Callable       # step_tables: a decode step's per-row tables (rope angles, window / entry rows)
    embed: Callable             # embed: (ids, weight, lo, hc) -> the vocab-parallel lookup in hc stream copies
    side: object = None         # mhc on CUDA: a second stream, for mhc_pre's post and comb (its `side`)
    aux: object = None          # kernels on CUDA: a third, for chains of the step beside its main one
                                # (engine.model.step.beside); a split-K GEMM there (the shared
                                # expert's w2) shares common.get_workspace's buffer, so none may run
                                # on the step's stream meanwhile (there: the router, the fused MoE)

    @classmethod
    def select(cls, device, dtype, kernels=None) -> "Ops":
        on = kernel_set(kernels) if runs_here(device, dtype) else frozenset()
        chosen = {"kernels": on}
        for f in fields(cls):
            if f.name not in _TABLE:      # kernels and the streams: not ops
                continue
            switch, module, fn = _TABLE[f.name]
            mod = import_module(f".{module}", __name__)
            kernel, ref = getattr(mod, fn), getattr(mod, f"{fn}_ref")
            if switch == "act_sim":
                kernel = _divisible(kernel, ref)
            chosen[f.name] = kernel if switch in on else ref
        if on and torch.device(device).type == "cuda":
            chosen["aux"] = torch.cuda.Stream(torch.device(device))
            if "mhc" in on:
                chosen["side"] = torch.cuda.Stream(torch.device(device))
        return cls(**chosen)

    def uses(self, name: str) -> bool:
        return name in self.kernels


# op -> (kernel switch, file, launcher; the reference is launcher + "_ref" in the same file)
_TABLE = {
    "sparse_attn": ("sparse_attn", "sparse_attn", "sparse_mqa"),
    "indexer_topk": ("indexer", "indexer", "indexer_topk"),
    "gemm": ("bf16_gemm", "bf16_gemm", "bf16_gemm"),
    "fp8_gemm": ("fp8_gemm", "fp8_gemm", "fp8_gemm"),
    "mhc_pre": ("mhc", "mhc_pre", "mhc_pre"),
    "mhc_post": ("mhc", "mhc_post", "mhc_post"),
    "mhc_post_pre": ("mhc", "mhc_post", "mhc_post_pre"),
    "mhc_head": ("mhc", "mhc_pre", "mhc_head"),
    "rope_qkv": ("rope_kv", "rope_kv", "rope_qkv"),
    "rope_q": ("rope_q", "rope_q", "rope_q"),
    "rms_norm": ("rms_norm", "rms_norm", "rms_norm"),
    "route": ("router", "router", "route"),
    "fp8_sim": ("act_sim", "act_sim", "fp8_sim"),
    "compress_decode": ("compressor", "compressor", "compress_decode"),
    "compress_finish": ("compressor", "compressor", "compress_finish"),
    "compress_pool": ("compressor", "compressor", "compress_pool"),
    "fused_moe": ("fused_moe", "fused_moe", "fused_moe"),
    "proj_gemm": ("proj_gemm", "proj_gemm", "proj_gemm"),
    "swiglu_act": ("swiglu", "swiglu", "swiglu_act"),
    "step_tables": ("step_tables", "step_tables", "step_tables"),
    "embed": ("embed", "embed", "embed"),
}
