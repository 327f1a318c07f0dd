"""Rotary embedding on the last `rope_dim` channels, interleaved pairs (GPT-J style).

Pairs (2i, 2i+1) of the rope slice are one complex number rotated by pos * f_i.
Sliding layers use `rope_theta` plainly; compressed layers use `compress_rope_theta`
with DeepSeek's YaRN ramp and no mscale. The rotation itself (apply_rope, cos_sin) lives in
engine.kernels.common, beside the kernels that fuse it; this module keeps the config-dependent
frequencies.
"""
import math

import torch

from .config import ModelConfig, YarnParams
from ..kernels.common import apply_rope, cos_sin  # noqa: F401 (the math; re-exported)


def inv_freq(rope_dim: int, base: float, yarn: YarnParams | None) -> torch.Tensor:
    inv = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if yarn is None:
        return inv

    def corr(rotations: float) -> float:
        return rope_dim * math.log(yarn.original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr(yarn.beta_fast)), 0)
    high = min(math.ceil(corr(yarn.beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return inv / yarn.factor * ramp + inv * (1 - ramp)


def layer_inv_freq(cfg: ModelConfig, layer: int) -> torch.Tensor:
    if cfg.ratio(layer) == 0:
        return inv_freq(cfg.rope_dim, cfg.rope_theta, None)
    return inv_freq(cfg.rope_dim, cfg.compress_rope_theta, cfg.yarn)
