"""The tiny model with the Triton kernels on == with the torch references (GPU: pytest -m gpu).

The comparison of tests/test_kernel_model.py at real speed: bf16 kernels against torch bf16,
routing pinned and the indexer selecting every entry, within max(1e-2, 1.5 x the model's bf16
noise floor measured against torch fp32 in the same test); greedy tokens equal up to near-ties."""
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from conftest import GPU_CACHE  # noqa: E402
from test_kernel_model import compare, greedy, kernels_vs_torch  # noqa: E402
from engine import LLM  # noqa: E402
from engine.kernels import set_kernels  # noqa: E402


def _both(path, preset_len, numerics, kernels="all", seed=1):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, 129280, (m,), generator=g).tolist() for m in (preset_len, preset_len // 3, 7)]
    try:
        r = kernels_vs_torch(lambda dtype: LLM(path, device="cuda", dtype=dtype, numerics=numerics,
                                               enforce_eager=True, max_model_len=1024,
                                               skip_tokenizer_init=True, kv_cache_memory=GPU_CACHE),
                             prompts, n=24, kernels=kernels)
    finally:
        set_kernels(None)
    print({k: v for k, v in r.items() if k != "tokens"})
    return r


def test_rerun_on_one_engine_is_identical(tiny_ckpt):
    """The same prompts twice through one engine: stale cache contents must never leak in."""
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, 129280, (m,), generator=g).tolist() for m in (60, 20, 7)]
    llm = LLM(tiny_ckpt("tiny", 0), device="cuda", dtype=torch.bfloat16, numerics="plain", enforce_eager=True,
              max_model_len=1024, skip_tokenizer_init=True, kv_cache_memory=GPU_CACHE)
    a, b = greedy(llm, prompts, 24), greedy(llm, prompts, 24)
    worst, mismatch = compare(*a, *b)
    assert a[0] == b[0] and worst == 0.0 and mismatch is None


@pytest.mark.parametrize("preset,numerics", [("tiny", "plain"), ("tiny", "reference"), ("flash", "plain"),
                                             ("flash", "reference"), ("nvfp4", "plain")])
def test_kernels_match_references(tiny_ckpt, preset, numerics):
    """nvfp4: the experts run the fused MoE on the checkpoint's own NVFP4 codes."""
    r = _both(tiny_ckpt(preset, 0), 300 if preset == "flash" else 60, numerics)
    assert r["mismatch"] is None and r["max_rel_err"] <= r["tol"], r


@pytest.mark.parametrize("kernel", ["sparse_attn", "indexer", "fp8_gemm", "bf16_gemm", "fused_moe", "mhc",
                                    "rope_kv", "router", "act_sim", "compressor", "proj_gemm", "swiglu",
                                    "step_tables", "embed"])
def test_each_kernel_alone(tiny_ckpt, kernel):
    """One kernel on at a time (the rest torch): localises a mismatch to its kernel."""
    kernels = {"indexer": ["indexer", "sparse_attn"], "rope_kv": ["rope_kv", "sparse_attn"]}.get(kernel, [kernel])
    r = _both(tiny_ckpt("tiny", 0), 60, "reference" if kernel in ("act_sim", "fp8_gemm", "compressor", "proj_gemm", "swiglu") else "plain", kernels)
    assert r["mismatch"] is None and r["max_rel_err"] <= r["tol"], r
