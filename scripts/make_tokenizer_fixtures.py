#!/usr/bin/env python3
"""Builds the tokenizer fixtures of tests/text/data/tokenizers and their reference encodings.

Each fixture is a small BPE tokenizer trained here on train.txt (written for this project) and
then given exactly the normalizer / pre-tokenizer / post-processor / decoder / added-token
configuration of one model family's real tokenizer.json. The references are what the Hugging
Face `tokenizers` library (pip install tokenizers) returns for every line of corpus.txt, a few
multi-line cases and the whole corpus as one string. The C++ tests must reproduce them exactly.

Usage: python3 scripts/make_tokenizer_fixtures.py
       python3 scripts/make_tokenizer_fixtures.py --real   # references for the real tokenizers that
                                                           # scripts/fetch_tokenizers.sh fetches
"""
import json
import pathlib

import tokenizers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

ROOT = pathlib.Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "text" / "data" / "tokenizers"

LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp maps GLM-4.5's tokenizer to its "glm4" pre-tokenizer: the Llama-3 split with \p{N}{1,3}.
GLM4_REGEX = LLAMA3_REGEX

EXTRA_CASES = [
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "line one\nline two\r\nline three\n\n\nafter three newlines\n",
    "  \n\t\n   \n",
    "\n",
    "\r\n\r\n",
    "code:\n    indented\n\tтаб\n",
    "[gMASK]<sop><|user|>\nhello<|assistant|>\n<think>\n\n</think>\n\nanswer",
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>",
    "<s>[INST] question [/INST] answer</s><s>[INST] again [/INST]",
    "end with spaces   ",
    "   ",
    "a",
    "<mask>",
    "x <mask>y<sep>  z",
]


def byte_level_trained(regex, vocab_size):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(DATA / "train.txt")], trainer)
    return json.loads(tok.to_str())


def added(content, tid, special=True, **flags):
    tok = {"id": tid, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
           "normalized": False, "special": special}
    tok.update(flags)
    return tok


def with_added(j, specs):
    """Appends added tokens after the model vocabulary, as the real files do."""
    next_id = len(j["model"]["vocab"])
    j["added_tokens"] = []
    for content, special, flags in specs:
        j["added_tokens"].append(added(content, next_id, special, **flags))
        next_id += 1
    return j


def split_regex(regex):
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


def byte_level(add_prefix_space, trim_offsets, use_regex):
    return {"type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": trim_offsets,
            "use_regex": use_regex}


def string_merges(j):
    j["model"]["merges"] = [" ".join(m) for m in j["model"]["merges"]]
    return j


def bos_template(bos, bos_id, eos=None, eos_id=None):
    single = [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}]
    pair = single + [{"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}]
    special = {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}
    if eos is not None:
        single.append({"SpecialToken": {"id": eos, "type_id": 0}})
        pair.append({"SpecialToken": {"id": eos, "type_id": 1}})
        special[eos] = {"id": eos, "ids": [eos_id], "tokens": [eos]}
    return {"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": special}


def llama3():
    # Meta-Llama-3 tokenizer.json: no normalizer, Split + ByteLevel(use_regex=false), ByteLevel decoder,
    # ByteLevel + TemplateProcessing(<|begin_of_text|> $A) post-processor, "a b" merges, ignore_merges.
    j = byte_level_trained(LLAMA3_REGEX, 2000)
    j = with_added(j, [(t, True, {}) for t in ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                                               "<|reserved_special_token_1|>", "<|start_header_id|>",
                                               "<|end_header_id|>", "<|reserved_special_token_2|>", "<|eot_id|>"]])
    bos_id = j["added_tokens"][0]["id"]
    j["normalizer"] = None
    j["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split_regex(LLAMA3_REGEX), byte_level(False, True, False)]}
    j["post_processor"] = {"type": "Sequence", "processors": [byte_level(True, False, True),
                                                              bos_template("<|begin_of_text|>", bos_id)]}
    j["decoder"] = byte_level(True, True, True)
    j["model"]["ignore_merges"] = True
    return string_merges(j)


def qwen2():
    # Qwen2/2.5/3 tokenizer.json: NFC, Split(\p{N} single digits) + ByteLevel, ByteLevel post-processor
    # and decoder, no BOS; <think> and </think> are added but not special (Qwen3).
    j = byte_level_trained(QWEN2_REGEX, 2000)
    j = with_added(j, [("<|endoftext|>", True, {}), ("<|im_start|>", True, {}), ("<|im_end|>", True, {}),
                       ("<|object_ref_start|>", True, {}), ("<tool_call>", False, {}), ("</tool_call>", False, {}),
                       ("<think>", False, {}), ("</think>", False, {})])
    j["normalizer"] = {"type": "NFC"}
    j["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split_regex(QWEN2_REGEX), byte_level(False, False, False)]}
    j["post_processor"] = byte_level(False, False, False)
    j["decoder"] = byte_level(False, False, False)
    j["model"]["continuing_subword_prefix"] = ""
    j["model"]["end_of_word_suffix"] = ""
    return j


def glm45():
    # GLM-4.5: byte-level BPE with the Llama-3-style split (\p{N}{1,3}) per llama.cpp's mapping; the
    # special tokens and their order follow its tokenizer_config.json. Post-processor: none (its chat
    # template writes [gMASK]<sop> itself).
    j = byte_level_trained(GLM4_REGEX, 2000)
    j = with_added(j, [(t, True, {}) for t in ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>",
                                               "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]] +
                   [("<think>", False, {}), ("</think>", False, {})])
    j["normalizer"] = None
    j["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split_regex(GLM4_REGEX), byte_level(False, True, False)]}
    j["post_processor"] = None
    j["decoder"] = byte_level(True, True, True)
    return j


def sentencepiece_trained(vocab_size):
    specials = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    # The 150 most frequent characters (ties by code point) make the alphabet; the rest fall back to
    # bytes. Chosen here because the trainer's own choice among equal counts is not reproducible.
    text = (DATA / "train.txt").read_bytes().decode("utf-8").replace(" ", "▁").replace("\n", "")
    counts = {}
    for ch in "▁" + text:
        counts[ch] = counts.get(ch, 0) + 1
    alphabet = sorted(counts, key=lambda ch: (-counts[ch], ch))[:150]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, show_progress=False,
                                  limit_alphabet=len(alphabet), initial_alphabet=alphabet,
                                  special_tokens=specials + byte_tokens)
    tok.train([str(DATA / "train.txt")], trainer)
    j = json.loads(tok.to_str())
    # Byte tokens live in the model vocabulary only, as in Llama-2 and Mixtral.
    j["added_tokens"] = [a for a in j["added_tokens"] if a["content"] in specials]
    return j


SP_DECODER = {"type": "Sequence", "decoders": [
    {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
    {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}


def mistral_sp():
    # Mixtral / Llama-2 tokenizer.json: Prepend("▁") + Replace(" ", "▁") normalizer, no pre-tokenizer,
    # BPE with byte_fallback and fuse_unk, <s> template, Replace/ByteFallback/Fuse/Strip decoder.
    j = sentencepiece_trained(1200)
    j["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}
    j["pre_tokenizer"] = None
    j["post_processor"] = bos_template("<s>", 1)
    j["decoder"] = SP_DECODER
    return string_merges(j)


def metaspace_sp():
    # Newer sentencepiece conversions (legacy=False, e.g. Mistral v0.3): Metaspace pre-tokenizer with
    # prepend_scheme "first" instead of the normalizer.
    j = sentencepiece_trained(1200)
    j["normalizer"] = None
    j["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False}
    j["post_processor"] = bos_template("<s>", 1)
    j["decoder"] = SP_DECODER
    return j


def gpt2_flags():
    # Not a family: GPT-2 style ByteLevel(add_prefix_space, use_regex) with Digits, an NFC normalizer,
    # a two-token template and added tokens with every flag, to cover the remaining options.
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)])
    trainer = trainers.BpeTrainer(vocab_size=1000, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(DATA / "train.txt")], trainer)
    j = json.loads(tok.to_str())
    j = with_added(j, [("<s>", True, {}), ("</s>", True, {}), ("<mask>", True, {"lstrip": True}),
                       ("<sep>", True, {"rstrip": True}), ("word", False, {"single_word": True, "normalized": True}),
                       ("café", False, {"normalized": True}), ("<|im_start|>", True, {"lstrip": True, "rstrip": True})])
    ids = {a["content"]: a["id"] for a in j["added_tokens"]}
    j["post_processor"] = bos_template("<s>", ids["<s>"], "</s>", ids["</s>"])
    j["decoder"] = byte_level(True, True, True)
    return j


FIXTURES = {
    "llama3": llama3,
    "qwen2": qwen2,
    "glm45": glm45,
    "mistral_sp": mistral_sp,
    "metaspace_sp": metaspace_sp,
    "gpt2_flags": gpt2_flags,
}

# Pre-tokenizers and normalizers on their own, for the behaviours no family file uses.
COMPONENTS = [
    ("pre_tokenizer", {"type": "Split", "pattern": {"Regex": r"\s+"}, "behavior": "Removed", "invert": False}),
    ("pre_tokenizer", {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False}),
    ("pre_tokenizer", {"type": "Split", "pattern": {"Regex": r"\p{N}+"}, "behavior": "MergedWithNext", "invert": False}),
    ("pre_tokenizer", {"type": "Split", "pattern": {"Regex": r"\p{L}"}, "behavior": "Contiguous", "invert": False}),
    ("pre_tokenizer", {"type": "Split", "pattern": {"Regex": r"\p{L}+|\p{N}+"}, "behavior": "Removed", "invert": True}),
    ("pre_tokenizer", {"type": "Split", "pattern": {"Regex": r"[aeiou]"}, "behavior": "Isolated", "invert": True}),
    ("pre_tokenizer", {"type": "Digits", "individual_digits": False}),
    ("pre_tokenizer", {"type": "Digits", "individual_digits": True}),
    ("pre_tokenizer", {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}),
    ("pre_tokenizer", {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "never", "split": True}),
    ("pre_tokenizer", byte_level(True, True, True)),
    ("pre_tokenizer", byte_level(False, False, False)),
    ("pre_tokenizer", {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"\p{N}{1,3}"}, "behavior": "Isolated", "invert": False},
        split_regex(QWEN2_REGEX)]}),
    ("normalizer", {"type": "NFC"}),
    ("normalizer", {"type": "NFD"}),
    ("normalizer", {"type": "NFKC"}),
    ("normalizer", {"type": "NFKD"}),
    ("normalizer", {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}),
    ("normalizer", {"type": "Replace", "pattern": {"Regex": r" {2,}"}, "content": " "}),
    ("normalizer", {"type": "Strip", "strip_left": True, "strip_right": True}),
    ("normalizer", {"type": "Lowercase"}),
]


def make_component(kind, config):
    wrapper = {"version": "1.0", "model": {"type": "BPE", "vocab": {}, "merges": []},
               "normalizer": config if kind == "normalizer" else None,
               "pre_tokenizer": config if kind == "pre_tokenizer" else None}
    tok = Tokenizer.from_str(json.dumps(wrapper))
    return tok.normalizer if kind == "normalizer" else tok.pre_tokenizer


def compact(obj):
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


# Real tokenizers fetched into models/ (not committed): name -> path from the repository root.
REAL = {"deepseek_v3": "models/tokenizers/deepseek-v3/tokenizer.json"}


def reference(tok_text: str, tokenizer_field: str, cases: list) -> dict:
    tok = Tokenizer.from_str(tok_text)
    raw = Tokenizer.from_str(tok_text)
    raw.encode_special_tokens = True
    out = []
    for case in cases:
        t = case["text"]
        ids = tok.encode(t, add_special_tokens=True).ids
        out.append({**case,
                    "ids": ids,
                    "ids_plain": tok.encode(t, add_special_tokens=False).ids,
                    "ids_unparsed": raw.encode(t, add_special_tokens=True).ids,
                    "decoded": tok.decode(ids, skip_special_tokens=False),
                    "decoded_skip": tok.decode(ids, skip_special_tokens=True)})
    return {"tokenizer": tokenizer_field, "tokenizers_version": tokenizers.__version__,
            "vocab_size": tok.get_vocab_size(with_added_tokens=True), "cases": out}


def main():
    import sys
    corpus = (DATA / "corpus.txt").read_bytes().decode("utf-8")
    assert "\r" in corpus, "corpus.txt lost its CR LF lines"
    lines = corpus.split("\n")
    cases = [{"text": t} for t in lines] + [{"text": t, "extra": True} for t in EXTRA_CASES]
    cases.append({"text": corpus, "whole": True})

    if "--real" in sys.argv[1:]:
        for name, rel in REAL.items():
            ref = reference((ROOT / rel).read_text(encoding="utf-8"), "repo:" + rel, cases)
            (DATA / f"{name}.ref.json").write_text(compact(ref) + "\n", encoding="utf-8")
            print(f"{name}: {ref['vocab_size']} tokens, {len(cases)} cases")
        return

    for name, build in FIXTURES.items():
        j = build()
        text = compact(j)
        (DATA / f"{name}.json").write_text(text, encoding="utf-8")
        ref = reference(text, f"{name}.json", cases)
        (DATA / f"{name}.ref.json").write_text(compact(ref) + "\n", encoding="utf-8")
        print(f"{name}: {len(j['model']['vocab'])} tokens, {len(j['model']['merges'])} merges, {len(cases)} cases")

    samples = lines + EXTRA_CASES
    comps = []
    for kind, config in COMPONENTS:
        c = make_component(kind, config)
        if kind == "normalizer":
            outs = [c.normalize_str(s) for s in samples]
        else:
            outs = [[p for p, _ in c.pre_tokenize_str(s)] for s in samples]
        comps.append({"kind": kind, "config": config, "outputs": outs})
    (DATA / "components.ref.json").write_text(compact({"inputs": samples, "components": comps}) + "\n",
                                              encoding="utf-8")
    print(f"components: {len(comps)} x {len(samples)} inputs")


if __name__ == "__main__":
    main()
