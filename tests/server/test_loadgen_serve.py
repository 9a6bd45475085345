#!/usr/bin/env python3
"""`kestrel loadgen` against `kestrel serve` on the real model: 16 streaming requests from 4
streams with prompts of about 32 tokens and max_tokens 16, on /v1/completions and /v1/chat/completions; no errors, the token
counts the server reports in usage, every request in --json; a wrong API key fails every request
and the command exits 1. Standard library only.

Usage: test_loadgen_serve.py KESTREL_BINARY MODEL_PATH. Exits 77 (skipped) when the model is absent."""
import json
import os
import subprocess
import tempfile

from serve_harness import NAME, arguments, check, finish, start_server, stop_server

BIN, MODEL = arguments()
KEY = "sekrit"
server, port = start_server(BIN, MODEL, "--api-key", KEY, "--context", "512", "--max-batch", "8")


def loadgen(*args, requests=16):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    p = subprocess.run([BIN, "loadgen", "--url", f"http://127.0.0.1:{port}", "--streams", "4", "--requests", str(requests),
                        "--max-tokens", "16", "--prompt-tokens", "32", "--timeout", "120", "--json", path, *args],
                       capture_output=True, text=True, timeout=500)
    print(p.stdout + p.stderr, flush=True)
    with open(path) as f:
        result = json.load(f)
    os.unlink(path)
    return p.returncode, p.stdout + p.stderr, result


try:
    for mode in ([], ["--chat"]):
        what = "chat" if mode else "completions"
        rc, out, r = loadgen("--api-key", KEY, *mode)
        s = r["summary"]
        check(rc == 0, f"{what}: exit status 0 (got {rc})")
        check(s["ok"] == 16 and s["errors"] == 0, f"{what}: 16 ok, 0 errors (got {s['ok']}, {s['errors']})")
        check(r["model"] == NAME, f"{what}: the model id came from GET /v1/models")
        recs = r["records"]
        check(len(recs) == 16, f"{what}: 16 request records")
        check(all(q["usage_reported"] and 1 <= q["completion_tokens"] <= 16 for q in recs),
              f"{what}: completion tokens from usage, 1..16 each")
        check(all(q["finish_reason"] in ("length", "stop") for q in recs), f"{what}: every stream finished")
        # 32 synthetic tokens: the text counts a word or a period as one token, and SmolLM2's
        # tokenizer nearly agrees; the chat template adds its own tokens around the message.
        pt = [q["prompt_tokens"] for q in recs]
        if mode:
            check(all(32 < p <= 32 + 60 for p in pt), f"chat: prompt tokens 32 + the template's ({min(pt)}..{max(pt)})")
        else:
            check(all(30 <= p <= 34 for p in pt), f"completions: prompt tokens about 32 ({min(pt)}..{max(pt)})")
        check(s["ttft_ms"]["count"] == 16 and s["ttft_ms"]["p50"] > 0, f"{what}: a TTFT per request")
        check(s["itl_ms"]["count"] > 0 and s["itl_ms"]["p50"] > 0, f"{what}: ITL samples")
        check(s["output_tokens"] == sum(q["completion_tokens"] for q in recs), f"{what}: output tokens add up")
        check("TTFT (ms)" in out and "ITL distribution" in out, f"{what}: the table")

    rc, out, r = loadgen("--api-key", "wrong", "--model", NAME, requests=4)
    check(rc == 1, f"wrong key: exit status 1 (got {rc})")
    check(r["summary"]["errors"] == 4 and "HTTP 401" in out and "4 of 4 requests failed" in out,
          "wrong key: every request fails with HTTP 401, and the command says so")
finally:
    stop_server(server, timeout=60)

finish()
