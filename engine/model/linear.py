"""Linear layers and the embedding, named as DeepSeek names them (`.weight`).

The weight is held dequantised here (CPU oracle); `fmt` remembers what the checkpoint
stored so reference numerics can round activations the way DeepSeek's FP8/FP4 GEMMs do
(e4m3 per 128 input channels, power-of-two scales).
"""
import torch
import torch.nn.functional as F
from torch import nn

from .quant_sim import fp8_sim


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, fmt: str = "bf16", dtype=None):
        super().__init__()
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.act_sim = False  # set by Transformer.set_numerics

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_sim:
            x = fp8_sim(x, 128)
        return F.linear(x, self.weight)


class Embedding(nn.Module):
    def __init__(self, vocab: int, dim: int, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, dim, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
