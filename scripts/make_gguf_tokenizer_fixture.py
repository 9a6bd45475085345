#!/usr/bin/env python3
"""Reference token ids for the tokenizers kestrel builds from GGUF tokenizer.* metadata.

    python3 scripts/make_gguf_tokenizer_fixture.py                  # sentencepiece
    python3 scripts/make_gguf_tokenizer_fixture.py --only smollm2 [--hf HF_FOLDER] [--gguf GGUF]

sentencepiece: trains a small SentencePiece BPE model (1000 pieces, byte fallback, two control
and two user-defined symbols) on tests/text/data/tokenizers/train.txt, writes its vocabulary to
tests/text/data/gguf_spm.gguf the way llama.cpp's converter writes SentencePiece vocabularies
(tokenizer.ggml.model "llama": pieces, scores, token types, no merges, BOS/EOS/UNK ids,
add_bos_token, add_space_prefix), and records in gguf_spm.ref.json what Hugging Face gives for
every line of tests/text/data/tokenizers/corpus.txt, extra cases and the whole corpus:
  ids, ids_plain     transformers' tokenizer of the file (AutoTokenizer.from_pretrained(dir,
                     gguf_file=...)), with and without BOS
  decoded, decoded_skip  its decoding of ids, with and without special tokens
  ids_phi3           the same vocabulary under general.architecture "phi3", which transformers
                     gives a normalizer instead of the Metaspace pre-tokenizer
  ids_no_prefix      transformers' tokenizer with the Metaspace prefix off (prepend_scheme
                     "never", no Strip decoder), as a tokenizer.json of a model whose
                     add_space_prefix is false has it (transformers' GGUF loader ignores the key)
  sentencepiece_ids  the sentencepiece library's own ids, for information (not tested: BPE
                     ties and a leading space run come out differently)

smollm2: tests/text/data/gguf_smollm2.ref.json, the ids Hugging Face gives for a dozen strings
with SmolLM2-135M-Instruct's tokenizer: the tokenizer.json of the Hugging Face folder converted
from the same GGUF (Digits(individual) + ByteLevel pre-tokenizer, as the model's own
tokenizer.json has it), run with the `tokenizers` library. The ids of transformers' own GGUF
loader are recorded next to them; it has no "smollm" pre-tokenizer rule and so can differ on
digits.

Needs gguf (gguf-py 0.19), sentencepiece, tokenizers and transformers 5.x.
"""
import argparse
import io
import json
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "text" / "data"

SMOLLM2_CASES = [
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

SPM_EXTRA_CASES = [
    "<s>Hello</s>",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\nanswer",
    "text<|im_end|> after a control token",
    "<unk> and <s> in plain text",
    "   three leading spaces",
    "trailing   ",
    "   ",
    " ",
    "a  b   c    d",
    "line one\nline two\r\n\n\nafter three newlines\n",
    "\n",
    "\t\ttabs",
    "中文分词测试 日本語 한국어",
    "emoji 🙂🚀👍🏽 and ZWJ 👨‍👩‍👧",
    "naïve café déjà vu Ångström",
    "x",
    "",
]


def smollm2(hf: pathlib.Path, gguf_path: pathlib.Path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(hf / "tokenizer.json"))
    cases = [{"text": t, "ids": tok.encode(t).ids} for t in SMOLLM2_CASES]
    try:
        from transformers import AutoTokenizer
        hf_tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        for c in cases:
            c["transformers_gguf_ids"] = hf_tok(c["text"])["input_ids"]
    except Exception as e:  # transformers is optional
        print(f"transformers GGUF loader not run: {e}", file=sys.stderr)
    out = DATA / "gguf_smollm2.ref.json"
    out.write_text(json.dumps({"model": gguf_path.name, "reference": str(hf.name) + "/tokenizer.json", "cases": cases},
                              ensure_ascii=False, indent=1) + "\n")
    differ = [c["text"] for c in cases if "transformers_gguf_ids" in c and c["transformers_gguf_ids"] != c["ids"]]
    print(f"wrote {out} ({len(cases)} cases; transformers' GGUF loader differs on {len(differ)}: {differ})")


def train_sentencepiece() -> bytes:
    import sentencepiece as spm

    lines = (DATA / "tokenizers" / "train.txt").read_text(encoding="utf-8").splitlines()
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, model_type="bpe", vocab_size=1000, byte_fallback=True,
        character_coverage=0.9995, split_digits=True, allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False, normalization_rule_name="identity", num_threads=1,
        control_symbols=["<|im_start|>", "<|im_end|>"], user_defined_symbols=["<think>", "</think>"],
        minloglevel=2)
    return model.getvalue()


def write_spm_gguf(path: pathlib.Path, proto: bytes, arch: str):
    """The vocabulary as llama.cpp's converter writes a SentencePiece model."""
    import gguf
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=proto)
    T = gguf.TokenType
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        t = T.NORMAL
        if sp.is_unknown(i):
            t = T.UNKNOWN
        elif sp.is_control(i):
            t = T.CONTROL
        elif sp.is_unused(i):
            t = T.UNUSED
        elif sp.is_byte(i):
            t = T.BYTE
        elif tokens[-1] in ("<think>", "</think>"):
            t = T.USER_DEFINED
        types.append(t)
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def sentencepiece():
    import sentencepiece as spm
    import tokenizers
    import transformers
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from transformers import AutoTokenizer

    proto = train_sentencepiece()
    sp = spm.SentencePieceProcessor(model_proto=proto)
    gguf_path = DATA / "gguf_spm.gguf"
    write_spm_gguf(gguf_path, proto, "llama")
    tok = AutoTokenizer.from_pretrained(str(DATA), gguf_file=gguf_path.name)
    with tempfile.TemporaryDirectory() as tmp:
        write_spm_gguf(pathlib.Path(tmp) / "phi3.gguf", proto, "phi3")
        phi3 = AutoTokenizer.from_pretrained(tmp, gguf_file="phi3.gguf")
    no_prefix = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    no_prefix.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never", split=False)
    no_prefix.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])

    corpus = (DATA / "tokenizers" / "corpus.txt").read_bytes().decode("utf-8")
    assert "\r" in corpus, "corpus.txt lost its CR LF lines"
    texts = corpus.split("\n") + SPM_EXTRA_CASES + [corpus]
    cases = []
    for text in texts:
        ids = tok(text)["input_ids"]
        cases.append({
            "text": text,
            "ids": ids,
            "ids_plain": tok(text, add_special_tokens=False)["input_ids"],
            "decoded": tok.decode(ids),
            "decoded_skip": tok.decode(ids, skip_special_tokens=True),
            "ids_phi3": phi3(text)["input_ids"],
            "ids_no_prefix": no_prefix.encode(text).ids,
            "decoded_no_prefix": no_prefix.decode(no_prefix.encode(text).ids, skip_special_tokens=False),
            "sentencepiece_ids": [sp.bos_id()] + sp.encode(text),
        })
    out = DATA / "gguf_spm.ref.json"
    ref = {
        "gguf": gguf_path.name,
        "vocab_size": sp.get_piece_size(),
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "sentencepiece": spm.__version__,
        "cases": cases,
    }
    head = json.dumps({k: v for k, v in ref.items() if k != "cases"}, ensure_ascii=False)[:-1]
    lines = ",\n".join(json.dumps(c, ensure_ascii=False, separators=(",", ":")) for c in cases)
    out.write_text(f'{head}, "cases": [\n{lines}\n]}}\n')
    differ = sum(c["sentencepiece_ids"] != c["ids"] for c in cases)
    print(f"wrote {gguf_path.relative_to(ROOT)} ({gguf_path.stat().st_size} bytes) and {out.relative_to(ROOT)} "
          f"({len(cases)} cases; the sentencepiece library differs from transformers on {differ})")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["sentencepiece", "smollm2"], default="sentencepiece")
    ap.add_argument("--hf", type=pathlib.Path, default=pathlib.Path("/tmp/realmodel/SmolLM2-135M-Instruct-from-Q4_1"),
                    help="SmolLM2 Hugging Face folder converted from the GGUF (for --only smollm2)")
    ap.add_argument("--gguf", type=pathlib.Path,
                    default=ROOT / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    a = ap.parse_args()
    if a.only == "smollm2":
        smollm2(a.hf, a.gguf)
    else:
        sentencepiece()


if __name__ == "__main__":
    main()
