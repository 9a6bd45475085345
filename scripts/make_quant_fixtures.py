#!/usr/bin/env python3
"""References for the tests of `kestrel quantize` (tests/fixtures/quant/).

1. python_nvfp4.safetensors: weight matrices and what the Python NVFP4 quantizer of
   scripts/make_fixtures.py (ModelOpt layout) makes of them, for a byte-exact comparison with
   kestrel's quantizer. The matrices have no all-zero 16-weight block: that is the one case
   where the two differ on purpose (docs/QUANTIZE.md).

2. For tiny BF16 fixtures: runs `kestrel quantize` on them, reads the written checkpoint back
   with the independent reader of make_fixtures.py, dequantizes it, and runs transformers in
   float32 on the dequantized weights. Writes NAME.json (the command's calibration tokens, the
   FNV-1a 64 hash of every written tensor) and NAME_logits.f32 ([tokens, vocab] float32 LE).

3. The same for `kestrel quantize --format fp8` (NAME-fp8.json, NAME-fp8_logits.f32), and
   python_fp8.safetensors: matrices with partial 128 x 128 blocks, outliers and an all-zero block,
   and what the FP8 quantizer of make_fixtures.py makes of them (DeepSeek-V3's layout).

    python3 scripts/make_quant_fixtures.py --kestrel build/src/kestrel [--formats nvfp4 fp8]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_fixtures as mf  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests" / "fixtures" / "quant"
FIXTURES = ["llama-bf16", "mixtral-bf16", "qwen3moe-bf16", "glm4moe-bf16"]
FP8_FIXTURES = ["deepseekv3-bf16", "glm4moe-bf16", "qwen3moe-bf16"]
CALIB_TOKENS = list(range(3, 256, 5))


def fnv1a64(data: bytes) -> str:
    h = 0xCBF29CE484222325
    for b in data:
        h ^= b
        h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def python_vectors() -> None:
    gen = torch.Generator().manual_seed(7)
    mats = {
        "normal": torch.randn(8, 64, generator=gen),
        # heavy tails: block scales over the whole E4M3 range
        "outliers": torch.randn(8, 64, generator=gen) * torch.exp(2.0 * torch.randn(8, 64, generator=gen)),
        # one row 1e-7 of the others: its block scales underflow E4M3 to zero
        "tiny_row": torch.cat([torch.randn(7, 32, generator=gen), 1e-7 * torch.randn(1, 32, generator=gen)]),
        # exact E2M1 midpoints after scaling (ties): scale_2 = 1 with amax 2688, block amax 6 * 2
        "ties": torch.tensor([[2688.0] + [0.5] * 15 + [12.0, 0.5, 1.5, 2.5, 3.5, 5.0, 7.0, 10.0,
                                                        -0.5, -1.5, -2.5, -3.5, -5.0, -7.0, -10.0, 1.0]]),
    }
    tensors = {}
    for name, w in mats.items():
        w = mf.bf16_round(w.float())
        assert (w.reshape(w.shape[0], -1, 16).abs().amax(-1) > 0).all(), name
        q, _ = mf.quantize_nvfp4(w, ct=False)
        tensors[f"{name}.input"] = w.contiguous()
        tensors[f"{name}.weight"] = q["weight"]
        tensors[f"{name}.weight_scale"] = q["weight_scale"]
        tensors[f"{name}.weight_scale_2"] = q["weight_scale_2"]
    save_file(tensors, str(OUT / "python_nvfp4.safetensors"), metadata={"format": "pt"})
    (OUT / "python_nvfp4.safetensors").chmod(0o644)


def python_fp8_vectors() -> None:
    gen = torch.Generator().manual_seed(8)
    zero_block = torch.randn(136, 12, generator=gen)
    zero_block[128:] = 0.0  # the second block of rows all zeros: scale 0, zero codes
    mats = {
        # partial blocks at the bottom and right edges: scales [2, 2] over 129 x 130
        "edges": torch.randn(129, 130, generator=gen),
        # heavy tails: codes over the whole E4M3 range, subnormals included
        "outliers": torch.randn(40, 140, generator=gen) * torch.exp(3.0 * torch.randn(40, 140, generator=gen)),
        "zero_block": zero_block,
    }
    tensors = {}
    for name, w in mats.items():
        w = mf.bf16_round(w.float())
        q, _ = mf.quantize_fp8(w, "block", "F32")
        tensors[f"{name}.input"] = w.to(torch.bfloat16).contiguous()
        tensors[f"{name}.weight"] = q["weight"]
        tensors[f"{name}.weight_scale_inv"] = q["weight_scale_inv"]
    save_file(tensors, str(OUT / "python_fp8.safetensors"), metadata={"format": "pt"})
    (OUT / "python_fp8.safetensors").chmod(0o644)


def kestrel_reference(kestrel: Path, name: str, fmt: str) -> None:
    spec = next(s for s in mf.FIXTURES if s.name == name)
    src = REPO / "tests" / "fixtures" / name
    tokens = json.loads((src / "reference.json").read_text())["tokens"]
    fp8 = fmt == "fp8"
    ref = f"{name}-fp8" if fp8 else name
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "q"
        cmd = [str(kestrel), "quantize", "--model", str(src), "--out", str(out), "--shard-size", "64KB"]
        cmd += ["--format", "fp8"] if fp8 else ["--calib-tokens", ",".join(map(str, CALIB_TOKENS))]
        subprocess.run(cmd, check=True, capture_output=True)
        raw = mf.read_checkpoint(out)
        hashes = {}
        for shard in sorted(out.glob("*.safetensors")):
            part = mf.read_safetensors(shard)
            blob = shard.read_bytes()
            hlen = int.from_bytes(blob[:8], "little")
            header = json.loads(blob[8:8 + hlen])
            for t in part:
                a, b = header[t]["data_offsets"]
                hashes[t] = fnv1a64(blob[8 + hlen + a: 8 + hlen + b])
        dense, quant = mf.dequantize_readback(mf.strip_sizes(raw), "fp8-block" if fp8 else "nvfp4-modelopt")
        config = transformers.AutoConfig.from_pretrained(str(out))
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
        # transformers does not build the MTP layer
        mtp = f"model.layers.{config.num_hidden_layers}."
        dense = {k: v for k, v in dense.items() if not k.startswith(mtp)}
        model = mf.build_model(config, spec.family)
        tied = bool(config.tie_word_embeddings)
        sd = mf.from_hub({k: torch.from_numpy(v.astype(np.float32)) for k, v in dense.items()}, spec.family, tied)
        missing, unexpected = model.load_state_dict(sd, strict=False)
        assert not missing and not unexpected, (missing, unexpected)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(tokens)[None]).logits[0].float()
        shards = len(list(out.glob("*.safetensors")))
    (OUT / f"{ref}_logits.f32").write_bytes(logits.numpy().astype("<f4").tobytes())
    mf.write_json(OUT / f"{ref}.json", {
        "source": f"tests/fixtures/{name}",
        "format": fmt,
        **({} if fp8 else {"calib_tokens": CALIB_TOKENS}),
        "shard_size": "64KB",
        "shards": shards,
        "tokens": tokens,
        "shape": [len(tokens), int(config.vocab_size)],
        "logits": f"{ref}_logits.f32",
        "quantized_modules": len(quant),
        "tensor_fnv1a64": hashes,
        "transformers": transformers.__version__,
        "torch": torch.__version__.split("+")[0],
        "notes": "logits: transformers float32 (eager) on the dequantized weights of the checkpoint kestrel quantize "
                 "wrote; tensor_fnv1a64: FNV-1a 64 of each written tensor's bytes",
    })
    print(f"{ref}: {len(quant)} {fmt} modules, {len(hashes)} tensors in {shards} shard(s)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kestrel", type=Path, default=REPO / "build" / "src" / "kestrel")
    ap.add_argument("--formats", nargs="+", choices=["nvfp4", "fp8"], default=["nvfp4", "fp8"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    transformers.utils.logging.set_verbosity_error()
    OUT.mkdir(parents=True, exist_ok=True)
    if "nvfp4" in args.formats:
        python_vectors()
        for name in FIXTURES:
            kestrel_reference(args.kestrel, name, "nvfp4")
    if "fp8" in args.formats:
        python_fp8_vectors()
        for name in FP8_FIXTURES:
            kestrel_reference(args.kestrel, name, "fp8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
