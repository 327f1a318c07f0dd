"""engine.kernels.Ops: one table of kernel-or-reference callables, chosen once per prepared model."""
import pytest
import torch

import engine.kernels as K
from engine.kernels import KERNELS, Ops, kernel_set, set_kernels


def test_kernel_set_names():
    assert kernel_set("all") == frozenset(KERNELS) and kernel_set("none") == frozenset()
    assert kernel_set("sparse_attn,indexer") == kernel_set(["indexer", "sparse_attn"]) == {"sparse_attn", "indexer"}
    with pytest.raises(ValueError, match="unknown kernels \\['nope'\\]"):
        kernel_set("sparse_attn,nope")


def test_references_off_the_kernels_target():
    """CPU (not interpreted) and fp32 anywhere take every reference: `<launcher>_ref` of the same file."""
    ops = Ops.select("cpu", torch.bfloat16, "all")
    assert ops.kernels == frozenset()
    from engine.kernels import compressor, sparse_attn

    assert ops.sparse_attn is sparse_attn.sparse_mqa_ref and ops.compress_decode is compressor.compress_decode_ref
    assert Ops.select("cuda", torch.float32, "all").kernels == frozenset()


def test_interpreted_kernels_are_chosen_by_name(monkeypatch):
    monkeypatch.setattr(K, "CPU_INTERPRETED", True)
    ops = Ops.select("cpu", torch.float32, "sparse_attn,mhc")
    from engine.kernels import bf16_gemm, mhc_pre, sparse_attn

    assert ops.kernels == {"sparse_attn", "mhc"}
    assert ops.sparse_attn is sparse_attn.sparse_mqa and ops.mhc_pre is mhc_pre.mhc_pre
    assert ops.mhc_mix is bf16_gemm.mhc_mix and ops.gemm is bf16_gemm.bf16_gemm_ref   # bf16_gemm is off


def test_set_kernels_is_the_default_of_models_prepared_later(tiny_ckpt, monkeypatch):
    from engine.model import load_model

    monkeypatch.setattr(K, "CPU_INTERPRETED", True)
    model = load_model(tiny_ckpt("tiny", 0)).prepare_kernels("rms_norm")
    try:
        set_kernels("none")
        assert model.ops.kernels == {"rms_norm"}                   # a prepared model keeps its Ops
        assert load_model(tiny_ckpt("tiny", 0)).prepare_kernels().ops.kernels == frozenset()
    finally:
        set_kernels(None)
    assert model.prepare_kernels().ops.kernels == kernel_set(None)
