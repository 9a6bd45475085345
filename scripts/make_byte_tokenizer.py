#!/usr/bin/env python3
"""Writes a byte-level BPE tokenizer.json with no merges: ids 0-255 are the bytes (GPT-2's
byte-to-character table), and with --vocab N, ids 256 .. N-1 are the printable tokens "<tID>", which
text never encodes to but which decode to text. For models without a tokenizer of their own
(fixtures, random weights of a real configuration): every id a model emits becomes text.

Usage: make_byte_tokenizer.py OUT.json [--vocab N]"""
import argparse
import json

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--vocab", type=int, default=256)
a = ap.parse_args()
if a.vocab < 256:
    raise SystemExit(f"--vocab {a.vocab}: at least the 256 bytes")
# GPT-2's byte-to-character table: printable bytes map to themselves, the rest to 256 + i.
keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
chars, extra = {}, 0
for b in range(256):
    if b in keep:
        chars[b] = chr(b)
    else:
        chars[b] = chr(256 + extra)
        extra += 1
vocab = {chars[b]: b for b in range(256)}
vocab.update({f"<t{i}>": i for i in range(256, a.vocab)})
level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
json.dump({"version": "1.0", "added_tokens": [], "normalizer": None,
           "pre_tokenizer": {"type": "ByteLevel", **level}, "post_processor": None,
           "decoder": {"type": "ByteLevel", **level, "add_prefix_space": True},
           "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                     "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                     "vocab": vocab, "merges": []}}, open(a.out, "w"))
