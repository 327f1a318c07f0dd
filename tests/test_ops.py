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
    from engine.kernels import bf16_gemm, mhc_post, mhc_pre, sparse_attn

    assert ops.kernels == {"sparse_attn", "mhc"}
    assert ops.sparse_attn is sparse_attn.sparse_mqa and ops.mhc_pre is mhc_pre.mhc_pre
    assert ops.mhc_post is mhc_post.mhc_post and ops.gemm is bf16_gemm.bf16_gemm_ref   # bf16_gemm is off


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


def test_decode_graphs_refuse_stale_ops(tiny_ckpt):
    """Graphs replay the Ops and Numerics they captured: once the model was prepared again (or its
    numerics changed), run() raises instead of silently replaying the old kernels. Capture needs
    CUDA, so the captured state is set here as capture() leaves it; the check runs before any replay."""
    from engine.cache import KVCache
    from engine.graphs import DecodeGraphs
    from engine.model import load_model
    from engine.runner import step_inputs

    model = load_model(tiny_ckpt("tiny", 0)).prepare_kernels()
    cache = KVCache(model.cfg, 2, 64 << 20, "cpu", torch.float32)
    graphs = DecodeGraphs(model, cache, 2, 256, cache.pad_slot)
    graphs.graphs, graphs.ops, graphs.numerics = {1: None}, model.ops, model.numerics
    step = {"ids": [[5]], "positions": [[0]], "slots": [0], "blocks": [[1]], "starts": None, "reset": []}
    inp = step_inputs(step, "cpu", cache.block_tokens, rows=1, width=graphs.max_blocks, pad_slot=cache.pad_slot)
    model.prepare_kernels()                       # the same kernel set, chosen again: new Ops
    with pytest.raises(RuntimeError, match="kernel set or numerics changed"):
        graphs.run(inp)
    model.ops = graphs.ops
    model.set_numerics("reference")
    with pytest.raises(RuntimeError, match="kernel set or numerics changed"):
        graphs.run(inp)
