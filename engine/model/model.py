"""The whole network: embedding -> 4 identical streams -> blocks -> hc_head -> norm -> head."""
import logging
from functools import partial

import torch
from torch import nn

from ..parallel.comm import all_gather_last, shard
from .block import Block
from .config import ModelConfig
from .linear import Embedding, Linear
from .mhc import hc_head
from ..kernels import use_kernel
from .moe import Experts
from .mtp import MTPBlock
from .norm import RMSNorm
from .precision import up

NUMERICS = ("plain", "reference")
log = logging.getLogger(__name__)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype=torch.float32, with_mtp: bool = True):
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        self.embed = Embedding(cfg.vocab_size, cfg.dim, dtype=dtype)
        self.layers = nn.ModuleList(Block(cfg, i, dtype=dtype) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = Linear(cfg.dim, shard(cfg.vocab_size, "vocab_size"), dtype=dtype)
        hc = cfg.hc_mult
        self.hc_head_fn = nn.Parameter(torch.empty(hc, hc * cfg.dim, dtype=torch.float32), requires_grad=False)
        self.hc_head_base = nn.Parameter(torch.empty(hc, dtype=torch.float32), requires_grad=False)
        self.hc_head_scale = nn.Parameter(torch.empty(1, dtype=torch.float32), requires_grad=False)
        self.mtp = nn.ModuleList(MTPBlock(cfg, dtype=dtype) for _ in range(cfg.n_mtp_layers if with_mtp else 0))
        self.numerics = "plain"

    def set_numerics(self, mode: str) -> "Transformer":
        """`plain`: no simulation (equals transformers' DeepseekV4). `reference`: DeepSeek's QAT
        simulation: FP8 KV nope dims, Hadamard + FP4 indexer, FP8 activations into FP8/FP4 GEMMs."""
        if mode not in NUMERICS:
            raise ValueError(f"numerics must be one of {NUMERICS}, got {mode!r}")
        self.numerics = mode
        on = mode == "reference"
        for name, m in self.named_modules():
            if hasattr(m, "sim"):
                m.sim = on
            if hasattr(m, "act_sim"):
                quantized = getattr(m, "fmt", "fp4" if self.cfg.expert_dtype in ("fp4", "fp8") else "bf16")
                # wo_a is dequantised to bf16 by DeepSeek's converter: its input is not rounded.
                m.act_sim = on and quantized in ("fp8", "fp4") and not name.endswith("wo_a")
        return self

    def pack_fp8(self) -> int:
        """Hold every FP8-format linear's weight as FP8 again (e4m3 + E8M0 per 128x128) for the
        FP8 GEMM kernel. Exact: the loaded weights are e4m3 values times powers of two, and
        re-deriving a block's scale can only shrink it by powers of two, which e4m3 absorbs
        without rounding. wo_a stays bf16, as DeepSeek's converter leaves it. -> count packed."""
        from .formats import fp8_block_quant

        n = 0
        for name, m in self.named_modules():
            if isinstance(m, Linear) and m.fmt == "fp8" and m.weight is not None and not name.endswith("wo_a"):
                w, s = fp8_block_quant(m.weight.float())
                m.set_packed(w, s)
                n += 1
        return n

    def prepare_kernels(self) -> "Transformer":
        """On CUDA in bf16, switch the weights to the layouts the Triton kernels read."""
        from ..kernels import use_kernel

        if not (self.head.weight.is_cuda and self.dtype == torch.bfloat16):
            self.log_moe_paths()
            return self
        if use_kernel("fp8_gemm"):
            self.pack_fp8()
        if use_kernel("fused_moe") and self.cfg.expert_dtype in ("fp4", "nvfp4") and self.cfg.dim % 128 == 0:
            for name, m in self.named_modules():
                if isinstance(m, Experts) and m.w1.shape[1] % 128 == 0:
                    if not m.pack():
                        log.warning("%s: packed expert codes do not reproduce the weights: torch path", name)
                    torch.cuda.empty_cache()
        for m in self.modules():   # NVFP4 codes the loader kept but no kernel took: free them
            if isinstance(m, Experts) and m.packed is None:
                m.nvfp4_parts = None
        self.log_moe_paths()
        return self

    def moe_paths(self) -> dict[str, list[int]]:
        """{"fused": layers whose routed experts are packed for the fused MoE kernel, "torch": the
        layers that run the torch expert loop (CPU, or weights the kernel could not take)}."""
        paths = {"fused": [], "torch": []}
        for i, layer in enumerate(self.layers):
            paths["fused" if layer.ffn.experts.packed is not None else "torch"].append(i)
        return paths

    def log_moe_paths(self):
        """One line at start: which layers run which MoE path; a warning when CUDA layers fall back."""
        paths, fmt = self.moe_paths(), self.cfg.expert_dtype
        line = (f"MoE ({fmt} experts): fused kernel on {_spans(paths['fused']) or 'no'} layers, "
                f"torch on {_spans(paths['torch']) or 'no'} layers")
        if paths["torch"] and self.head.weight.is_cuda:
            log.warning("%s (the torch path is the slow fallback)", line)
        else:
            log.info("%s", line)

    def hidden(self, input_ids: torch.Tensor, attn_fns=None) -> torch.Tensor:
        """ids [B,S] -> the last block's output streams [B,S,hc,D]."""
        h = self.embed(input_ids)[:, :, None, :].expand(-1, -1, self.cfg.hc_mult, -1).contiguous()
        for i, layer in enumerate(self.layers):
            h = layer(h, input_ids, attn_fns[i] if attn_fns else None)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Streams [...,hc,D] -> fp32 logits [...,V]."""
        y = self.norm(hc_head(h, self.hc_head_fn, self.hc_head_scale, self.hc_head_base,
                              self.cfg.hc_eps, self.cfg.norm_eps))
        return self.head_logits(y)

    def head_logits(self, y: torch.Tensor) -> torch.Tensor:
        # vocab-parallel head: each rank's slice of the logits, gathered in rank order. fp32 logits
        # as DeepSeek computes them; in bf16 models a bf16 GEMM with fp32 output rather than
        # casting the whole [vocab, dim] weight every step (bf16 logits would tie the argmax).
        if y.is_cuda and y.dtype == torch.bfloat16 and use_kernel("bf16_gemm"):
            from ..kernels.bf16_gemm import bf16_gemm

            return all_gather_last(bf16_gemm(y.reshape(-1, y.shape[-1]), self.head.weight).view(*y.shape[:-1], -1))
        return all_gather_last(torch.nn.functional.linear(up(y), up(self.head.weight)))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The cache-free oracle: whole sequences from position 0. ids [B,S] -> logits [B,S,V]."""
        return self.logits(self.hidden(input_ids))

    @torch.inference_mode()
    def forward_step(self, input_ids: torch.Tensor, ctx, caches) -> torch.Tensor:
        """The engine's step: ids [B,S] at ctx.positions against the per-layer caches (updated
        in place) -> fp32 logits of each row's last token [B,V]."""
        attn = [partial(layer.attn.forward_cached, ctx=ctx, cache=c) for layer, c in zip(self.layers, caches)]
        return self.logits(self.hidden(input_ids, attn)[:, -1])

    @torch.inference_mode()
    def forward_mtp(self, h_main: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """Next-next-token logits: h_main [B,S,hc,D] (hidden() at positions t), next_ids [B,S]
        (the tokens at t+1) -> logits [B,S,V] for the tokens at t+2."""
        if not len(self.mtp):
            raise RuntimeError("this checkpoint has no MTP block")
        mtp = self.mtp[0]
        h = mtp.hidden(h_main, self.embed(next_ids), next_ids)
        return self.head_logits(mtp.collapse(h))


def _spans(ids: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2,5,7-8"."""
    out, start = [], None
    for j, i in enumerate(ids):
        if start is None:
            start = i
        if j + 1 == len(ids) or ids[j + 1] != i + 1:
            out.append(f"{start}-{i}" if i > start else f"{i}")
            start = None
    return ",".join(out)
