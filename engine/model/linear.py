"""Linear layers and the embedding, named as DeepSeek names them (`.weight`).

The weight is held dequantised here (CPU oracle); `fmt` remembers what the checkpoint
stored, and `fp8_gemm` whether DeepSeek runs the weight through its FP8 GEMM, whose
activations reference numerics round (e4m3 per 128 input channels, power-of-two scales).
Not wo_a: DeepSeek's converter dequantises it to bf16.
"""
import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.fp8_gemm import fp8_gemm_ref
from ..numerics import PLAIN, fp8_sim_ref as fp8_sim
from ..parallel.comm import all_reduce, shard
from ..parallel.state import tp_rank, tp_size


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, fmt: str = "bf16", dtype=None,
                 fp8_gemm: bool | None = None):
        super().__init__()
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        self.fp8_gemm = fmt == "fp8" if fp8_gemm is None else fp8_gemm
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.numerics = PLAIN   # set by Transformer.set_numerics
        self.qweight = self.qscale = None

    def set_packed(self, weight: torch.Tensor, scale: torch.Tensor):
        """Keep the checkpoint's FP8 weight (e4m3 [out,in] + E8M0 scales [out/128, in/128]) and run
        the FP8 GEMM kernel on it; the dequantised weight is dropped."""
        assert weight.dtype == torch.float8_e4m3fn and tuple(weight.shape) == (self.out_features, self.in_features)
        self.qweight, self.qscale = weight, scale
        self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The oracle's GEMM (the engine's step: engine.model.step.linear)."""
        act = self.numerics.act_fp8 and self.fp8_gemm
        if self.qweight is not None:
            return fp8_gemm_ref(x, self.qweight, self.qscale, act_quant=act, out_dtype=x.dtype)
        return F.linear(fp8_sim(x, 128) if act else x, self.weight)


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
