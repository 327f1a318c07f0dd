"""Linear layers and the embedding, named as DeepSeek names them (`.weight`).

The weight is held dequantised here (CPU oracle); `fmt` remembers what the checkpoint
stored so reference numerics can round activations the way DeepSeek's FP8/FP4 GEMMs do
(e4m3 per 128 input channels, power-of-two scales).
"""
import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import use_kernel
from ..parallel.comm import all_reduce, shard
from ..parallel.state import tp_rank, tp_size
from .quant_sim import fp8_sim


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, fmt: str = "bf16", dtype=None):
        super().__init__()
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.act_sim = False  # set by Transformer.set_numerics
        self.qweight = self.qscale = None

    def set_packed(self, weight: torch.Tensor, scale: torch.Tensor):
        """Keep the checkpoint's FP8 weight (e4m3 [out,in] + E8M0 scales [out/128, in/128]) and run
        the FP8 GEMM kernel on it; the dequantised weight is dropped."""
        assert weight.dtype == torch.float8_e4m3fn and tuple(weight.shape) == (self.out_features, self.in_features)
        self.qweight, self.qscale = weight, scale
        self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            from ..kernels.fp8_gemm import fp8_gemm, fp8_gemm_ref

            gemm = fp8_gemm if x.is_cuda and use_kernel("fp8_gemm") else fp8_gemm_ref
            return gemm(x, self.qweight, self.qscale, act_quant=self.act_sim, out_dtype=x.dtype)
        if self.act_sim:
            x = fp8_sim(x, 128)
        return F.linear(x, self.weight)


class Embedding(nn.Module):
    """Vocab-parallel: each rank holds a contiguous slice of the rows; the others' tokens
    look up zeros and one all-reduce assembles the embeddings."""

    def __init__(self, vocab: int, dim: int, dtype=None):
        super().__init__()
        local = shard(vocab, "vocab_size")
        self.lo = tp_rank() * local
        self.weight = nn.Parameter(torch.empty(local, dim, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.lo
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * mine[..., None]
        return all_reduce(out)
