"""A simulated rank: one rank of a TP=N server, alone on one device, at a model's real dims.

    LLM(simulate_tp=8)                      # DeepSeek-V4-Flash's dims (engine.realdims.REAL)
    LLM("/ckpt", simulate_tp=8, num_layers=4)   # the dims of /ckpt/config.json (weights not read)

The model is rank 0's shard, built with seeded random weights in the real packed formats: FP8
projections on the e4m3 grid (packed as FP8 where the FP8 kernels run), routed experts on the
MXFP4 (or NVFP4) grid, packed for the fused MoE kernel (on CUDA an expert left on the torch
fallback is an error: the run would time the wrong thing). The collectives are answered by a
SimulatedGroup (engine.parallel.state): right-shaped tensors, nothing summed, and with
`collectives=True` each one costs device time from engine.parallel.latency's model, so one GPU
measures what each rank of an N-GPU server does. The outputs are not the model's: random
weights, and every rank's sum replaced by this rank's part.

One simulated rank per process: it sets the process's tensor-parallel state until
parallel.state.shutdown() (LLM.shutdown).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch

from . import realdims
from .model import formats
from .model.config import ModelConfig
from .model.model import Transformer
from .model.rope import layer_inv_freq
from .numerics import fp8_block_dequant
from .parallel import state

log = logging.getLogger(__name__)


def check_simulate_tp(n: int) -> int:
    """A power of two >= 1 (the dims it must divide are checked by ModelConfig.check_tp)."""
    if not isinstance(n, int) or n < 1 or n & (n - 1):
        raise ValueError(f"simulate_tp must be a power of two >= 1, got {n!r}")
    return n


def sim_config(path: str | Path | None = None, num_layers: int | None = None) -> ModelConfig:
    """The dims to simulate: path's config.json (its weights are never read), else the real
    DeepSeek-V4-Flash's; num_layers keeps only the first blocks (with their compress ratios)."""
    if path is None:
        cfg = ModelConfig.from_dict(realdims.REAL | {"compress_ratios": realdims.RATIOS})
    else:
        if not (Path(path) / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json")
        cfg = ModelConfig.from_file(path)
    if num_layers is not None:
        if not 1 <= num_layers <= cfg.n_layers:
            raise ValueError(f"num_layers must be in [1, {cfg.n_layers}], got {num_layers}")
        cfg = dataclasses.replace(cfg, n_layers=num_layers, compress_ratios=cfg.compress_ratios[:num_layers],
                                  n_hash_layers=min(cfg.n_hash_layers, num_layers))
    return cfg.validate()


def build_rank(cfg: ModelConfig, tp: int, device: torch.device, dtype: torch.dtype, numerics: str,
               collectives: bool = True, seed: int = 0) -> Transformer:
    """-> rank 0 of tp's model with random weights in the real formats, kernels prepared (no cache,
    no graphs: engine.rank.finish adds those). Installs the SimulatedGroup (state.init_simulated)."""
    check_simulate_tp(tp)
    cfg.check_tp(tp, numerics)
    if state.tp_size() != 1 or state.group() is not None:
        raise RuntimeError("this process already has a tensor-parallel state: one simulated rank per process")
    t0 = time.perf_counter()
    group = state.init_simulated(0, tp, modelled=collectives)
    try:
        with torch.device("meta"):
            model = Transformer(cfg, dtype=dtype, with_mtp=False)
        fuse = _fuses(cfg, device, dtype)
        _materialize(model, cfg, device, seed, fuse)
        model.set_numerics(numerics).eval()
        model.prepare_kernels()
        check_packed(model)
    except BaseException:
        state.shutdown()
        raise
    if device.type == "cuda" and collectives:
        group.calibrate(device)      # before any capture: graphs replay the sleeps it sizes
    log.info("simulated rank 0 of tp=%d at dim %d, %d layers, %d experts: built in %.1f s (collectives %s)",
             tp, cfg.dim, cfg.n_layers, cfg.n_routed_experts, time.perf_counter() - t0,
             "modelled as device time" if collectives else "free")
    return model


def _fuses(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> bool:
    """Will prepare_kernels put the routed experts on the fused MoE kernel (same test as there)."""
    from .kernels import Ops

    return Ops.select(device, dtype).uses("fused_moe") and cfg.expert_dtype in ("fp4", "nvfp4") and cfg.dim % 128 == 0


@torch.no_grad()
def _materialize(model: Transformer, cfg: ModelConfig, device: torch.device, seed: int, fuse: bool):
    """Give the meta model real storage, one block at a time: each block's experts are rounded
    (and, where the fused MoE runs, packed) before the next is allocated, so the bf16 experts of
    all blocks (~70 GB per rank at TP=8) never live at once."""
    g = torch.Generator(device=device).manual_seed(seed)
    E = cfg.n_routed_experts
    model.to_empty(device=device, recurse=False)
    realdims.init_random(model.named_parameters(recurse=False), model.named_buffers(recurse=False), g, E)
    for name, child in model.named_children():
        if name != "layers":
            child.to_empty(device=device)
            realdims.init_random(child.named_parameters(prefix=name), child.named_buffers(prefix=name), g, E)
    for i, layer in enumerate(model.layers):
        layer.to_empty(device=device)
        realdims.init_random(layer.named_parameters(prefix=f"layers.{i}"), layer.named_buffers(prefix=f"layers.{i}"),
                             g, E)
        layer.attn.inv_freq = layer_inv_freq(cfg, layer.layer).to(device)   # built on meta: rebuild
        _round_block(layer, cfg, fuse, f"layers.{i}")


def _round_block(layer, cfg: ModelConfig, fuse: bool, name: str):
    """One block's weights onto the checkpoint's grids; its experts packed where they will fuse."""
    if cfg.expert_dtype == "nvfp4":
        realdims.round_experts_nvfp4(layer, formats.nvfp4_quant, formats.nvfp4_dequant)
    elif cfg.expert_dtype == "fp4":
        realdims.round_experts_mxfp4(layer, formats.mxfp4_quant, formats.mxfp4_dequant)
    if cfg.fp8_linears:
        realdims.round_fp8_linears(layer, formats.fp8_block_quant, fp8_block_dequant)
    if fuse:
        experts = layer.ffn.experts
        if experts.w1.shape[1] % 128 == 0 and not experts.pack():
            raise RuntimeError(f"{name}: the random experts did not pack for the fused MoE kernel")
        if experts.packed is not None and experts.packed.w13.is_cuda:
            torch.cuda.empty_cache()      # the block's bf16 experts are gone: give them back


def check_packed(model: Transformer):
    """On CUDA every routed-experts module must run the fused kernel: a simulated rank that times
    the torch fallback measures nothing a server does."""
    left = realdims.unpacked_experts(model)
    if left and model.ops.uses("fused_moe"):
        raise RuntimeError(f"{len(left)} experts modules did not pack for the fused MoE kernel ({left[:3]} ...)")


def add_args(p):
    """The simulated-rank options of engine.serve and engine.generate (argparse)."""
    import argparse

    p.add_argument("--simulate-tp", type=int, default=None, metavar="N",
                   help="serve one rank of a TP=N server alone: random weights in the real packed formats at "
                        "--model's dims (config.json only, no weight read) or DeepSeek-V4-Flash's (engine.simulate)")
    p.add_argument("--num-layers", type=int, default=None, metavar="K",
                   help="with --simulate-tp: only the first K blocks (quick runs)")
    p.add_argument("--simulate-collectives", action=argparse.BooleanOptionalAction, default=True,
                   help="with --simulate-tp: each all-reduce/all-gather costs its modelled device time (default on)")


def check_args(p, args):
    """Refuse bad combinations at parse time, with argparse's usage message."""
    if args.simulate_tp is None:
        if args.num_layers is not None:
            p.error("--num-layers cuts a simulated model: it needs --simulate-tp")
        return
    try:
        check_simulate_tp(args.simulate_tp)
    except ValueError as e:
        p.error(f"--simulate-tp: {e}")
    if args.tp != 1:
        p.error(f"--simulate-tp runs one rank in this process: drop --tp {args.tp}")
    if args.num_layers is not None and args.num_layers < 1:
        p.error(f"--num-layers must be >= 1, got {args.num_layers}")
