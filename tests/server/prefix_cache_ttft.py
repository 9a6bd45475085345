#!/usr/bin/env python3
"""The prefix cache as a client sees it: a ~2,000-token prompt sent twice (greedy, 8 tokens), for
three different endings of the same beginning; prints each request's time to first token, the
repeat's share of the first's and the server's cached_tokens. Exits 1 when a repeat's text
differs, or (unless --no-cache-expected) the first repeat takes more than 10% of the cold
request's time to first token (the later pairs find the shared beginning cached already).
`--words N`: the beginning's length in words (default 340, ~2,000 byte tokens). Standard
library only; `run` is what other scripts call.

Usage: prefix_cache_ttft.py PORT [--no-cache-expected] [--words N]"""
import http.client
import json
import random
import sys
import time

WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "green", "seven", "north", "quiet", "lamp"]


def ask(port, model, prompt, n=8):
    """(time to first token, text, usage) of one streamed greedy completion."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise SystemExit(f"HTTP {r.status}: {r.read()[:300]}")
    ttft, text, usage = None, "", None
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        j = json.loads(line[6:])
        if j.get("usage"):
            usage = j["usage"]
        for ch in j.get("choices", []):
            if ch.get("text"):
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text += ch["text"]
    return ttft, text, usage


def run(port, words=340, cache=True):
    """Prints the three pairs; returns the suffixes whose check failed."""
    rng = random.Random(1)
    prefix = " ".join(rng.choice(WORDS) for _ in range(words))
    c0 = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c0.request("GET", "/v1/models")
    model = json.loads(c0.getresponse().read())["data"][0]["id"]
    failed = []
    for q in ["one", "two", "three"]:
        t1, a, u1 = ask(port, model, prefix + " question " + q)
        t2, b, u2 = ask(port, model, prefix + " question " + q)
        if a != b or (cache and q == "one" and t2 > 0.1 * t1):
            failed.append(q)
        print(f"suffix {q}: prompt {u1['prompt_tokens']} tokens; TTFT first {t1*1e3:.1f} ms, repeat {t2*1e3:.1f} ms "
              f"({100*t2/t1:.1f}%), cached {(u2.get('prompt_tokens_details') or {}).get('cached_tokens')}, "
              f"same text {a == b}", flush=True)
    return failed


if __name__ == "__main__":
    args = sys.argv[1:]
    words = int(args[args.index("--words") + 1]) if "--words" in args else 340
    failed = run(int(args[0]), words, "--no-cache-expected" not in args)
    if failed:
        print("FAIL: " + ", ".join(failed))
        sys.exit(1)
