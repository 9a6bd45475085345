#!/usr/bin/env python3
"""Writes tests/text/data/gguf_smollm2.ref.json: the token ids Hugging Face gives for a dozen
varied strings with the tokenizer of SmolLM2-135M-Instruct, for checking the tokenizer kestrel
builds from the GGUF's tokenizer.* metadata.

The reference is the tokenizer.json of the Hugging Face folder converted from the same GGUF
(Digits(individual) + ByteLevel pre-tokenizer, as the model's own tokenizer.json has it), run
with the `tokenizers` library. The ids of transformers' own GGUF loader
(AutoTokenizer.from_pretrained(dir, gguf_file=...)) are recorded next to them; it has no
"smollm" pre-tokenizer rule and so can differ on digits.

Usage: /tmp/realmodel/venv/bin/python scripts/make_gguf_tokenizer_fixture.py [HF_FOLDER] [GGUF]
"""
import json
import pathlib
import sys

from tokenizers import Tokenizer

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "text" / "data" / "gguf_smollm2.ref.json"
HF = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/realmodel/SmolLM2-135M-Instruct-from-Q4_1")
GGUF = pathlib.Path(sys.argv[2] if len(sys.argv) > 2 else
                    ROOT / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf")

CASES = [
    "The capital of France is",
    "Hello, world!",
    "  leading spaces and trailing   ",
    "In 2024, 12345 people paid $67.89 each.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "naïve café, Zürich — «quotes» and ‘apostrophes’",
    "日本語のテキストと中文文本",
    "emoji: 🙂🚀👍🏽 done",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "tabs\tand\nnewlines\r\n\n\nmixed",
    "It's I'm we'll they'd you've DON'T",
    "<|endoftext|>a<|endoftext|>",
    "",
]


def main():
    tok = Tokenizer.from_file(str(HF / "tokenizer.json"))
    cases = [{"text": t, "ids": tok.encode(t).ids} for t in CASES]
    try:
        from transformers import AutoTokenizer
        hf = AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)
        for c in cases:
            c["transformers_gguf_ids"] = hf(c["text"])["input_ids"]
    except Exception as e:  # transformers is optional
        print(f"transformers GGUF loader not run: {e}", file=sys.stderr)
    OUT.write_text(json.dumps({"model": GGUF.name, "reference": str(HF.name) + "/tokenizer.json", "cases": cases},
                              ensure_ascii=False, indent=1) + "\n")
    differ = [c["text"] for c in cases if "transformers_gguf_ids" in c and c["transformers_gguf_ids"] != c["ids"]]
    print(f"wrote {OUT} ({len(cases)} cases; transformers' GGUF loader differs on {len(differ)}: {differ})")


if __name__ == "__main__":
    main()
