import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))

# The GPU machine's Python has no server stack: there (and only where these are missing) the server
# test files are not collected, so `pytest -m gpu` runs there as it comes. CI installs them all.
_SERVER_DEPS = ("fastapi", "httpx", "openai", "hypothesis", "uvicorn")
collect_ignore = [] if all(importlib.util.find_spec(m) for m in _SERVER_DEPS) else [
    "test_openai_client.py", "test_server.py", "test_server_api.py", "test_server_errors.py", "test_server_fuzz.py",
    "test_serve_process.py"]


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


GPU_CACHE = 2 << 30    # cache bytes of each engine a GPU test builds: the GPU test files run side by side


def small_pool_llm(path, max_num_seqs: int, blocks: int, **kw):
    """A CPU fp32 engine whose cache holds exactly `blocks` blocks beside its per-sequence state
    (preemption and cache-exhaustion tests)."""
    from engine import LLM

    kw = dict(device="cpu", dtype=torch.float32, numerics="plain", max_num_seqs=max_num_seqs, **kw)
    probe = LLM(path, **kw).cache
    llm = LLM(path, kv_cache_memory=probe.slot_bytes() * probe.max_num_seqs + probe.block_bytes() * blocks, **kw)
    assert llm.cache.num_blocks == blocks
    return llm
