#!/usr/bin/env python3
"""Tiny Hugging Face checkpoints with reference logits for kestrel's tests.

Every fixture is a small random model written in the on-disk layout of the
matching hub checkpoints (per-expert MoE tensors, ModelOpt / compressed-tensors
NVFP4, block-scaled / per-tensor / compressed-tensors FP8, sharded safetensors with an
index, ...) together with the float32 logits that transformers computes for a
short random prompt.

    python3 scripts/make_fixtures.py                      # all fixtures -> tests/fixtures/NAME/
    python3 scripts/make_fixtures.py --only llama-bf16    # a subset
    python3 scripts/make_fixtures.py --seed-offset 7 --out /tmp/unseen
    python3 scripts/make_fixtures.py --preset speed100m --out out/speed   # -> out/speed/speed100m/
    python3 scripts/make_fixtures.py --list

Files per fixture folder:
    config.json, generation_config.json, model.safetensors (or shards plus
    model.safetensors.index.json), hf_quant_config.json (some NVFP4 ones),
    reference.json and reference_logits.f32 (float32 LE, row-major [T, vocab]);
    fixtures with an MTP layer also reference_mtp_logits.f32 ([T - 1, vocab]).

The reference is one forward pass of the prompt through the transformers model
in float32 (eval, eager attention) holding exactly the values stored on disk:
bf16-rounded tensors, and for NVFP4 and FP8 the dequantized weights (weight-only,
the activations are not quantized; FP8 codes times their scales in float32).
"""

from __future__ import annotations

import argparse
import copy
import fnmatch
import json
import math
import re
import shutil
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parent.parent
PROMPT_LEN = 10
LOGIT_STD = 3.0  # target std of the logits (lm_head scale)
ROUTER_STD = 1.5  # target std of the router logits
MIN_ROUTE_GAP = 2e-3  # smallest allowed gap at every top-k / top-group cut
SIZE_BUDGET = 4 * 1024 * 1024

FP4_MAX = 6.0
FP8_MAX = 448.0
FP8_BLOCK = 128  # DeepSeek-V3's weight_block_size
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

CONFIG_CLASSES = {
    "llama": transformers.LlamaConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
    "mixtral": transformers.MixtralConfig,
    "qwen3_moe": transformers.Qwen3MoeConfig,
    "glm4_moe": transformers.Glm4MoeConfig,
    "deepseek_v3": transformers.DeepseekV3Config,
    "glm_moe_dsa": transformers.GlmMoeDsaConfig,
}
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm_moe_dsa": "GlmMoeDsaForCausalLM",
}
MOE_FAMILIES = {"mixtral", "qwen3_moe", "glm4_moe", "deepseek_v3", "glm_moe_dsa"}
SIGMOID_ROUTER_FAMILIES = {"glm4_moe", "deepseek_v3", "glm_moe_dsa"}
MIN_INDEX_GAP = 2e-3  # smallest allowed gap at every DSA indexer top-k cut


# --------------------------------------------------------------------------------------
# Fixture table
# --------------------------------------------------------------------------------------

@dataclass
class Spec:
    name: str
    family: str
    fmt: str  # "bf16" | "nvfp4-modelopt" | "nvfp4-compressed-tensors" | "fp8-block" | "fp8-compressed-tensors"
    #         | "fp8-tensor" (quant_method fp8 without weight_block_size: one scale per tensor, AutoFP8)
    seed: int
    config: dict
    generation: dict
    notes: str
    shards: int = 1
    fused_experts: bool = False  # experts as transformers-5 fused tensors instead of per expert
    legacy_config: bool = False  # hub style of transformers 4.x: torch_dtype, top-level rope_theta
    quant_location: str = "config"  # modelopt: "config" | "hf_quant_config" | "both"
    # modelopt exclude_modules / compressed-tensors ignore / fp8 modules_to_not_convert (fp8-tensor:
    # ignored_layers, as AutoFP8 writes it)
    exclude: list = field(default_factory=list)
    fp8_scale_dtype: str = "F32"  # FP8 scales as stored: "F32" | "BF16"
    straddle: bool = False  # put one quantized module's tensors into two different shards
    mtp: bool = False  # add the multi-token-prediction layer's weights and reference MTP logits


def _base(**kw):
    cfg = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    cfg.update(kw)
    return {k: v for k, v in cfg.items() if v is not None}  # None: leave the key out


def _rope(theta, **extra):
    d = {"rope_type": "default", "rope_theta": float(theta)}
    d.update(extra)
    return d


FIXTURES = [
    Spec(
        "llama-bf16", "llama", "bf16", 101,
        _base(rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
              rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 64}),
        {"bos_token_id": 1, "eos_token_id": [2, 3]},
        "Llama, tied embeddings (no lm_head tensor), llama3 rope scaling "
        "(factor 8, low 1, high 4, original_max_position_embeddings 64: head_dim 16 has "
        "high, medium and low frequency bands), GQA 4/2, BF16 single file.",
    ),
    Spec(
        "llama-nvfp4", "llama", "nvfp4-modelopt", 102,
        _base(rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, rope_parameters=_rope(500000.0)),
        {"bos_token_id": 1, "eos_token_id": 2},
        "Llama untied, ModelOpt NVFP4 on every linear of the decoder layers, quantization_config in "
        "config.json, exclude_modules [lm_head] (lm_head/embeddings/norms BF16), default rope.",
        exclude=["lm_head"],
    ),
    Spec(
        "qwen2-bf16", "qwen2", "bf16", 103,
        _base(head_dim=None, bos_token_id=250, eos_token_id=251, rope_parameters=_rope(1000000.0)),
        {"bos_token_id": 250, "eos_token_id": 251},
        "Qwen2: q/k/v biases (o_proj has none). config.json in the older hub style: torch_dtype and "
        "top-level rope_theta, rope_scaling null, no rope_parameters.",
        legacy_config=True,
    ),
    Spec(
        "qwen2-nvfp4", "qwen2", "nvfp4-modelopt", 104,
        _base(head_dim=None, bos_token_id=250, eos_token_id=251, rope_parameters=_rope(1000000.0)),
        {"bos_token_id": 250, "eos_token_id": 251},
        "Qwen2, ModelOpt NVFP4 with the settings only in hf_quant_config.json (no quantization_config "
        "in config.json); q/k/v biases stay BF16 next to the quantized weights.",
        quant_location="hf_quant_config", exclude=["lm_head"],
    ),
    Spec(
        "qwen3-bf16", "qwen3", "bf16", 105,
        _base(head_dim=32, bos_token_id=250, eos_token_id=251, attention_bias=False,
              rope_parameters=_rope(1000000.0)),
        {"bos_token_id": 250, "eos_token_id": [251, 252]},
        "Qwen3: per-head q_norm/k_norm (RMSNorm over head_dim before rope), head_dim 32 != "
        "hidden/heads (q_proj is [128, 64]), eos list in generation_config.json.",
    ),
    Spec(
        "qwen3-nvfp4-ct", "qwen3", "nvfp4-compressed-tensors", 106,
        _base(head_dim=32, tie_word_embeddings=True, bos_token_id=250, eos_token_id=251,
              attention_bias=False, rope_parameters=_rope(1000000.0)),
        {"bos_token_id": 250, "eos_token_id": [251, 252]},
        "Qwen3, tied embeddings, compressed-tensors nvfp4-pack-quantized (weight_packed, weight_scale "
        "F8_E4M3, weight_global_scale = divisor, input_global_scale) on every decoder linear, ignore "
        "[lm_head].",
        exclude=["lm_head"],
    ),
    Spec(
        "mixtral-bf16", "mixtral", "bf16", 107,
        _base(intermediate_size=32, rms_norm_eps=1e-5, num_local_experts=8, num_experts_per_tok=2,
              bos_token_id=1, eos_token_id=2, rope_parameters=_rope(1000000.0)),
        {"bos_token_id": 1, "eos_token_id": 2},
        "Mixtral, 8 experts top-2 (softmax over all, renormalized top-k), hub names "
        "block_sparse_moe.gate / block_sparse_moe.experts.N.{w1,w3,w2}; expert size is "
        "intermediate_size (32). config.json in the older hub style (torch_dtype, top-level rope_theta).",
        legacy_config=True,
    ),
    Spec(
        "mixtral-nvfp4", "mixtral", "nvfp4-modelopt", 108,
        _base(intermediate_size=32, rms_norm_eps=1e-5, num_local_experts=8, num_experts_per_tok=2,
              bos_token_id=1, eos_token_id=2, rope_parameters=_rope(1000000.0)),
        {"bos_token_id": 1, "eos_token_id": 2},
        "Mixtral, ModelOpt NVFP4 (attention + every expert w1/w3/w2, each with its own "
        "weight_scale_2), router block_sparse_moe.gate BF16 via exclude_modules.",
        exclude=["lm_head", "model.layers.*.block_sparse_moe.gate"],
    ),
    Spec(
        "qwen3moe-bf16", "qwen3_moe", "bf16", 109,
        _base(num_hidden_layers=3, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
              norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
              bos_token_id=250, eos_token_id=251, rope_parameters=_rope(1000000.0)),
        {"bos_token_id": 250, "eos_token_id": [251, 250]},
        "Qwen3-MoE, 3 layers, mlp_only_layers [1] (layer 1 dense MLP with intermediate_size 128, "
        "layers 0 and 2 MoE), norm_topk_prob true, QK norm, per-expert hub names, two safetensors "
        "shards with model.safetensors.index.json. config.json in the hub style of Qwen3-MoE "
        "checkpoints: num_experts (not num_local_experts), torch_dtype, top-level rope_theta.",
        shards=2, legacy_config=True,
    ),
    Spec(
        "qwen3moe-nvfp4", "qwen3_moe", "nvfp4-modelopt", 110,
        _base(num_hidden_layers=3, head_dim=32, moe_intermediate_size=32, num_experts=8,
              num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[],
              bos_token_id=250, eos_token_id=251, rope_parameters=_rope(1000000.0)),
        {"bos_token_id": 250, "eos_token_id": 251},
        "Qwen3-MoE, 3 layers, decoder_sparse_step 2 (only layer 1 is MoE, layers 0 and 2 dense), "
        "norm_topk_prob false (top-k softmax probabilities used as they are), head_dim 32, ModelOpt "
        "NVFP4 in config.json, router mlp.gate BF16 via exclude_modules. config.json as transformers 5 "
        "writes it: the expert count is under num_local_experts.",
        exclude=["lm_head", "model.layers.*.mlp.gate"],
    ),
    Spec(
        "glm4moe-bf16", "glm4_moe", "bf16", 111,
        _base(num_hidden_layers=3, head_dim=32, rms_norm_eps=1e-5, moe_intermediate_size=32,
              n_routed_experts=8, num_experts_per_tok=3, n_group=2, topk_group=1, n_shared_experts=1,
              routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
              attention_bias=True, use_qk_norm=True, num_nextn_predict_layers=0,
              bos_token_id=250, eos_token_id=[251, 252],
              rope_parameters=_rope(1000000.0, partial_rotary_factor=0.5)),
        {"bos_token_id": 250, "eos_token_id": [251, 252, 253]},
        "GLM-4.5 style MoE with the experts FUSED in the transformers-5 layout: "
        "model.layers.L.mlp.experts.gate_up_proj [E, 2I, H] (gate rows 0..I-1, up rows I..2I-1) and "
        "model.layers.L.mlp.experts.down_proj [E, H, I]. Layer 0 dense, layers 1-2 MoE with a shared "
        "expert; sigmoid router with e_score_correction_bias (F32), n_group 2 / topk_group 1, top-3, "
        "routed_scaling_factor 2.5; q/k/v biases, QK norm, head_dim 32, partial rotary 0.5 in "
        "rope_parameters.",
        fused_experts=True,
    ),
    Spec(
        "glm4moe-nvfp4", "glm4_moe", "nvfp4-modelopt", 112,
        _base(num_hidden_layers=3, head_dim=16, rms_norm_eps=1e-5, moe_intermediate_size=32,
              n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
              routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
              attention_bias=True, use_qk_norm=False, num_nextn_predict_layers=1,
              bos_token_id=250, eos_token_id=[251, 252],
              rope_parameters=_rope(1000000.0, partial_rotary_factor=0.5)),
        {"bos_token_id": 250, "eos_token_id": [251, 252]},
        "GLM-4.5 style MoE, per-expert hub names, ModelOpt NVFP4 (settings in both config.json and "
        "hf_quant_config.json): dense MLP, shared expert and routed experts quantized; attention "
        "(with biases) and router BF16 via exclude_modules; e_score_correction_bias F32 at "
        "mlp.gate.e_score_correction_bias; n_group 1, no QK norm; older hub config style "
        "(torch_dtype, top-level rope_theta and partial_rotary_factor); num_nextn_predict_layers 1 "
        "but no MTP weights (must be ignored); two shards, with one quantized module's tensors split "
        "across them.",
        shards=2, legacy_config=True, quant_location="both", straddle=True,
        exclude=["lm_head", "model.layers.*.mlp.gate", "model.layers.*.self_attn*"],
    ),
]

def _mla(**kw):
    """A tiny multi-head latent attention model: 4 heads, latent 32, nope 16 + rope 8, values 16."""
    cfg = _base(num_hidden_layers=3, head_dim=None, num_key_value_heads=4, rms_norm_eps=1e-5,
                kv_lora_rank=32, q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
                bos_token_id=0, eos_token_id=1)
    cfg.update(kw)
    return cfg


FIXTURES += [
    Spec(
        "deepseekv3-bf16", "deepseek_v3", "bf16", 113,
        _mla(q_lora_rank=None, rope_interleave=False, n_group=2, topk_group=1, num_experts_per_tok=3,
             rope_parameters=_rope(10000.0)),
        {"bos_token_id": 0, "eos_token_id": 1},
        "DeepSeek-V3 architecture (MLA) in the DeepSeek-V2-Lite style: no q_lora_rank (q_proj "
        "[heads x 24, 64]), kv_lora_rank 32, qk_nope 16, qk_rope 8, v_head 16; rope_interleave false "
        "(rotate-half on the rope part), default rope; layer 0 dense, layers 1-2 MoE with a shared "
        "expert, sigmoid router with correction bias, n_group 2 / topk_group 1, top-3, scaling 2.5; "
        "per-expert hub names. num_nextn_predict_layers 1 with the MTP layer's weights at "
        "model.layers.3 (enorm, hnorm, eh_proj, an MoE decoder layer, shared_head.norm and "
        "shared_head.head; no embed_tokens: the main embedding) and reference MTP logits "
        "[prompt - 1, vocab] (reference_mtp_logits.f32).",
        mtp=True,
    ),
    Spec(
        "deepseekv3-nvfp4", "deepseek_v3", "nvfp4-modelopt", 114,
        _mla(rope_interleave=True, n_group=4, topk_group=2, attention_bias=False,
             rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                              "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                              "mscale": 1.0, "mscale_all_dim": 1.0}),
        {"bos_token_id": 0, "eos_token_id": 1},
        "DeepSeek-V3/R1 style: q_lora_rank 32 (q_a_proj, q_a_layernorm, q_b_proj), interleaved rope, "
        "YaRN (factor 4, mscale = mscale_all_dim = 1: the softmax scale grows by mscale^2), n_group 4 / "
        "topk_group 2. ModelOpt NVFP4 on the MLPs only, as NVIDIA's DeepSeek-R1-FP4: dense MLP, shared "
        "and routed experts NVFP4; attention, router and lm_head BF16 via exclude_modules.",
        exclude=["lm_head", "model.layers.*.self_attn*", "model.layers.*.mlp.gate"],
    ),
    Spec(
        "glm5-bf16", "glm_moe_dsa", "bf16", 115,
        _mla(index_topk=4, index_head_dim=16, index_n_heads=4, indexer_types=["full", "shared", "full"],
             num_nextn_predict_layers=1, rope_parameters=_rope(10000.0)),
        {"bos_token_id": 0, "eos_token_id": [1, 2]},
        "GLM-5 architecture (GlmMoeDsaForCausalLM): MLA with q_lora_rank 32 and interleaved rope, "
        "plus the DSA indexer (4 heads of 16, rope on its first 8 dims, LayerNorm k_norm with bias, "
        "weights_proj) with index_topk 4 < prompt length 10, so queries past position 3 attend to "
        "4 selected positions only; indexer_types [full, shared, full] (layer 1 reuses layer 0's "
        "selection and has no indexer weights); layer 0 dense, layers 1-2 MoE with a shared expert. "
        "num_nextn_predict_layers 1 with the MTP layer's weights at model.layers.3 (an MoE decoder "
        "layer running its own indexer, shared_head.head, no embed_tokens) and reference MTP logits "
        "[prompt - 1, vocab] (reference_mtp_logits.f32): past position 3 its queries also attend to 4 "
        "selected positions.",
        mtp=True,
    ),
    Spec(
        "glm5-nvfp4", "glm_moe_dsa", "nvfp4-modelopt", 116,
        _mla(index_topk=6, index_head_dim=16, index_n_heads=4, num_hidden_layers=2,
             rope_parameters=_rope(1000000.0)),
        {"bos_token_id": 0, "eos_token_id": 1},
        "GLM-5 style with ModelOpt NVFP4 on the routed experts and the dense MLP only, as NVIDIA's "
        "GLM-5-NVFP4 keeps attention (and its indexer), router and shared experts in BF16 "
        "(exclude_modules); index_topk 6, every layer runs its indexer; settings in both config.json "
        "and hf_quant_config.json; two shards.",
        shards=2, quant_location="both",
        exclude=["lm_head", "model.layers.*.self_attn*", "model.layers.*.mlp.gate",
                 "model.layers.*.mlp.shared_experts*"],
    ),
]

# FP8 (vocabulary 128 to keep them small): every matrix of these tiny models is smaller than 128 in
# at least one dimension, so most scale blocks are partial; the dense MLPs of DeepSeek-V3 (192) and Qwen3-MoE (160) also have a full
# 128-row block and one partial, as DeepSeek-V3's kv_a_proj_with_mqa (576 rows) has.
FIXTURES += [
    Spec(
        "deepseekv3-fp8", "deepseek_v3", "fp8-block", 117,
        _mla(num_hidden_layers=2, vocab_size=128, intermediate_size=192, rope_interleave=True, n_group=2, topk_group=1,
             rope_parameters=_rope(10000.0)),
        {"bos_token_id": 0, "eos_token_id": 1},
        "DeepSeek-V3/R1 FP8 layout: quantization_config {quant_method fp8, fmt e4m3, activation_scheme "
        "dynamic, weight_block_size [128, 128]} without modules_to_not_convert; every linear of the "
        "layers (MLA attention included) F8_E4M3 with weight_scale_inv F32 [ceil(out/128), ceil(in/128)]; "
        "embeddings, lm_head and router BF16. q_lora_rank 32, interleaved rope, layer 0 dense with "
        "intermediate_size 192 (a full and a partial block of rows), layer 1 MoE with a shared expert.",
    ),
    Spec(
        "glm4moe-fp8", "glm4_moe", "fp8-block", 118,
        _base(vocab_size=128, head_dim=16, rms_norm_eps=1e-5, moe_intermediate_size=32, n_routed_experts=8,
              num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5,
              norm_topk_prob=True, first_k_dense_replace=1, attention_bias=True, use_qk_norm=True,
              num_nextn_predict_layers=0, bos_token_id=120, eos_token_id=[121, 122],
              rope_parameters=_rope(1000000.0, partial_rotary_factor=0.5)),
        {"bos_token_id": 120, "eos_token_id": [121, 122]},
        "GLM-4.5 FP8 style: quant_method fp8 with 128 x 128 blocks, F32 weight_scale_inv; "
        "modules_to_not_convert [lm_head, model.layers.0.mlp (a module prefix: layer 0's dense MLP stays "
        "BF16), model.layers.*.self_attn.o_proj (a regular expression)]; q/k/v biases BF16 beside FP8 "
        "weights, QK norm, partial rotary 0.5, per-expert hub names, layer 1 MoE with a shared expert.",
        exclude=["lm_head", "model.layers.0.mlp", "model.layers.*.self_attn.o_proj"],
    ),
    Spec(
        "qwen3moe-fp8", "qwen3_moe", "fp8-block", 119,
        _base(vocab_size=128, head_dim=32, intermediate_size=160, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
              norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0], bos_token_id=120, eos_token_id=121,
              rope_parameters=_rope(1000000.0)),
        {"bos_token_id": 120, "eos_token_id": 121},
        "Qwen3-MoE FP8 style: quant_method fp8 with 128 x 128 blocks and weight_scale_inv stored as BF16; "
        "modules_to_not_convert naming modules in full (lm_head, the embeddings, the router and a norm, "
        "as Qwen's FP8 configs list them); layer 0 a dense MLP of 160 (a full and a partial block of "
        "rows), layer 1 MoE.",
        exclude=["lm_head", "model.embed_tokens", "model.layers.1.mlp.gate", "model.layers.0.input_layernorm"],
        fp8_scale_dtype="BF16",
    ),
    Spec(
        "qwen3-fp8-ct", "qwen3", "fp8-compressed-tensors", 120,
        _base(vocab_size=128, head_dim=32, tie_word_embeddings=True, bos_token_id=120, eos_token_id=121, attention_bias=False,
              rope_parameters=_rope(1000000.0)),
        {"bos_token_id": 120, "eos_token_id": [121, 122]},
        "Qwen3, tied embeddings, compressed-tensors float-quantized FP8 as llm-compressor's FP8_DYNAMIC "
        "scheme writes it: weights F8_E4M3 with weight_scale BF16 [out, 1] per output channel, "
        "activations dynamic per token (not stored), ignore [lm_head].",
        exclude=["lm_head"], fp8_scale_dtype="BF16",
    ),
    Spec(
        "llama-fp8-tensor", "llama", "fp8-tensor", 121,
        _base(vocab_size=128, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, rope_parameters=_rope(500000.0)),
        {"bos_token_id": 1, "eos_token_id": 2},
        "Llama untied, per-tensor FP8 as AutoFP8 writes it: quantization_config {quant_method fp8, "
        "activation_scheme static, ignored_layers [lm_head]} without weight_block_size; every linear of "
        "the layers F8_E4M3 with weight_scale F32 [] (one scale per tensor) and input_scale F32 [] "
        "(a placeholder of 1/448: activations are not quantized, by kestrel or the reference).",
        exclude=["lm_head"],
    ),
]

_SPEED_CFG = dict(
    vocab_size=32000, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
    rms_norm_eps=1e-6, tie_word_embeddings=False, moe_intermediate_size=160, num_experts=32,
    num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    bos_token_id=1, eos_token_id=2, rope_parameters=_rope(1000000.0),
)
PRESETS = [
    Spec("speed100m", "qwen3_moe", "bf16", 901, dict(_SPEED_CFG), {"bos_token_id": 1, "eos_token_id": 2},
         "Qwen3-MoE of about 100M parameters (8 layers, 32 experts top-4) for CPU speed measurement, BF16."),
    Spec("speed100m-nvfp4", "qwen3_moe", "nvfp4-modelopt", 902, dict(_SPEED_CFG),
         {"bos_token_id": 1, "eos_token_id": 2},
         "Qwen3-MoE of about 100M parameters (8 layers, 32 experts top-4) for CPU speed measurement, "
         "ModelOpt NVFP4.",
         exclude=["lm_head", "model.layers.*.mlp.gate"]),
]


# --------------------------------------------------------------------------------------
# Model construction and random weights
# --------------------------------------------------------------------------------------

def make_config(spec: Spec):
    cfg = CONFIG_CLASSES[spec.family](**copy.deepcopy(spec.config))
    cfg.architectures = [ARCHITECTURES[spec.family]]
    return cfg


def build_model(config, family):
    kw = dict(dtype=torch.float32, attn_implementation="eager")
    if family in MOE_FAMILIES:
        kw["experts_implementation"] = "eager"
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), **kw)
    return model.eval()


def bf16_round(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(torch.float32)


def randomize(model, config, gen: torch.Generator):
    """Overwrite every parameter with values large enough that every layer matters."""
    randomize_module(model, gen, config.hidden_size, bool(getattr(config, "tie_word_embeddings", False)))


def randomize_module(module, gen: torch.Generator, hidden: int, tied: bool = False,
                     head: str = "lm_head.weight"):
    """The init rules of randomize for any module (a model, or an MTP layer whose output
    projection is named `head`), drawing from `gen` parameter by parameter in order."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            z = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("embed_tokens.weight"):
                # a tied table is also the output projection: keep the logits at a few units
                v = z * (LOGIT_STD / math.sqrt(hidden) if tied else 1.0)
            elif name == head:
                v = z * (LOGIT_STD / math.sqrt(hidden))
            elif name.endswith("norm.weight"):
                v = 1.0 + 0.2 * z
            elif name.endswith(".bias"):
                v = 0.1 * z
            elif name.endswith("mlp.gate.weight"):
                v = z * (ROUTER_STD / math.sqrt(p.shape[-1]))
            elif name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
                v = z / math.sqrt(p.shape[-1])
            elif p.ndim == 2:
                v = z / math.sqrt(p.shape[1])
            else:
                raise RuntimeError(f"no init rule for {name} {tuple(p.shape)}")
            p.copy_(bf16_round(v))
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen, dtype=torch.float32))


# --------------------------------------------------------------------------------------
# transformers-5 state dict <-> hub tensor names
# --------------------------------------------------------------------------------------

_FUSED_RE = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_HUB_EXPERT_RE = re.compile(
    r"^(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_EXPERT_NAMES = {
    "mixtral": ("w1", "w3", "w2"),
    "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
    "glm4_moe": ("gate_proj", "up_proj", "down_proj"),
    "deepseek_v3": ("gate_proj", "up_proj", "down_proj"),
    "glm_moe_dsa": ("gate_proj", "up_proj", "down_proj"),
}


def to_hub(sd: dict, family: str, fused: bool, tied: bool) -> dict:
    out = {}
    for k, v in sd.items():
        if tied and k == "lm_head.weight":
            continue
        m = _FUSED_RE.match(k)
        if m and not fused:
            layer, which = m.groups()
            g_name, u_name, d_name = _EXPERT_NAMES[family]
            block = "block_sparse_moe" if family == "mixtral" else "mlp"
            base = f"{layer}.{block}.experts"
            if which == "gate_up_proj":
                inter = v.shape[1] // 2
                for e in range(v.shape[0]):
                    out[f"{base}.{e}.{g_name}.weight"] = v[e, :inter].clone()
                    out[f"{base}.{e}.{u_name}.weight"] = v[e, inter:].clone()
            else:
                for e in range(v.shape[0]):
                    out[f"{base}.{e}.{d_name}.weight"] = v[e].clone()
            continue
        if family == "mixtral":
            k = k.replace(".mlp.", ".block_sparse_moe.")
        out[k] = v.clone()
    return out


def from_hub(hub: dict, family: str, tied: bool) -> dict:
    sd, experts = {}, {}
    for k, v in hub.items():
        m = _HUB_EXPERT_RE.match(k)
        if m:
            layer, e, proj = m.groups()
            experts.setdefault(layer, {}).setdefault(int(e), {})[proj] = v
            continue
        if family == "mixtral":
            k = k.replace(".block_sparse_moe.", ".mlp.")
        sd[k] = v
    g_name, u_name, d_name = _EXPERT_NAMES.get(family, (None, None, None))
    for layer, per in experts.items():
        n = len(per)
        assert sorted(per) == list(range(n)), f"{layer}: experts {sorted(per)}"
        sd[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([per[e][g_name], per[e][u_name]], 0) for e in range(n)])
        sd[f"{layer}.mlp.experts.down_proj"] = torch.stack([per[e][d_name] for e in range(n)])
    if tied:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    return sd


def is_router(module: str) -> bool:
    return module.endswith(".mlp.gate") or module.endswith(".block_sparse_moe.gate")


def pattern_rule(fmt: str) -> str:
    """How a format's exclusion entries match module names."""
    return {"fp8-block": "not_convert", "fp8-tensor": "not_convert", "nvfp4-compressed-tensors": "ct",
            "fp8-compressed-tensors": "ct"}.get(fmt, "fnmatch")


def quantized_modules(hub: dict, patterns: list, rule: str) -> list:
    """Decoder-layer linears that the quantization settings cover."""
    mods = []
    for k, v in hub.items():
        if not (k.endswith(".weight") and v.ndim == 2 and k.startswith("model.layers.")):
            continue
        mod = k[: -len(".weight")]
        if is_router(mod) or mod.split(".")[-1].endswith("norm"):
            continue
        if matches_any(mod, patterns, rule):
            continue
        mods.append(mod)
    return mods


def matches_any(module: str, patterns: list, rule: str) -> bool:
    for p in patterns:
        if rule == "not_convert":
            # transformers' modules_to_not_convert: a regex from the start of the name up to a
            # module boundary, or a suffix of the name
            if re.match(rf"(?:{p})(?:(?<=\.)|(?=\.|$))", module) or module.endswith(p):
                return True
        elif rule == "ct" and p.startswith("re:"):
            if re.match(p[3:], module):
                return True
        elif rule == "ct":
            if module == p:
                return True
        elif fnmatch.fnmatchcase(module, p):
            return True
    return False


# --------------------------------------------------------------------------------------
# NVFP4
# --------------------------------------------------------------------------------------

_E2M1 = torch.tensor(E2M1_VALUES, dtype=torch.float32)
_E2M1_MIDS = (_E2M1[1:] + _E2M1[:-1]) / 2


def quantize_nvfp4(w: torch.Tensor, ct: bool) -> tuple[dict, torch.Tensor]:
    """w: float32 [N, K]. Returns (tensors as stored, dequantized float32 [N, K])."""
    n, k = w.shape
    assert k % 16 == 0, (w.shape,)
    blocks = w.reshape(n, k // 16, 16)
    amax = w.abs().max().to(torch.float32)
    assert amax > 0
    if ct:
        global_scale = (FP4_MAX * FP8_MAX / amax).to(torch.float32)  # a divisor
        scale = (blocks.abs().amax(-1) / FP4_MAX * global_scale)
    else:
        scale_2 = (amax / (FP4_MAX * FP8_MAX)).to(torch.float32)
        scale = blocks.abs().amax(-1) / (FP4_MAX * scale_2)
    scale_f8 = scale.clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    s = scale_f8.to(torch.float32)[..., None]
    if ct:
        x = torch.where(s > 0, blocks * global_scale / torch.where(s > 0, s, 1.0), 0.0)
    else:
        x = torch.where(s > 0, blocks / torch.where(s > 0, s * scale_2, 1.0), 0.0)
    mag = x.abs()
    idx = torch.bucketize(mag, _E2M1_MIDS)  # ties -> smaller magnitude ...
    tie = (idx < 7) & (mag == _E2M1_MIDS[idx.clamp(max=6)]) & (idx % 2 == 1)
    idx = torch.where(tie, idx + 1, idx)  # ... then ties to the even code
    code = idx | ((x < 0).to(torch.int64) << 3)
    code = torch.where(s.expand_as(code) > 0, code, 0).reshape(n, k)
    lo, hi = code[:, 0::2], code[:, 1::2]
    packed = (lo | (hi << 4)).to(torch.uint8).contiguous()
    val = _E2M1[idx] * torch.where(x < 0, -1.0, 1.0)
    val = torch.where(s > 0, val, 0.0)
    if ct:
        deq = (val * s / global_scale).reshape(n, k)
        tensors = {
            "weight_packed": packed,
            "weight_scale": scale_f8.contiguous(),
            "weight_global_scale": global_scale.reshape(1).clone(),
            "input_global_scale": torch.tensor([FP4_MAX * FP8_MAX / 4.0], dtype=torch.float32),
        }
    else:
        deq = (val * s * scale_2).reshape(n, k)
        tensors = {
            "weight": packed,
            "weight_scale": scale_f8.contiguous(),
            "weight_scale_2": scale_2.reshape(()).clone(),
            "input_scale": torch.tensor(4.0 / (FP4_MAX * FP8_MAX), dtype=torch.float32),
        }
    return tensors, deq.to(torch.float32)


# --------------------------------------------------------------------------------------
# FP8
# --------------------------------------------------------------------------------------

def quantize_fp8(w: torch.Tensor, scaling: str, scale_dtype: str) -> tuple[dict, torch.Tensor]:
    """w: float32 [N, K]; scaling "block" (one scale per 128 x 128 block, partial at the edges, as
    DeepSeek-V3: scale = amax / 448, stored as weight_scale_inv), "channel" (one per row, as
    compressed-tensors: weight_scale [N, 1]) or "tensor" (one for all, as AutoFP8: weight_scale [],
    with an input_scale [] the static activation scheme stores). code = E4M3(w / scale), round to nearest even,
    saturating; a block of zeros has scale 0 and zero codes. Returns (tensors as stored, the
    dequantized float32 [N, K] = code x scale in float32)."""
    n, k = w.shape
    if scaling == "block":
        sr, sc = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
        padded = torch.zeros(sr * FP8_BLOCK, sc * FP8_BLOCK, dtype=torch.float32)
        padded[:n, :k] = w
        scale = padded.abs().reshape(sr, FP8_BLOCK, sc, FP8_BLOCK).amax(dim=(1, 3)) / FP8_MAX
    elif scaling == "tensor":
        scale = w.abs().amax() / FP8_MAX
    else:
        scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
    if scale_dtype == "BF16":
        scale = bf16_round(scale)
    full = scale
    if scaling == "block":
        full = scale.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:n, :k]
    full = full.expand(n, k)
    x = torch.where(full > 0, w / torch.where(full > 0, full, 1.0), 0.0).clamp(-FP8_MAX, FP8_MAX)
    codes = x.to(torch.float8_e4m3fn)
    deq = codes.to(torch.float32) * full
    stored = scale.to(torch.bfloat16 if scale_dtype == "BF16" else torch.float32).contiguous()
    name = "weight_scale_inv" if scaling == "block" else "weight_scale"
    tensors = {"weight": codes.contiguous(), name: stored}
    if scaling == "tensor":
        tensors["input_scale"] = torch.tensor(1.0 / FP8_MAX, dtype=torch.float32)
    return tensors, deq.contiguous()


def fp8_block_config(not_convert: list) -> dict:
    q = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
         "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    if not_convert:
        q["modules_to_not_convert"] = list(not_convert)
    return q


def fp8_tensor_config(ignored: list) -> dict:
    q = {"activation_scheme": "static", "quant_method": "fp8"}
    if ignored:
        q["ignored_layers"] = list(ignored)
    return q


def compressed_tensors_fp8_config(ignore: list) -> dict:
    weights = {"num_bits": 8, "type": "float", "strategy": "channel", "group_size": None,
               "symmetric": True, "dynamic": False, "actorder": None, "block_structure": None,
               "observer": "minmax", "observer_kwargs": {}}
    inputs = {"num_bits": 8, "type": "float", "strategy": "token", "group_size": None,
              "symmetric": True, "dynamic": True, "actorder": None, "block_structure": None,
              "observer": None, "observer_kwargs": {}}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": inputs, "output_activations": None,
                                      "format": "float-quantized"}},
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": "0.12.2",
    }


def quantize_weight(w: torch.Tensor, spec: Spec) -> tuple[dict, torch.Tensor]:
    if spec.fmt == "fp8-block":
        return quantize_fp8(w, "block", spec.fp8_scale_dtype)
    if spec.fmt == "fp8-compressed-tensors":
        return quantize_fp8(w, "channel", spec.fp8_scale_dtype)
    if spec.fmt == "fp8-tensor":
        return quantize_fp8(w, "tensor", spec.fp8_scale_dtype)
    return quantize_nvfp4(w, spec.fmt == "nvfp4-compressed-tensors")


def modelopt_settings(exclude: list) -> dict:
    return {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
            "exclude_modules": list(exclude)}


def compressed_tensors_config(ignore: list) -> dict:
    weights = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
               "symmetric": True, "dynamic": False, "actorder": None, "block_structure": None,
               "observer": "minmax", "observer_kwargs": {}}
    inputs = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
              "symmetric": True, "dynamic": "local", "actorder": None, "block_structure": None,
              "observer": "minmax", "observer_kwargs": {}}
    return {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": inputs, "output_activations": None,
                                      "format": "nvfp4-pack-quantized"}},
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": "0.12.2",
    }


# --------------------------------------------------------------------------------------
# Reference forward and routing margins
# --------------------------------------------------------------------------------------

def forward_with_routes(model, tokens: torch.Tensor, family: str):
    captured = []
    hooks = []
    indexed = []
    if family in MOE_FAMILIES:
        for name, mod in model.named_modules():
            if name.endswith(".mlp.gate"):
                hooks.append(mod.register_forward_hook(
                    lambda m, inp, out, name=name: captured.append((name, m, inp[0].detach().clone()))))
            if name.endswith(".self_attn.indexer"):
                hooks.append(mod.register_forward_hook(
                    lambda m, args, kwargs, out: indexed.append((m, args, kwargs)), with_kwargs=True))
    try:
        with torch.no_grad():
            logits = model(input_ids=tokens[None]).logits[0].to(torch.float32).contiguous()
    finally:
        for h in hooks:
            h.remove()
    gap = route_gap(captured, model.config, family)
    for mod, args, kwargs in indexed:
        gap = min(gap, index_gap(mod, *args[:3]))
    return logits, gap


def route_gap(captured, cfg, family: str) -> float:
    """Smallest score gap at every top-k / top-group cut of the captured router inputs."""
    gap = math.inf
    for _, mod, h in captured:
        h = h.reshape(-1, h.shape[-1]).double()
        r = h @ mod.weight.detach().double().T
        k = cfg.num_experts_per_tok
        if family in SIGMOID_ROUTER_FAMILIES:
            choice = torch.sigmoid(r) + mod.e_score_correction_bias.double()
            n_group, topk_group = cfg.n_group, cfg.topk_group
            per = choice.shape[-1] // n_group
            grp = choice.view(-1, n_group, per).topk(2, dim=-1)[0].sum(-1)
            if topk_group < n_group:
                gs = grp.sort(dim=-1, descending=True)[0]
                gap = min(gap, (gs[:, topk_group - 1] - gs[:, topk_group]).min().item())
            keep = torch.zeros_like(grp, dtype=torch.bool)
            keep.scatter_(1, grp.topk(topk_group, dim=-1)[1], True)
            keep = keep[:, :, None].expand(-1, -1, per).reshape(choice.shape)
            choice = choice.masked_fill(~keep, -math.inf)
            cs = choice.sort(dim=-1, descending=True)[0]
            if k < topk_group * per:
                gap = min(gap, (cs[:, k - 1] - cs[:, k]).min().item())
        else:
            cs = r.sort(dim=-1, descending=True)[0]
            gap = min(gap, (cs[:, k - 1] - cs[:, k]).min().item())
    return gap


def index_scores(mod, hidden: torch.Tensor, q_resid: torch.Tensor, position_embeddings) -> torch.Tensor:
    """The DSA indexer's scores [S, S] of one prompt (no cache), causal positions only (else -inf)."""
    rope_mod = sys.modules[type(mod).__module__]
    cos, sin = position_embeddings
    s = hidden.shape[1]
    q = mod.wq_b(q_resid).view(1, s, mod.n_heads, mod.head_dim)
    q_rot, q_pass = torch.split(q, [mod.qk_rope_head_dim, mod.head_dim - mod.qk_rope_head_dim], dim=-1)
    k = mod.k_norm(mod.wk(hidden)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [mod.qk_rope_head_dim, mod.head_dim - mod.qk_rope_head_dim], dim=-1)
    q_rot, k_rot = rope_mod.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)[0].double()  # [S, H, D]
    k = torch.cat([k_rot, k_pass], dim=-1)[0, :, 0].double()  # [S, D]
    scores = torch.relu(torch.einsum("shd,td->sht", q, k) * mod.softmax_scale)
    w = mod.weights_proj(hidden).double()[0] * mod.n_heads ** -0.5  # [S, H]
    idx = torch.einsum("sh,sht->st", w, scores)
    return idx.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), -math.inf)


def index_gap(mod, hidden, q_resid, position_embeddings) -> float:
    """Smallest gap at the top-k cut over the queries that see more than index_topk positions."""
    with torch.no_grad():
        idx = index_scores(mod, hidden, q_resid, position_embeddings)
    k, gap = mod.index_topk, math.inf
    for i in range(k, idx.shape[0]):  # query i sees i + 1 positions
        row = idx[i, : i + 1].sort(descending=True)[0]
        gap = min(gap, (row[k - 1] - row[k]).item())
    return gap


def mtp_reference(spec: Spec, model, tokens: torch.Tensor, seed: int):
    """Random weights for MTP layer 0 (hub names) and its logits for positions 0 .. T-2, computed
    with transformers' own modules as vLLM's deepseek_mtp runs them: h_p is the main model's last
    hidden state (after its final norm), e = embed(tokens[p+1]) with e = 0 at position 0,
    x = eh_proj([enorm(e), hnorm(h_p)]), y = decoder layer(x) at position p (causal over the MTP
    positions), logits = shared_head.head(shared_head.norm(y))."""
    mod = sys.modules[type(model).__module__]
    if spec.family == "deepseek_v3":
        rms_norm, decoder_layer = mod.DeepseekV3RMSNorm, mod.DeepseekV3DecoderLayer
    elif spec.family == "glm_moe_dsa":
        rms_norm, decoder_layer = mod.GlmMoeDsaRMSNorm, mod.GlmMoeDsaDecoderLayer
    else:
        raise RuntimeError(f"{spec.name}: no MTP layer for {spec.family}")
    # model.config carries the eager attention and experts implementations; GLM-5's per-layer lists
    # get an entry for the MTP layer: MoE, and its own indexer (its cache holds no other selection)
    cfg = copy.deepcopy(model.config)
    H, V, L = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    if spec.family == "glm_moe_dsa":
        cfg.mlp_layer_types = list(cfg.mlp_layer_types) + ["sparse"]
        cfg.indexer_types = list(cfg.indexer_types) + ["full"]
    T = tokens.shape[0]
    with torch.no_grad():
        h = model.model(input_ids=tokens[None]).last_hidden_state[:, : T - 1]
        e = model.model.embed_tokens(tokens[None, 1:]).clone()
    e[:, 0] = 0.0
    pos = torch.arange(T - 1)[None]
    mask = transformers.masking_utils.create_causal_mask(
        config=model.config, inputs_embeds=e, attention_mask=None, cache=None, position_ids=pos,
        allow_is_causal_skip=False)
    for attempt in range(50):
        gen = torch.Generator().manual_seed(seed * 101 + 7 + 7919 * attempt)
        mtp = torch.nn.ModuleDict({
            "enorm": rms_norm(H, eps=cfg.rms_norm_eps),
            "hnorm": rms_norm(H, eps=cfg.rms_norm_eps),
            "eh_proj": torch.nn.Linear(2 * H, H, bias=False),
            "layer": decoder_layer(cfg, layer_idx=L),
            "shared_head": torch.nn.ModuleDict({"norm": rms_norm(H, eps=cfg.rms_norm_eps),
                                                "head": torch.nn.Linear(H, V, bias=False)}),
        }).eval()
        randomize_module(mtp, gen, H, head="shared_head.head.weight")
        captured, indexed = [], []
        hooks = [mtp["layer"].mlp.gate.register_forward_hook(
            lambda m, inp, out: captured.append(("mtp", m, inp[0].detach().clone())))]
        indexer = getattr(mtp["layer"].self_attn, "indexer", None)
        if indexer is not None:
            hooks.append(indexer.register_forward_hook(
                lambda m, args, kwargs, out: indexed.append((m, args, kwargs)), with_kwargs=True))
        try:
            with torch.no_grad():
                x = mtp["eh_proj"](torch.cat([mtp["enorm"](e), mtp["hnorm"](h)], dim=-1))
                y = mtp["layer"](x, attention_mask=mask, position_ids=pos,
                                 position_embeddings=model.model.rotary_emb(x, pos))
                if isinstance(y, tuple):  # GLM-5's layer also returns its selection
                    y = y[0]
                logits = mtp["shared_head"]["head"](mtp["shared_head"]["norm"](y))[0].contiguous()
        finally:
            for hk in hooks:
                hk.remove()
        gap = route_gap(captured, cfg, spec.family)
        for m, args, kwargs in indexed:
            gap = min(gap, index_gap(m, *args[:3]))
        if gap >= MIN_ROUTE_GAP:
            break
        print(f"  {spec.name}: MTP attempt {attempt} has a routing gap of {gap:.2e}, trying another", file=sys.stderr)
    else:
        raise RuntimeError(f"{spec.name}: no MTP weights with clear routing")
    sd = {}
    for k, v in mtp.state_dict().items():
        k = k[len("layer."):] if k.startswith("layer.") else k
        sd[f"model.layers.{L}.{k}"] = v
    return to_hub(sd, spec.family, spec.fused_experts, False), logits, gap


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a = a.double()
    b = b.double()
    return ((a - b).norm() / b.norm()).item()


# --------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------

def config_json(spec: Spec, config) -> dict:
    d = config.to_diff_dict()
    d["architectures"] = [ARCHITECTURES[spec.family]]
    d.pop("dtype", None)
    d.pop("torch_dtype", None)
    d.pop("_name_or_path", None)
    if spec.legacy_config:
        rope = dict(d.pop("rope_parameters"))
        d["rope_theta"] = rope.pop("rope_theta")
        if "partial_rotary_factor" in rope:
            d["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
        rtype = rope.get("rope_type", "default")
        d["rope_scaling"] = None if rtype == "default" else rope
        d["torch_dtype"] = "bfloat16"
        if spec.family == "qwen3_moe":  # transformers 5 writes its alias num_local_experts
            d["num_experts"] = d.pop("num_local_experts")
    else:
        d["dtype"] = "bfloat16"
    if spec.fmt == "nvfp4-modelopt" and spec.quant_location in ("config", "both"):
        d["quantization_config"] = {"quant_method": "modelopt", **modelopt_settings(spec.exclude)}
    elif spec.fmt == "nvfp4-compressed-tensors":
        d["quantization_config"] = compressed_tensors_config(spec.exclude)
    elif spec.fmt == "fp8-block":
        d["quantization_config"] = fp8_block_config(spec.exclude)
    elif spec.fmt == "fp8-compressed-tensors":
        d["quantization_config"] = compressed_tensors_fp8_config(spec.exclude)
    elif spec.fmt == "fp8-tensor":
        d["quantization_config"] = fp8_tensor_config(spec.exclude)
    return dict(sorted(d.items()))


def generation_json(spec: Spec) -> dict:
    g = transformers.GenerationConfig(**spec.generation)
    return g.to_diff_dict()


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def split_shards(names: list, nbytes: dict, n: int, straddle: bool) -> list:
    """Consecutive groups of names with about equal bytes."""
    if n == 1:
        return [names]
    total = sum(nbytes.values())
    cuts, acc, target = [], 0, total / n
    for i, name in enumerate(names):
        acc += nbytes[name]
        if len(cuts) < n - 1 and acc >= target * (len(cuts) + 1):
            cuts.append(i + 1)
    if straddle:
        # move the first cut so that a quantized module's packed weight and its scales land in
        # different files, which real NVFP4 checkpoints do.
        c = cuts[0]
        while c < len(names) and not (names[c - 1].endswith(".weight") and
                                      names[c].endswith(".weight_scale") and
                                      names[c - 1][:-7] == names[c][:-13]):
            c += 1
        assert c < len(names), "no quantized module to split across shards"
        cuts[0] = c
    bounds = [0] + cuts + [len(names)]
    return [names[bounds[i]:bounds[i + 1]] for i in range(n)]


def save_tensors(folder: Path, tensors: dict, shards: int, straddle: bool) -> None:
    names = list(tensors)
    nbytes = {k: v.numel() * v.element_size() for k, v in tensors.items()}
    groups = split_shards(names, nbytes, shards, straddle)
    meta = {"format": "pt"}
    if len(groups) == 1:
        save_file({k: tensors[k].contiguous() for k in groups[0]}, str(folder / "model.safetensors"), metadata=meta)
        return
    weight_map = {}
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in group}, str(folder / fname), metadata=meta)
        for k in group:
            weight_map[k] = fname
    write_json(folder / "model.safetensors.index.json",
               {"metadata": {"total_size": sum(nbytes.values())}, "weight_map": dict(sorted(weight_map.items()))})


# --------------------------------------------------------------------------------------
# Independent read-back for verification (own safetensors parser, own FP8/FP4 decoding)
# --------------------------------------------------------------------------------------

_ST_DTYPES = {"BF16": (2, None), "F32": (4, "<f4"), "U8": (1, "u1"), "F8_E4M3": (1, "u1")}


def read_safetensors(path: Path) -> dict:
    """name -> (dtype string, numpy array, stored bytes); BF16 widened to float32, F8 left as raw bytes."""
    raw = path.read_bytes()
    (hlen,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + hlen])
    base = 8 + hlen
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt, shape, (a, b) = info["dtype"], info["shape"], info["data_offsets"]
        size, np_dt = _ST_DTYPES[dt]
        buf = raw[base + a: base + b]
        assert len(buf) == size * int(np.prod(shape, dtype=np.int64)), name
        if dt == "BF16":
            arr = (np.frombuffer(buf, "<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            arr = np.frombuffer(buf, np_dt)
        out[name] = (dt, arr.reshape(shape).copy(), b - a)
    return out


def read_checkpoint(folder: Path) -> dict:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        idx = json.loads(index.read_text())
        files = sorted(set(idx["weight_map"].values()))
        out = {}
        for f in files:
            part = read_safetensors(folder / f)
            for k in part:
                assert idx["weight_map"].get(k) == f, f"{k} not mapped to {f}"
            out.update(part)
        assert set(out) == set(idx["weight_map"]), "index and files disagree"
        total = sum(n for _, _, n in out.values())
        assert idx["metadata"]["total_size"] == total, "total_size"
        return out
    return read_safetensors(folder / "model.safetensors")


def strip_sizes(tensors: dict) -> dict:
    return {k: (dt, arr) for k, (dt, arr, _) in tensors.items()}


def e4m3_decode(u8: np.ndarray) -> np.ndarray:
    u = u8.astype(np.int64)
    sign = np.where(u & 0x80, -1.0, 1.0)
    e = (u >> 3) & 0xF
    m = (u & 0x7).astype(np.float64)
    v = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1.0 + m / 8.0) * np.exp2(e - 7.0))
    v = np.where((e == 15) & ((u & 7) == 7), np.nan, v)
    return sign * v


def e2m1_decode(nibbles: np.ndarray) -> np.ndarray:
    lut = np.array(E2M1_VALUES + tuple(-x for x in E2M1_VALUES), dtype=np.float64)
    return lut[nibbles]


def fp8_dequant(codes: np.ndarray, scale: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """code x scale in float32, a scale per block of rows x cols ([ceil(N/rows), ceil(K/cols)])."""
    n, k = codes.shape
    s = scale.reshape(-(-n // rows), -(-k // cols)).astype(np.float32)
    full = np.repeat(np.repeat(s, rows, axis=0), cols, axis=1)[:n, :k]
    return e4m3_decode(codes).astype(np.float32) * full


def dequantize_readback(tensors: dict, fmt: str) -> tuple[dict, set]:
    """Dense float64 weights from the read-back tensors; returns (hub dict, quantized module names)."""
    ct = fmt == "nvfp4-compressed-tensors"
    packed_suffix = ".weight_packed" if ct else ".weight"
    out, quant = {}, set()
    for name, (dt, arr) in tensors.items():
        if dt == "F8_E4M3" and name.endswith(".weight") and fmt.startswith("fp8"):
            mod = name[: -len(".weight")]
            quant.add(mod)
            sdt, s = tensors[mod + (".weight_scale_inv" if fmt == "fp8-block" else ".weight_scale")]
            assert sdt in ("F32", "BF16"), mod
            n, k = arr.shape
            if fmt == "fp8-block":
                assert s.shape == (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK)), (mod, s.shape)
                out[name] = fp8_dequant(arr, s, FP8_BLOCK, FP8_BLOCK).astype(np.float64)
            elif fmt == "fp8-tensor":
                idt, i = tensors[mod + ".input_scale"]
                assert sdt == "F32" and s.shape == () and idt == "F32" and i.shape == (), mod
                out[name] = fp8_dequant(arr, s, n, k).astype(np.float64)
            else:
                assert s.shape == (n, 1), (mod, s.shape)
                out[name] = fp8_dequant(arr, s, 1, k).astype(np.float64)
        elif dt == "U8" and name.endswith(packed_suffix):
            mod = name[: -len(packed_suffix)]
            quant.add(mod)
            n, half = arr.shape
            nib = np.stack([arr & 0xF, arr >> 4], axis=-1).reshape(n, 2 * half)
            sdt, sraw = tensors[mod + ".weight_scale"]
            assert sdt == "F8_E4M3" and sraw.shape == (n, half * 2 // 16), mod
            scale = np.repeat(e4m3_decode(sraw), 16, axis=1)
            if ct:
                gdt, g = tensors[mod + ".weight_global_scale"]
                idt, ig = tensors[mod + ".input_global_scale"]
                assert gdt == "F32" and g.shape == (1,) and idt == "F32" and ig.shape == (1,), mod
                w = e2m1_decode(nib) * scale / float(g[0])
            else:
                gdt, g = tensors[mod + ".weight_scale_2"]
                idt, ig = tensors[mod + ".input_scale"]
                assert gdt == "F32" and g.shape == () and idt == "F32" and ig.shape == (), mod
                w = e2m1_decode(nib) * scale * float(g)
            out[mod + ".weight"] = w
        elif dt in ("BF16", "F32"):
            out[name] = arr.astype(np.float64)
        else:
            assert dt in ("F8_E4M3", "F32", "U8"), (name, dt)
    for name, (dt, arr) in tensors.items():
        is_aux = any(name.endswith(s) for s in (".weight_scale", ".weight_scale_2", ".input_scale",
                                                 ".weight_global_scale", ".input_global_scale",
                                                 ".weight_scale_inv"))
        if is_aux:
            assert name.rsplit(".", 1)[0] in quant, f"orphan {name}"
            out.pop(name, None)
    return out, quant


# --------------------------------------------------------------------------------------
# One fixture
# --------------------------------------------------------------------------------------

def make_fixture(spec: Spec, out_root: Path, seed_offset: int, verify: bool) -> dict:
    config = make_config(spec)
    tied = bool(config.tie_word_embeddings)
    quantize = spec.fmt != "bf16"
    base_seed = spec.seed + 1_000_003 * seed_offset

    for attempt in range(50):
        seed = base_seed + 7919 * attempt
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, config.vocab_size, (PROMPT_LEN,), generator=gen)
        model = build_model(config, spec.family)
        randomize(model, config, gen)
        hub = to_hub(model.state_dict(), spec.family, spec.fused_experts, tied)

        files, ref_hub = {}, {}
        qmods = set(quantized_modules(hub, spec.exclude, pattern_rule(spec.fmt))) if quantize else set()
        for name, v in hub.items():
            mod = name[: -len(".weight")] if name.endswith(".weight") else None
            if mod in qmods:
                qt, deq = quantize_weight(v, spec)
                for suffix, t in qt.items():
                    files[f"{mod}.{suffix}"] = t
                ref_hub[name] = deq
            elif name.endswith("e_score_correction_bias"):
                files[name] = v.to(torch.float32).contiguous()
                ref_hub[name] = v
            else:
                files[name] = v.to(torch.bfloat16).contiguous()
                ref_hub[name] = v  # already bf16-rounded
        missing, unexpected = model.load_state_dict(from_hub(ref_hub, spec.family, tied), strict=False)
        assert not missing and not unexpected, (missing, unexpected)
        logits, gap = forward_with_routes(model, tokens, spec.family)
        if gap >= MIN_ROUTE_GAP:
            break
        print(f"  {spec.name}: seed {seed} has a routing gap of {gap:.2e}, trying another", file=sys.stderr)
    else:
        raise RuntimeError(f"{spec.name}: no seed with clear routing")

    std = logits.std().item()
    if not std > 1.0:
        raise RuntimeError(f"{spec.name}: logits std {std:.3f} <= 1")

    # after the main model's seed is fixed, so the main weights and logits do not depend on it
    mtp_logits = None
    if spec.mtp:
        mtp_hub, mtp_logits, mtp_gap = mtp_reference(spec, model, tokens, seed)
        assert not quantize, "MTP weights are written for BF16 fixtures only"
        for name, v in mtp_hub.items():
            files[name] = v.to(torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16).contiguous()
        hub.update(mtp_hub)
        gap = min(gap, mtp_gap)
        if not mtp_logits.std().item() > 1.0:
            raise RuntimeError(f"{spec.name}: MTP logits std {mtp_logits.std().item():.3f} <= 1")

    folder = out_root / spec.name
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)

    write_json(folder / "config.json", config_json(spec, config))
    write_json(folder / "generation_config.json", generation_json(spec))
    if spec.fmt == "nvfp4-modelopt" and spec.quant_location in ("hf_quant_config", "both"):
        write_json(folder / "hf_quant_config.json",
                   {"producer": {"name": "modelopt", "version": "0.37.0"},
                    "quantization": modelopt_settings(spec.exclude)})
    save_tensors(folder, files, spec.shards, spec.straddle)
    for f in folder.iterdir():
        f.chmod(0o644)
    (folder / "reference_logits.f32").write_bytes(logits.numpy().astype("<f4").tobytes())
    extra = {}
    if mtp_logits is not None:
        (folder / "reference_mtp_logits.f32").write_bytes(mtp_logits.numpy().astype("<f4").tobytes())
        extra = {"mtp_logits": "reference_mtp_logits.f32", "mtp_shape": [PROMPT_LEN - 1, int(config.vocab_size)]}
    write_json(folder / "reference.json", {
        **extra,
        "tokens": [int(t) for t in tokens],
        "shape": [PROMPT_LEN, int(config.vocab_size)],
        "logits": "reference_logits.f32",
        "transformers": transformers.__version__,
        "torch": torch.__version__.split("+")[0],
        "family": spec.family,
        "format": spec.fmt,
        "seed": seed,
        "notes": spec.notes,
    })

    check = ""
    if verify:
        check = verify_bf16(folder, spec, logits) if spec.fmt == "bf16" else \
            verify_quantized(folder, spec, ref_hub, logits, tied)

    size = sum(f.stat().st_size for f in folder.iterdir())
    n_params = sum(v.numel() for v in hub.values())
    return {"name": spec.name, "size": size, "std": std, "gap": gap, "check": check,
            "params": n_params, "folder": folder}


def verify_bf16(folder: Path, spec: Spec, ref: torch.Tensor) -> str:
    kw = dict(dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    if spec.family in MOE_FAMILIES:
        kw["experts_implementation"] = "eager"
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(folder), **kw)
    # transformers does not build the MTP layer: its tensors are the only ones it may leave unused
    mtp_prefix = f"model.layers.{model.config.num_hidden_layers}."
    info["unexpected_keys"] = [k for k in info.get("unexpected_keys", []) if not (spec.mtp and k.startswith(mtp_prefix))]
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        raise RuntimeError(f"{spec.name}: transformers load problems {bad}")
    model.eval()
    tokens = torch.tensor(json.loads((folder / "reference.json").read_text())["tokens"])
    with torch.no_grad():
        got = model(input_ids=tokens[None]).logits[0].float()
    stored = torch.from_numpy(np.fromfile(folder / "reference_logits.f32", dtype="<f4").reshape(ref.shape))
    err = max(rel_l2(got[t], stored[t]) for t in range(ref.shape[0]))
    if not err < 1e-5:
        raise RuntimeError(f"{spec.name}: from_pretrained logits differ, rel L2 {err:.2e}")
    return f"from_pretrained rel_l2 {err:.1e}"


def verify_quantized(folder: Path, spec: Spec, ref_hub: dict, ref: torch.Tensor, tied: bool) -> str:
    tensors = strip_sizes(read_checkpoint(folder))
    dense, quant = dequantize_readback(tensors, spec.fmt)

    # the quantization settings on disk must describe exactly the quantized modules
    cfg_file = json.loads((folder / "config.json").read_text())
    if spec.fmt in ("nvfp4-compressed-tensors", "fp8-compressed-tensors"):
        patterns = cfg_file["quantization_config"]["ignore"]
    elif spec.fmt in ("fp8-block", "fp8-tensor"):
        q = cfg_file["quantization_config"]
        patterns = q.get("modules_to_not_convert", []) + q.get("ignored_layers", [])
    else:
        sources = []
        if "quantization_config" in cfg_file:
            sources.append(cfg_file["quantization_config"]["exclude_modules"])
        hqc = folder / "hf_quant_config.json"
        if hqc.exists():
            sources.append(json.loads(hqc.read_text())["quantization"]["exclude_modules"])
        assert sources and all(s == sources[0] for s in sources), "missing or conflicting settings"
        patterns = sources[0]
    expected = set(quantized_modules(dense, patterns, pattern_rule(spec.fmt)))
    if expected != quant:
        raise RuntimeError(f"{spec.name}: quantized set mismatch {sorted(expected ^ quant)[:6]}")

    # dequantized values equal the weights used for the reference
    if set(dense) != set(ref_hub):
        raise RuntimeError(f"{spec.name}: tensor names differ {sorted(set(dense) ^ set(ref_hub))[:6]}")
    worst = 0.0
    for k, v in ref_hub.items():
        a = v.double().numpy()
        d = np.abs(dense[k] - a).max() / max(np.abs(a).max(), 1e-30)
        worst = max(worst, float(d))
    if not worst < 1e-6:
        raise RuntimeError(f"{spec.name}: dequantized weights differ by {worst:.2e}")
    for k, (dt, _) in tensors.items():
        want = "F32" if k.endswith("e_score_correction_bias") else None
        if want and dt != want:
            raise RuntimeError(f"{spec.name}: {k} stored as {dt}")

    # the config as transformers reads it from disk, fed with the read-back weights
    config = transformers.AutoConfig.from_pretrained(str(folder))
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = build_model(config, spec.family)
    sd = from_hub({k: torch.from_numpy(v.astype(np.float32)) for k, v in dense.items()}, spec.family, tied)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    tokens = torch.tensor(json.loads((folder / "reference.json").read_text())["tokens"])
    with torch.no_grad():
        got = model(input_ids=tokens[None]).logits[0].float()
    err = max(rel_l2(got[t], ref[t]) for t in range(ref.shape[0]))
    if not err < 1e-5:
        raise RuntimeError(f"{spec.name}: read-back logits differ, rel L2 {err:.2e}")
    return f"{len(quant)} {spec.fmt} modules, dequant max rel {worst:.0e}, read-back rel_l2 {err:.1e}"


# --------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None,
                    help="output root (default tests/fixtures; out/fixtures for --preset)")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="make only these fixtures")
    ap.add_argument("--seed-offset", type=int, default=0, help="different random weights and prompts")
    ap.add_argument("--preset", nargs="+", choices=[p.name for p in PRESETS],
                    help="make these larger, non-committed checkpoints into OUT/NAME instead of the fixtures")
    ap.add_argument("--list", action="store_true", help="list the fixtures and exit")
    ap.add_argument("--verify", dest="verify", action="store_true", default=True,
                    help="check every written checkpoint (default)")
    ap.add_argument("--no-verify", dest="verify", action="store_false")
    args = ap.parse_args(argv)

    if args.list:
        for s in FIXTURES + PRESETS:
            kind = "preset " if s in PRESETS else ""
            print(f"{kind}{s.name:18s} {s.family:10s} {s.fmt:25s} {s.notes}")
        return 0

    torch.set_num_threads(1)
    torch.manual_seed(0)
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    if args.preset:
        if args.only:
            ap.error("--only and --preset do not combine")
        specs = [p for p in PRESETS if p.name in args.preset]
        out = args.out or (REPO / "out" / "fixtures")
    else:
        by_name = {s.name: s for s in FIXTURES}
        unknown = [n for n in (args.only or []) if n not in by_name]
        if unknown:
            ap.error(f"unknown fixture(s) {unknown}; see --list")
        specs = [by_name[n] for n in args.only] if args.only else FIXTURES
        out = args.out or (REPO / "tests" / "fixtures")
    out.mkdir(parents=True, exist_ok=True)

    total = 0
    for spec in specs:
        r = make_fixture(spec, out, args.seed_offset, args.verify)
        total += r["size"]
        print(f"{r['name']:16s} {r['size']:9d} bytes  params {r['params']:>10d}  logits std {r['std']:6.3f}  "
              f"route gap {r['gap']:.1e}  {r['check']}".rstrip(), flush=True)
    print(f"total {total} bytes in {len(specs)} checkpoint(s) under {out}")
    if not args.preset and not args.only and total > SIZE_BUDGET:
        print(f"warning: fixtures exceed {SIZE_BUDGET} bytes", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
