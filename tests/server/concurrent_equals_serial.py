#!/usr/bin/env python3
"""`kestrel serve` on one model under concurrent greedy requests: N distinct prompts sent by C
clients at once (completions and chat, streamed and not), then the same requests one at a time;
every reply must be equal (text, finish reason, token counts), no request may fail, and the
server must answer /health afterwards and stop cleanly on SIGTERM. Standard library only.

Usage: concurrent_equals_serial.py KESTREL_BINARY MODEL_PATH [--streams 48] [--requests 48]
                                   [--max-tokens 24] [serve arguments after --]
Exits 1 when a check failed (77 when the model is absent)."""
import argparse
import http.client
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_harness as h  # noqa: E402


def request(port, i, max_tokens):
    """Request i (a different prompt per i; even i completions, odd i chat; every third streamed):
    (text, finish_reason, prompt_tokens, completion_tokens)."""
    words = " ".join(f"w{(i * 7 + k) % 97}" for k in range(3 + i % 11))
    chat = i % 2 == 1
    stream = i % 3 == 0
    body = {"model": h.NAME, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if chat:
        body["messages"] = [{"role": "user", "content": f"request {i}: {words}"}]
    else:
        body["prompt"] = f"request {i}: {words}"
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    c.request("POST", "/v1/chat/completions" if chat else "/v1/completions", body=json.dumps(body),
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"request {i}: HTTP {r.status}: {r.read()[:200]!r}")
    if not stream:
        j = json.loads(r.read())
        ch = j["choices"][0]
        text = ch["message"]["content"] if chat else ch["text"]
        return text, ch["finish_reason"], j["usage"]["prompt_tokens"], j["usage"]["completion_tokens"]
    text, finish, usage = "", None, None
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        j = json.loads(line[6:])
        if j.get("usage"):
            usage = j["usage"]
        for ch in j.get("choices", []):
            piece = ch.get("delta", {}).get("content") if chat else ch.get("text")
            text += piece or ""
            finish = ch.get("finish_reason") or finish
    if usage is None:
        raise RuntimeError(f"request {i}: the stream ended without usage")
    return text, finish, usage["prompt_tokens"], usage["completion_tokens"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binary")
    ap.add_argument("model")
    ap.add_argument("--streams", type=int, default=48)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=24)
    argv = sys.argv[1:]
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    a = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if not os.path.exists(a.model):
        print(f"skipped: {a.model} is absent")
        sys.exit(77)
    p, port = h.start_server(a.binary, a.model, *serve_args)
    try:
        ids = list(range(a.requests))
        errors = []

        def safe(i):
            try:
                return request(port, i, a.max_tokens)
            except Exception as e:  # counted, and the run goes on
                errors.append(str(e))
                return None

        with ThreadPoolExecutor(a.streams) as pool:
            together = list(pool.map(safe, ids))
        h.check(not errors, f"{a.requests} requests from {a.streams} concurrent clients: {len(errors)} failed"
                + (f" ({errors[0]})" if errors else ""))
        alone = [safe(i) for i in ids]
        h.check(not errors, f"the same requests one at a time: {len(errors)} failed")
        differ = [i for i in ids if together[i] != alone[i]]
        for i in differ[:3]:
            print(f"     request {i}: together {together[i]!r}\n                 alone    {alone[i]!r}")
        h.check(not differ, f"replies equal concurrent and one at a time: {len(ids) - len(differ)} of {len(ids)}")
        # Not vacuous: random-weight models may end some replies at once, not all of them.
        tokens = sum(r[3] for r in alone if r)
        h.check(tokens >= len(ids), f"the replies hold {tokens} tokens ({sum(1 for r in alone if r and r[3])} of {len(ids)} not empty)")
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        c.request("GET", "/health")
        h.check(c.getresponse().status == 200, "healthy afterwards")
    finally:
        rc = h.stop_server(p)
    h.check(rc == 0, f"stopped on SIGTERM with status 0 (got {rc})")
    h.finish()


if __name__ == "__main__":
    main()
