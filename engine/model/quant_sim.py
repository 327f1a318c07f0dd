"""DeepSeek's quantisation-aware numerics, simulated (quantise then dequantise in place).

Used only in `reference` numerics: the official inference code rounds the KV cache's
non-rope channels through FP8, the indexer's queries and keys through a Hadamard
rotation and FP4, and every FP8/FP4 GEMM's activations through FP8 per 128 channels.
All scales are powers of two (UE8M0). The torch math (fp8_sim_ref, fp4_sim_ref, hadamard,
round_e2m1) lives in the leaf engine.numerics; this module only picks the kernel where it runs.
"""
import torch

from ..kernels import runs_kernel
from ..numerics import (FP4_MAX, FP8_MAX, _pow2_scale, _to_e4m3, fp4_sim_ref, fp8_sim_ref,  # noqa: F401
                        hadamard, round_e2m1)


def fp8_sim(x: torch.Tensor, block: int) -> torch.Tensor:
    """e4m3 round trip per `block` channels of the last dim (one kernel where it runs)."""
    if runs_kernel("act_sim", x) and x.shape[-1] % block == 0:
        from ..kernels.act_sim import fp8_sim as kernel

        return kernel(x, block)
    return fp8_sim_ref(x, block)


def fp4_sim(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """e2m1 round trip per `block` channels of the last dim (one kernel where it runs)."""
    if runs_kernel("act_sim", x) and x.shape[-1] % block == 0:
        from ..kernels.act_sim import fp4_sim as kernel

        return kernel(x, block)
    return fp4_sim_ref(x, block)
