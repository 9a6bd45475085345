#!/usr/bin/env python3
"""A chat model fixture for the server's tests: tests/fixtures/qwen3-chat is the random
qwen3-bf16 model (its weights linked) with a tokenizer and Qwen3's own chat template, so that
/v1/chat/completions renders tools and reasoning as a real Qwen3 does. Its config is qwen3-bf16's
with room for 4096 positions: a prompt with tools takes several hundred tokens of single bytes.

The model's vocabulary has 256 entries, so the tokenizer is a byte-level BPE over the printable
ASCII bytes, space, tab and newline (no merges), with Qwen's added tokens right after them (as
tokenizers numbers added tokens past the vocabulary); the config names <|im_end|> and
<|endoftext|> the end-of-sequence tokens, as Qwen3's does. Text outside those bytes cannot be
encoded: the tests write ASCII. The model's own output is noise; the tests
script the replies (runtime/scripted_slots.h).

Usage: python3 scripts/make_chat_model_fixture.py   (standard library only)
"""
import json
import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "qwen3-chat"
TEMPLATE = ROOT / "tests" / "text" / "data" / "chat" / "templates" / "qwen3.jinja"


def byte_char(b: int) -> str:
    """GPT-2's byte-to-unicode map: printable bytes stand for themselves, the others are shifted."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    if b in printable:
        return chr(b)
    n = 0
    for x in range(256):
        if x not in printable:
            if x == b:
                return chr(256 + n)
            n += 1
    raise ValueError(b)


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    vocab = {}
    for b in [ord("\t"), ord("\n"), ord(" ")] + list(range(ord("!"), ord("~") + 1)):
        vocab[byte_char(b)] = len(vocab)
    names = [  # (text, special): Qwen3 marks the tool and thinking markers not special
        ("<think>", False), ("</think>", False), ("<tool_call>", False), ("</tool_call>", False),
        ("<|im_start|>", True), ("<|im_end|>", True), ("<|endoftext|>", True),
    ]
    added = [(len(vocab) + k, t, sp) for k, (t, sp) in enumerate(names)]
    ids = {t: i for i, t, _ in added}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": sp} for i, t, sp in added],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }
    (OUT / "tokenizer.json").write_text(json.dumps(tokenizer, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    config = {
        "chat_template": TEMPLATE.read_text(encoding="utf-8"),
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "added_tokens_decoder": {str(i): {"content": t, "special": sp} for i, t, sp in added},
    }
    (OUT / "tokenizer_config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    config = json.loads((OUT.parent / "qwen3-bf16" / "config.json").read_text())
    config.update(max_position_embeddings=4096, bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"])
    generation = {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]]}
    for name, j in (("config.json", config), ("generation_config.json", generation)):
        (OUT / name).unlink(missing_ok=True)
        (OUT / name).write_text(json.dumps(j, indent=2) + "\n")
    for name in ("model.safetensors",):
        link = OUT / name
        if link.is_symlink() or link.exists():
            link.unlink()
        os.symlink(f"../qwen3-bf16/{name}", link)


if __name__ == "__main__":
    main()
