"""transformers' DeepseekV4ForCausalLM as the oracle for our tiny checkpoints.

The official-format checkpoint is dequantised to fp32 (our formats code, tested on its
own in test_formats.py) and written out under the official names; transformers' own
conversion mapping then renames and merges them, so the name mapping is theirs, not ours.
"""
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.model.config import ModelConfig
from engine.model.loader import Checkpoint, _dequant

HF_KIND = {"swa": "sliding_attention", "csa": "compressed_sparse_attention", "hca": "heavily_compressed_attention"}


def hf_config_dict(cfg: ModelConfig) -> dict:
    hca = sorted({r for r in cfg.compress_ratios if r not in (0, 4)})
    assert len(hca) <= 1, "transformers supports a single HCA ratio"
    d = {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "moe_intermediate_size": cfg.moe_inter_dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads, "num_key_value_heads": 1,
        "head_dim": cfg.head_dim, "q_lora_rank": cfg.q_lora_rank, "num_experts_per_tok": cfg.n_activated_experts,
        "n_routed_experts": cfg.n_routed_experts, "n_shared_experts": cfg.n_shared_experts,
        "scoring_func": cfg.score_func, "norm_topk_prob": cfg.norm_topk_prob,
        "routed_scaling_factor": cfg.route_scale, "swiglu_limit": cfg.swiglu_limit,
        "layer_types": [HF_KIND[cfg.layer_kind(i)] for i in range(cfg.n_layers)],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": hca[0] if hca else 128},
        "mlp_layer_types": ["hash_moe" if cfg.is_hash_layer(i) else "moe" for i in range(cfg.n_layers)],
        "rope_theta": cfg.rope_theta, "compress_rope_theta": cfg.compress_rope_theta,
        "partial_rotary_factor": cfg.rope_dim / cfg.head_dim,
        "hc_mult": cfg.hc_mult, "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters, "hc_eps": cfg.hc_eps,
        "sliding_window": cfg.window_size, "o_groups": cfg.o_groups, "o_lora_rank": cfg.o_lora_rank,
        "index_n_heads": cfg.index_n_heads, "index_head_dim": cfg.index_head_dim, "index_topk": cfg.index_topk,
        "rms_norm_eps": cfg.norm_eps, "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": False, "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
        "torch_dtype": "float32",
    }
    if cfg.yarn is not None:
        d["rope_parameters"] = {"rope_type": "yarn", "factor": cfg.yarn.factor,
                                "original_max_position_embeddings": cfg.yarn.original_seq_len,
                                "beta_fast": cfg.yarn.beta_fast, "beta_slow": cfg.yarn.beta_slow}
    return d


def write_hf_input(src: Path, dst: Path) -> Path:
    """Official checkpoint -> fp32 official-named safetensors + a transformers config.json."""
    dst.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig.from_file(src)
    ckpt = Checkpoint(src)
    tensors = {}
    for name in ckpt.names():
        if name.startswith("mtp.") or (name.endswith(".scale") and name[:-6] + ".weight" in ckpt):
            continue
        t = _dequant(ckpt, name)
        tensors[name] = t if name.endswith("tid2eid") else t.float()
    save_file(tensors, dst / "model.safetensors")
    (dst / "config.json").write_text(json.dumps(hf_config_dict(cfg), indent=1))
    return dst


def load_hf(src: Path, work: Path):
    from transformers import DeepseekV4ForCausalLM

    path = write_hf_input(src, work)
    model = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()
