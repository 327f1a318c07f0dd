"""Triton kernels, one per file, each with its torch reference beside it.

The model takes a kernel where one exists for the device and dtype, unless switched
back to the torch reference: ENGINE_KERNELS=none (all off), or a comma list of the
kernels to keep on (e.g. ENGINE_KERNELS=sparse_attn,indexer), or set_kernels(...)."""
import os

KERNELS = ("sparse_attn", "indexer", "fp8_gemm", "bf16_gemm", "fused_moe", "mhc", "rope_kv", "router")
_on: set[str] | None = None


def set_kernels(names) -> None:
    """names: 'all', 'none', or an iterable of kernel names."""
    global _on
    if names in ("all", None):
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
        set_kernels(os.environ.get("ENGINE_KERNELS", "all"))
    return name in _on
