"""The levers bench/decode.py and bench/prefill.py can turn off for a before/after in one run (--ab):
programmatic dependent launch, or a module constant of this tree's kernels read at launch."""
import contextlib

# (module, name, the value that turns the lever off; for a lever off by default, the one that turns it on)
LEVERS = {
    "post_mix": ("engine.kernels.mhc_post", "POST_MIX_MAX_T", 0),           # mhc_pre's mix GEMM instead
    "attn_splits": ("engine.kernels.sparse_attn", "MIN_KEYS_PER_SPLIT", 128),  # the earlier split plan
    "compress_split": ("engine.kernels.compressor", "CHANNELS_PER_PROGRAM", 1 << 30),  # one program a row
    "moe_rows_bf16": ("engine.kernels.fused_moe", "PAIR_ROWS_IN_MODEL_DTYPE", False),  # fp32 pair rows
    "router_one": ("engine.kernels.router", "ONE_TOKEN_SORT", False),       # one token: the generic pair sort
    "head_kernel": ("engine.kernels.mhc_pre", "HEAD_KERNEL", False),        # the head's torch ops
    "kv_prep": ("engine.kernels.kv_prep", "KV_PREP", False),                 # rope_qkv, compressors, rope_q apart
    "step_tables": ("engine.kernels.step_tables", "STEP_TABLES", False),     # the tables by torch ops
    "embed_kernel": ("engine.kernels.embed", "EMBED_KERNEL", False),         # the lookup and the copy by torch ops
    "finish_kernel": ("engine.kernels.compressor", "FINISH_KERNEL", False),  # prefill's entries finished by torch ops
    "pool_kernel": ("engine.kernels.compressor", "POOL_KERNEL", False),      # prefill's windows pooled by torch ops
    "seq_parallel": ("engine.parallel.sequence", "SP_MIN_T", 1 << 30),       # prefill's streams on every rank
    "channel_split": ("engine.parallel.sequence", "CHANNEL_SPLIT", False),  # split steps: every compressor on every rank
    "nccl_beta": ("engine.parallel.latency", "BETA_GBS", 150.0),           # the simulated collectives' old bus GB/s
    # off by default, so their --ab turns them on: the shared expert in the down kernel up to 64
    # tokens (not beside it), the w2 group on its SwiGLU up to 16 (not the swiglu kernel + cuBLAS),
    # the indexer's top-k in its scores' launch for rows up to 4096 entries
    "shared_in_down": ("engine.kernels.fused_moe", "SHARED_IN_DOWN_MAX_T", 64),
    "swiglu_w2": ("engine.model.step", "W2_GROUP_MAX_M", 16),
    "topk_in_score": ("engine.kernels.indexer", "TOPK_IN_SCORE_MAX_ROW", 4096),  # the top-k in the scores' launch
    "post_pre": ("engine.kernels.mhc_post", "POST_PRE_MAX_T", 16),          # mhc_post + the next mhc_pre, one launch
}


@contextlib.contextmanager
def lever_off(name: str):
    """Launches inside with one of this tree's levers off (graphs captured inside keep it off):
    pdl (programmatic dependent launch) or one of LEVERS."""
    from importlib import import_module

    from engine.kernels import common

    if name == "pdl":
        common.set_pdl(False)
        undo = lambda: common.set_pdl(None)
    elif name in LEVERS:
        module, attr, off = LEVERS[name]
        mod = import_module(module)
        keep = getattr(mod, attr)
        setattr(mod, attr, off)
        undo = lambda: setattr(mod, attr, keep)
    else:
        raise ValueError(f"unknown lever {name!r}: pdl, {', '.join(LEVERS)}")
    try:
        yield
    finally:
        undo()
