#!/usr/bin/env python3
"""`kestrel serve` against the official `openai` client: completions and chat, streaming and not,
stop sequences, usage, log-probabilities, errors, 32 concurrent streams that must each get what
they get alone, a client that disconnects mid-stream, memory that returns to its level, a load
test of 200 requests from 16 clients (load_test.py), schemathesis against /openapi.json, SIGTERM.

Usage: test_openai_server.py KESTREL_BINARY MODEL_PATH. Exits 77 (skipped) when the model or the
`openai` package is absent."""
import http.client
import json
import os
import re
import subprocess
import sys
import threading
import time

from serve_harness import NAME, arguments, check, finish, start_server, stop_server

try:
    import openai
except ImportError:
    print("skipped: the openai package is not installed (scripts/install_deps.sh makes .venv)")
    sys.exit(77)

BIN, MODEL = arguments()
KEY = "sekrit"

proc, port = start_server(BIN, MODEL, "--context", "256", "--max-batch", "32", "--api-key", KEY, "--grace", "5")
client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=120)


def raw(method, path, body=None, headers=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request(method, path, body=body, headers={"Authorization": f"Bearer {KEY}", **(headers or {})})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, data


def metric(name):
    _, text = raw("GET", "/metrics")
    m = re.search(rf"^{name} (\S+)$", text.decode(), re.M)
    return float(m.group(1)) if m else None


def rss_kb():
    with open(f"/proc/{proc.pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))


try:
    check([m.id for m in client.models.list().data] == [NAME], "GET /v1/models lists the served model")

    c = client.completions.create(model=NAME, prompt="The capital of France is", max_tokens=8, temperature=0)
    text = c.choices[0].text
    check(len(text) > 0 and c.choices[0].finish_reason == "length", f"completion: {text!r}, finish length")
    check(c.usage.completion_tokens == 8 and c.usage.prompt_tokens > 0 and
          c.usage.total_tokens == c.usage.prompt_tokens + 8, "completion usage")
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model=NAME, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True) if ch.choices)
    check(streamed == text, "streamed completion equals the plain one")

    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=12, temperature=0)
    answer = r.choices[0].message.content
    check(r.choices[0].message.role == "assistant" and len(answer) > 0, f"chat: {answer!r}")
    chunks = list(client.chat.completions.create(model=NAME, messages=msgs, max_tokens=12, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    check("".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == answer,
          "streamed chat equals the plain one")
    check(chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == r.usage.completion_tokens,
          "the last streamed chunk carries usage")

    words = answer.split()
    if len(words) >= 3:
        stop = " " + words[2]
        s = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=12, temperature=0, stop=[stop])
        check(s.choices[0].finish_reason == "stop" and s.choices[0].message.content == answer[:answer.index(stop)],
              f"stop sequence {stop!r} cuts the answer there")

    lp = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=4, temperature=0, logprobs=True,
                                        top_logprobs=2)
    content = lp.choices[0].logprobs.content
    check(len(content) == 4 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content) and
          abs(content[0].logprob - content[0].top_logprobs[0].logprob) < 1e-4, "chat log-probabilities (greedy = best)")

    def expect_error(status, fn, what):
        try:
            fn()
            check(False, f"{what}: accepted")
        except openai.APIStatusError as e:
            check(e.status_code == status, f"{what}: HTTP {e.status_code}")

    bad_key = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0)
    expect_error(401, lambda: bad_key.models.list(), "wrong API key")
    expect_error(404, lambda: client.completions.create(model="nope", prompt="x", max_tokens=1), "unknown model")
    expect_error(400, lambda: client.completions.create(model=NAME, prompt="x", max_tokens=-1), "negative max_tokens")
    expect_error(400, lambda: client.completions.create(model=NAME, prompt="x", max_tokens=10**9), "huge max_tokens")
    expect_error(400, lambda: client.completions.create(model=NAME, prompt="word " * 400, max_tokens=1),
                 "prompt longer than the context")
    expect_error(400, lambda: client.chat.completions.create(model=NAME, messages=[], max_tokens=1), "no messages")
    status, body = raw("POST", "/v1/chat/completions", body=b"{not json", headers={"Content-Type": "application/json"})
    check(status == 400 and json.loads(body)["error"]["type"] == "invalid_request_error", "invalid JSON: 400")
    status, _ = raw("POST", "/v1/completions", body=json.dumps({"model": NAME, "prompt": 5}))
    check(status == 400, "wrong prompt type: 400")

    # 32 concurrent streams, each against its result alone.
    prompts = [f"Write one sentence about the number {i}." for i in range(32)]
    alone = [client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": p}], max_tokens=6,
                                            temperature=0).choices[0].message.content for p in prompts]

    def run_concurrently():
        got = [None] * len(prompts)

        def one(i):
            s = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": prompts[i]}],
                                               max_tokens=6, temperature=0, stream=True)
            got[i] = "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return got

    t0 = time.time()
    got = run_concurrently()
    check(got == alone, f"32 concurrent streams equal their results alone ({time.time() - t0:.1f} s)")
    rss_after_first = rss_kb()
    got = run_concurrently()
    check(got == alone, "a second round of 32 streams too")
    growth = rss_kb() - rss_after_first
    check(growth < 20_000, f"memory after a second round of 32 streams: {growth:+d} kB")

    # A client that goes away mid-stream: its sequence is freed and the server keeps serving.
    c2 = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c2.request("POST", "/v1/completions", body=json.dumps({"model": NAME, "prompt": "Once upon a time",
                                                           "max_tokens": 200, "stream": True, "temperature": 0}),
               headers={"Authorization": f"Bearer {KEY}"})
    resp = c2.getresponse()
    resp.fp.readline()
    c2.sock.close()
    c2.close()
    for _ in range(100):
        if metric("kestrel_kv_positions_used") == 0:
            break
        time.sleep(0.1)
    check(metric("kestrel_kv_positions_used") == 0, "a client that disconnects frees its KV positions")
    check(client.completions.create(model=NAME, prompt="Hi", max_tokens=2, temperature=0).usage.completion_tokens == 2,
          "the server serves after the disconnect")
    check((metric("kestrel_generation_tokens_total") or 0) > 300, "metrics count generated tokens")

    # A bounded load test: 200 requests from 16 concurrent clients, no errors.
    import load_test
    result = load_test.run(f"http://127.0.0.1:{port}", NAME, requests=200, concurrency=16, max_tokens=4, api_key=KEY)
    check(result["errors"] == 0 and result["requests"] == 200, "load test: 200 requests, 16 concurrent, no errors")
    # schemathesis against the server's OpenAPI description, on a second server with a short
    # context so that generated requests stay quick: no 5xx, only documented status codes.
    st = os.path.join(os.path.dirname(sys.executable), "schemathesis")
    if os.path.exists(st):
        small, small_port = start_server(BIN, MODEL, "--context", "48")
        try:
            r = subprocess.run([st, "run", f"http://127.0.0.1:{small_port}/openapi.json", "--checks",
                                "not_a_server_error,status_code_conformance", "-n", "15"],
                               capture_output=True, text=True, timeout=600)
            summary = [l for l in r.stdout.splitlines() if "generated" in l or "issues" in l or "passed" in l]
            check(r.returncode == 0, "schemathesis: " + " / ".join(x.strip(" =") for x in summary[-2:]))
            if r.returncode != 0:
                print(r.stdout[-3000:])
        finally:
            stop_server(small)
    else:
        print("skip schemathesis: not installed next to", sys.executable)
finally:
    rc = stop_server(proc)
    check(rc == 0, f"SIGTERM: exit status {rc}")

finish()
