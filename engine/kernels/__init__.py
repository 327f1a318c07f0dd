"""Triton kernels, one per file, each with its torch reference beside it.

The model takes a kernel where one exists for the device and dtype, unless switched
back to the torch reference: ENGINE_KERNELS=none (all off), all, or a comma list of the
kernels to keep on (e.g. ENGINE_KERNELS=sparse_attn,indexer), or set_kernels(...).
The default leaves fp8_gemm off: under CUDA graphs on the H200 it matches cuBLAS bf16 on the
dequantised weights at batch 1 but loses at batch 64 (bench/RESULTS.md), so it is opt-in
until its tiles are tuned for that. The model asks runs_kernel(name, x) at each site."""
import os

import torch

KERNELS = ("sparse_attn", "indexer", "fp8_gemm", "bf16_gemm", "fused_moe", "mhc", "rope_kv", "router", "act_sim",
           "compressor", "rms_norm", "rope_q")
DEFAULT = tuple(k for k in KERNELS if k != "fp8_gemm")
_on: set[str] | None = None
# CPU tests run the whole model through the kernels under TRITON_INTERPRET=1 by setting this
CPU_INTERPRETED = False


def set_kernels(names) -> None:
    """names: 'all', 'none', or an iterable of kernel names."""
    global _on
    if names is None:
        _on = set(DEFAULT)
    elif names == "all":
        _on = set(KERNELS)
    elif names == "none":
        _on = set()
    else:
        names = set(names.split(",") if isinstance(names, str) else names)
        unknown = names - set(KERNELS)
        if unknown:
            raise ValueError(f"unknown kernels {sorted(unknown)}; choose from {KERNELS}")
        _on = names


def use_kernel(name: str) -> bool:
    if _on is None:
        set_kernels(os.environ.get("ENGINE_KERNELS", ",".join(DEFAULT)))
    return name in _on


def runs_kernel(name: str, x: torch.Tensor) -> bool:
    """Does kernel `name` run for activations x: a bf16 model on CUDA (the kernels' target), or
    any dtype on CPU when a test interprets the kernels (CPU_INTERPRETED)."""
    return use_kernel(name) and (x.is_cuda and x.dtype == torch.bfloat16 or CPU_INTERPRETED and not x.is_cuda)
