"""The whole network: embedding -> 4 identical streams -> blocks -> hc_head -> norm -> head."""
import logging

import torch
from torch import nn

from ..parallel.comm import all_gather_last, shard
from .block import Block
from .config import ModelConfig
from .linear import Embedding, Linear
from .mhc import hc_head
from ..kernels import Ops
from ..kernels import mhc_pre as mhc_pre_kernel
from ..kernels.bf16_gemm import bf16_gemm_ref, split_bf16
from ..kernels.common import pdl_for_step
from ..numerics import Numerics
from . import projections, step
from .attention import Attention
from .compressor import Compressor
from .indexer import Indexer
from .kv_cache import LayerCache, StepInputs
from .moe import Experts
from .mtp import MTPBlock
from .norm import RMSNorm

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
        self.numerics = Numerics.of("plain")
        self.ops = Ops.select("cpu", dtype, "none")    # the references until prepare_kernels
        self.head_split = None                          # the head's mix weight as bf16 hi + lo (kernels)
        self.packed_for = None     # (numerics, ops) the packed projections were built for

    def set_numerics(self, mode: str) -> "Transformer":
        """`plain`: no simulation (equals transformers' DeepseekV4). `reference`: DeepSeek's QAT
        simulation (engine.numerics.Numerics): FP8 KV nope dims, Hadamard + FP4 indexer, FP8
        activations into the FP8/FP4 GEMMs. The modules that round read the same description."""
        self.numerics = Numerics.of(mode)
        for m in self.modules():
            if isinstance(m, (Attention, Compressor, Indexer, Linear, Experts)):
                m.numerics = self.numerics
        return self

    def pack_projections(self) -> "Transformer":
        """Pack each block's shared-input projections for ops.proj_gemm (engine.model.projections):
        FP8 rows stay FP8 where the kernel runs. Redone when numerics or the kernels change (the
        step does it on its first call after either), before any graph capture."""
        fp8 = self.ops.uses("proj_gemm")
        for layer in self.layers:
            layer.proj = projections.pack_block(layer, self.numerics, fp8)
        self.packed_for = (self.numerics, self.ops)
        return self

    def pack_fp8(self) -> int:
        """Hold every FP8-GEMM linear's weight as FP8 again (e4m3 + E8M0 per 128x128) for the
        FP8 GEMM kernel. Exact: the loaded weights are e4m3 values times powers of two, and
        re-deriving a block's scale can only shrink it by powers of two, which e4m3 absorbs
        without rounding. wo_a stays bf16, as DeepSeek's converter leaves it. -> count packed."""
        from .formats import fp8_block_quant

        n = 0
        for m in self.modules():
            if isinstance(m, Linear) and m.fp8_gemm and m.weight is not None:
                w, s = fp8_block_quant(m.weight.float())
                m.set_packed(w, s)
                n += 1
        return n

    def prepare_kernels(self, kernels=None) -> "Transformer":
        """Choose the step's Ops for this device and dtype (kernels: engine.kernels.kernel_set's
        names; None: ENGINE_KERNELS) and put the weights in the layouts those kernels read.
        Before any graph capture: graphs capture the Ops chosen here."""
        device = self.head.weight.device
        self.ops = Ops.select(device, self.dtype, kernels)
        if self.ops.uses("fp8_gemm"):
            self.pack_fp8()
        if self.ops.uses("fused_moe") and self.cfg.expert_dtype in ("fp4", "nvfp4") and self.cfg.dim % 128 == 0:
            for name, m in self.named_modules():
                if isinstance(m, Experts) and m.packed is None and m.w1.shape[1] % 128 == 0:
                    if not m.pack():
                        log.warning("%s: packed expert codes do not reproduce the weights: torch path", name)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
        for m in self.modules():   # NVFP4 codes the loader kept but no kernel took: free them
            if isinstance(m, Experts) and m.packed is None:
                m.nvfp4_parts = None
        for layer in self.layers:
            layer.prepare_mix(self.ops.uses("mhc"))
        self.head_split = split_bf16(self.hc_head_fn) if self.ops.uses("mhc") else None
        self.pack_projections()
        log.info("kernels on %s: %s", device, ",".join(sorted(self.ops.kernels)) or "none")
        self.log_moe_paths()
        return self

    def moe_paths(self) -> dict[str, list[int]]:
        """{"fused": layers whose routed experts run the fused MoE kernel, "torch": the layers that
        run torch experts (the CPU references, or weights the kernel could not take)}."""
        paths = {"fused": [], "torch": []}
        for i, layer in enumerate(self.layers):
            fused = layer.ffn.experts.packed is not None and self.ops.uses("fused_moe")
            paths["fused" if fused else "torch"].append(i)
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

    def hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The oracle: ids [B,S] from position 0 -> the last block's output streams [B,S,hc,D]."""
        h = self.embed(input_ids)[:, :, None, :].expand(-1, -1, self.cfg.hc_mult, -1).contiguous()
        for layer in self.layers:
            h = layer(h, input_ids)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Streams [...,hc,D] -> fp32 logits [...,V]."""
        y = self.norm(hc_head(h, self.hc_head_fn, self.hc_head_scale, self.hc_head_base,
                              self.cfg.hc_eps, self.cfg.norm_eps))
        return self.head_logits(y)

    def step_logits(self, h: torch.Tensor, mix=None) -> torch.Tensor:
        """The step's head (engine.model.step): logits() with the streams' collapse and the final
        norm in one op (ops.mhc_head). mix: the head's mix partials, left by the last mhc_post."""
        fn_hi, fn_lo = self.head_split or (self.hc_head_fn, None)
        y = self.ops.mhc_head(h, fn_hi, fn_lo, self.hc_head_scale, self.hc_head_base, self.norm.weight,
                              self.cfg.hc_eps, self.cfg.norm_eps, mix=mix)
        return self.head_logits(y)

    def head_mix(self):
        """-> (fn_hi, fn_lo, eps) of the head's mix for the last mhc_post to make (decode steps), or
        None where the head mixes itself (the reference; mhc_pre.HEAD_KERNEL off)."""
        if self.head_split is None or not mhc_pre_kernel.HEAD_KERNEL:
            return None
        return (*self.head_split, self.cfg.norm_eps)

    def head_logits(self, y: torch.Tensor) -> torch.Tensor:
        # vocab-parallel head: each rank's slice of the logits, gathered in rank order. fp32 logits
        # as DeepSeek computes them; in bf16 models a bf16 GEMM with fp32 output rather than
        # casting the whole [vocab, dim] weight every step (bf16 logits would tie the argmax).
        # On CPU the reference even when a test interprets the kernels: the vocab-wide GEMM alone
        # would take the interpreter minutes, and bf16_gemm has its own tests at small shapes.
        gemm = self.ops.gemm if y.is_cuda else bf16_gemm_ref
        return all_gather_last(gemm(y.reshape(-1, y.shape[-1]), self.head.weight).view(*y.shape[:-1], -1))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The cache-free oracle: whole sequences from position 0. ids [B,S] -> logits [B,S,V]."""
        return self.logits(self.hidden(input_ids))

    @torch.inference_mode()
    def forward_step(self, inp: StepInputs, caches: list[LayerCache], all_logits: bool = False) -> torch.Tensor:
        """The engine's step (engine.model.step): inp.ids [B,S] at inp.positions against the
        per-layer caches (updated in place) -> fp32 logits of each row's last token [B,V], or with
        `all_logits` of every position [B,S,V] (prompt logprobs need them; the head then costs S
        times more)."""
        if self.packed_for != (self.numerics, self.ops):
            self.pack_projections()
        with pdl_for_step(inp.ids.numel()):       # PDL where it measures faster (kernels/common.py)
            return step.forward(self, inp, caches, all_logits)

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
