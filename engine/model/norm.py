"""RMSNorm: DeepSeek's order (normalise and weight in fp32, then cast)."""
import torch
from torch import nn

from ..kernels.rms_norm import rms_norm_ref as rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
