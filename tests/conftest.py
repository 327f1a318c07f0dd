import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """Build (once per session) an official-format tiny checkpoint: tiny_ckpt(preset, seed) -> dir."""
    from weights.make_tiny import make_tiny

    root = tmp_path_factory.mktemp("ckpt")
    made = {}

    def get(preset: str = "tiny", seed: int = 0) -> Path:
        key = (preset, seed)
        if key not in made:
            made[key] = make_tiny(root / f"{preset}-{seed}", preset=preset, seed=seed)
        return made[key]

    return get


def rel_err(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-position max-abs error relative to the reference's max-abs: [..., V] -> [...]."""
    a, b = a.double(), b.double()
    return (a - b).abs().amax(-1) / b.abs().amax(-1).clamp(min=1e-30)
