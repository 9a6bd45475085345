#!/usr/bin/env python3
"""A Qwen3-MoE checkpoint of full shapes in ModelOpt NVFP4 layout with random weights, for timing
loads (`kestrel bench --model DIR`) without downloading a real one.

The folder holds config.json (configs/qwen3-30b-a3b-nvfp4.json by default, with its ModelOpt
quantization_config), safetensors shards and model.safetensors.index.json. Every tensor kestrel's
loader reads is there, named, typed and shaped as in NVIDIA's checkpoints: quantized linears as
`weight` U8 [out, in/2] (random E2M1 codes), `weight_scale` F8_E4M3 [out, in/16] (small positive
scales), `weight_scale_2` and `input_scale` F32 scalars; modules the config's exclude_modules
match (and the embedding) as BF16, norms as BF16 ones. No tokenizer: kestrel bench and
`kestrel logits --tokens` need none.

Random bytes come from small pools read at random offsets, so writing 17 GB costs about what the
disk takes. Needs numpy only.

  python3 scripts/make_random_checkpoint.py /tmp/qwen3-30b-a3b-random             # 48 layers, ~17 GB
  python3 scripts/make_random_checkpoint.py /tmp/qwen3-2l --layers 2 --shard-gb 0.3  # a small check
"""
import argparse
import fnmatch
import json
import os
import struct
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POOL = 64 << 20  # bytes per random pool


class Pools:
    """Random bytes of each kind, handed out as slices at random offsets."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)
        self.codes = self.rng.integers(0, 256, POOL, dtype=np.uint8)  # two E2M1 codes a byte, all valid
        # E4M3 scales 0x20..0x37: positive normals 0.125 .. 0.9375 (no zero, no NaN)
        self.scales = self.rng.integers(0x20, 0x38, POOL, dtype=np.uint8)
        # BF16 values of about N(0, 0.02): the float32 values' high halves
        f = (self.rng.standard_normal(POOL // 2, dtype=np.float32) * 0.02).view(np.uint32)
        self.bf16 = (f >> 16).astype(np.uint16).view(np.uint8)

    def write(self, f, pool, n, step=1):
        while n > 0:
            k = min(n, len(pool) // 2)
            start = int(self.rng.integers(0, (len(pool) - k) // step + 1)) * step
            f.write(pool[start:start + k].data)
            n -= k


def is_moe_layer(c, i):
    experts = c.get("num_experts", c.get("num_local_experts", 0))
    step = c.get("decoder_sparse_step", 1)
    return experts > 0 and i not in c.get("mlp_only_layers", []) and (i + 1) % step == 0


def quantized(c, module):
    q = c.get("quantization_config", {})
    if q.get("quant_algo") != "NVFP4":
        sys.exit("make_random_checkpoint: the config's quantization_config is not ModelOpt NVFP4")
    for pat in q.get("exclude_modules", q.get("ignore", [])):
        if fnmatch.fnmatchcase(module, pat) or module.startswith(pat + "."):
            return False
    return True


def tensors(c):
    """(name, dtype, shape, fill) of every tensor, in file order. fill: codes, scales, bf16, ones, or a float."""
    H, hd = c["hidden_size"], c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
    V, nh, nkv = c["vocab_size"], c["num_attention_heads"], c["num_key_value_heads"]
    E = c.get("num_experts", c.get("num_local_experts", 0))
    out = []

    def norm(name, n):
        out.append((name + ".weight", "BF16", [n], "ones"))

    def linear(module, rows, cols):
        if not quantized(c, module):
            out.append((module + ".weight", "BF16", [rows, cols], "bf16"))
            return
        if cols % 16:
            sys.exit(f"make_random_checkpoint: {module}: {cols} inputs is not a multiple of 16")
        out.append((module + ".weight", "U8", [rows, cols // 2], "codes"))
        out.append((module + ".weight_scale", "F8_E4M3", [rows, cols // 16], "scales"))
        # weights of RMS ~1/sqrt(cols): uniform E2M1 codes have RMS 2.9, the scales about 0.5
        out.append((module + ".weight_scale_2", "F32", [], 1.0 / (2.9 * 0.5 * cols**0.5)))
        out.append((module + ".input_scale", "F32", [], 1.0))

    out.append(("model.embed_tokens.weight", "BF16", [V, H], "bf16"))
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        norm(p + "input_layernorm", H)
        norm(p + "post_attention_layernorm", H)
        linear(p + "self_attn.q_proj", nh * hd, H)
        linear(p + "self_attn.k_proj", nkv * hd, H)
        linear(p + "self_attn.v_proj", nkv * hd, H)
        linear(p + "self_attn.o_proj", H, nh * hd)
        norm(p + "self_attn.q_norm", hd)
        norm(p + "self_attn.k_norm", hd)
        if is_moe_layer(c, i):
            I = c["moe_intermediate_size"]
            out.append((p + "mlp.gate.weight", "BF16", [E, H], "bf16"))  # the router, never quantized
            for e in range(E):
                linear(p + f"mlp.experts.{e}.gate_proj", I, H)
                linear(p + f"mlp.experts.{e}.up_proj", I, H)
                linear(p + f"mlp.experts.{e}.down_proj", H, I)
        else:
            I = c["intermediate_size"]
            linear(p + "mlp.gate_proj", I, H)
            linear(p + "mlp.up_proj", I, H)
            linear(p + "mlp.down_proj", H, I)
    norm("model.norm", H)
    if not c.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", "BF16", [V, H], "bf16"))
    return out


SIZE = {"BF16": 2, "U8": 1, "F8_E4M3": 1, "F32": 4}


def nbytes(t):
    n = SIZE[t[1]]
    for d in t[2]:
        n *= d
    return n


def write_shard(path, ts, pools):
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape, _ in ts:
        n = nbytes((name, dtype, shape, None))
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + n]}
        off += n
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    ones = np.full(1 << 16, 0x3F80, dtype=np.uint16)  # BF16 1.0
    with open(path, "wb", buffering=16 << 20) as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for t in ts:
            n, fill = nbytes(t), t[3]
            if fill == "codes":
                pools.write(f, pools.codes, n)
            elif fill == "scales":
                pools.write(f, pools.scales, n)
            elif fill == "bf16":
                pools.write(f, pools.bf16, n, step=2)
            elif fill == "ones":
                f.write(ones[: n // 2].tobytes())
            else:
                f.write(struct.pack("<f", float(fill)))
    return off


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="folder to write (created)")
    ap.add_argument("--config", default=os.path.join(REPO, "configs", "qwen3-30b-a3b-nvfp4.json"))
    ap.add_argument("--layers", type=int, default=0, help="the first N layers only (0: all)")
    ap.add_argument("--shard-gb", type=float, default=4.0, help="about this many GB per shard")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()

    c = json.load(open(a.config))
    if c.get("model_type") not in ("qwen3_moe", "qwen3"):
        sys.exit(f"make_random_checkpoint: {a.config}: model_type {c.get('model_type')!r}; only qwen3_moe and qwen3 are written")
    if a.layers:
        if not 0 < a.layers <= c["num_hidden_layers"]:
            sys.exit(f"--layers: {a.layers} is outside 1..{c['num_hidden_layers']}")
        c["num_hidden_layers"] = a.layers
    ts = tensors(c)
    shards, cur, size = [], [], 0
    for t in ts:
        if cur and size + nbytes(t) > a.shard_gb * 1e9:
            shards.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += nbytes(t)
    shards.append(cur)

    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
    pools = Pools(a.seed)
    weight_map, total = {}, 0
    for k, s in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        total += write_shard(os.path.join(a.out, name), s, pools)
        weight_map.update({t[0]: name for t in s})
        print(f"\rwrote {name}, {total / 1e9:.1f} GB", end="", file=sys.stderr, flush=True)
    with open(os.path.join(a.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    print(f"\n{a.out}: {c['num_hidden_layers']} layers, {len(ts)} tensors, {total / 1e9:.2f} GB in {len(shards)} shards",
          file=sys.stderr)


if __name__ == "__main__":
    main()
