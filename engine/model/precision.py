"""The compute dtype of the fp32 islands: fp32, or fp64 when the whole model runs in fp64.

fp64 exists for the exactness tests of `reference` numerics: its FP8/FP4 roundings are
discontinuous, so two fp32 computations that differ by one ulp can round apart; in fp64
they practically never do."""
import torch


def up(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float64 else x.float()


def up_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32
