#!/usr/bin/env python3
"""`kestrel serve` against the official `openai` client: completions and chat, streaming and not,
stop sequences, usage, log-probabilities, errors, n choices (streaming and not, greedy and seeded,
usage over all, the limits on n), 32 concurrent streams that must each get what they get alone, a
slow reader that stops reading while others are served, a client that disconnects mid-stream,
memory that returns to its level, a load test of 200 requests from 16 clients (load_test.py),
schemathesis against /openapi.json, SIGTERM.

Usage: test_openai_server.py KESTREL_BINARY MODEL_PATH. Exits 77 (skipped) when the model or the
`openai` package is absent."""
import http.client
import json
import os
import re
import socket
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


def refusal(path, body, on_port=None):
    """(status, param, message) of a request the server should refuse."""
    c = http.client.HTTPConnection("127.0.0.1", on_port or port, timeout=60)
    c.request("POST", path, body=json.dumps(body), headers={"Authorization": f"Bearer {KEY}"})
    r = c.getresponse()
    data = json.loads(r.read() or b"{}")
    c.close()
    err = data.get("error") or {}
    return r.status, err.get("param"), err.get("message", "")


def by_choice(chunks, chat):
    """A stream of chunks per choice index: texts, finish reasons (a list each) and, for chat, the
    role of each choice's first chunk."""
    texts, finishes, roles = {}, {}, {}
    for ch in chunks:
        for x in ch.choices:
            texts[x.index] = texts.get(x.index, "") + ((x.delta.content or "") if chat else x.text)
            if chat and x.index not in roles:
                roles[x.index] = x.delta.role
            if x.finish_reason:
                finishes.setdefault(x.index, []).append(x.finish_reason)
    return texts, finishes, roles


def open_raw_stream(body, rcvbuf=None):
    """A streaming POST /v1/completions on a plain socket that this test reads when it wants to,
    with a receive buffer of `rcvbuf` bytes (on loopback the server's send buffer may still take
    all of the stream: the engine must go on either way)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(120)
    s.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode() +
              b"\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: " +
              str(len(data)).encode() + b"\r\n\r\n" + data)
    return s


def read_at_least(s, n):
    out = b""
    while len(out) < n:
        b = s.recv(n - len(out))
        if not b:
            break
        out += b
    return out


def read_to_end(s):
    out = b""
    while True:
        b = s.recv(65536)
        if not b:
            return out
        out += b


def sse_data(response):
    """The `data:` payloads of a raw HTTP/1.1 response with chunked transfer encoding."""
    _, _, body = response.partition(b"\r\n\r\n")
    data = b""
    while body:
        size_line, _, rest = body.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        data += rest[:size]
        body = rest[size + 2:]
    return [line[6:].decode() for line in data.split(b"\n") if line.startswith(b"data: ")]


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

    # n choices: each its own sequence of the prompt.
    prompt = "The capital of France is"
    c3 = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0, n=3)
    check([x.index for x in c3.choices] == [0, 1, 2], "n = 3: three choices, indices 0, 1, 2")
    check(all(x.text == text and x.finish_reason == "length" for x in c3.choices),
          "n = 3, greedy: every choice is the n = 1 text")
    check(c3.usage.prompt_tokens == c.usage.prompt_tokens and c3.usage.completion_tokens == 24 and
          c3.usage.total_tokens == c.usage.prompt_tokens + 24,
          f"n = 3: usage counts the prompt once and the tokens of every choice ({c3.usage})")
    chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0, n=2, stream=True,
                                            stream_options={"include_usage": True}))
    texts, finishes, _ = by_choice(chunks, chat=False)
    check(texts == {0: text, 1: text}, "n = 2 streamed: both choices are the n = 1 text")
    check(finishes == {0: ["length"], 1: ["length"]}, f"n = 2 streamed: one finish_reason per choice ({finishes})")
    check(chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16 and not chunks[-1].choices and
          all(ch.usage is None for ch in chunks[:-1]), "n = 2 streamed: the last chunk carries the usage of both")

    r2 = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=12, temperature=0, n=2)
    check([x.index for x in r2.choices] == [0, 1] and all(x.message.content == answer for x in r2.choices) and
          r2.usage.completion_tokens == 2 * r.usage.completion_tokens, "chat n = 2: both choices are the n = 1 answer")
    chunks = list(client.chat.completions.create(model=NAME, messages=msgs, max_tokens=12, temperature=0, n=3,
                                                 stream=True, stream_options={"include_usage": True}))
    texts, finishes, roles = by_choice(chunks, chat=True)
    check(texts == {0: answer, 1: answer, 2: answer}, "chat n = 3 streamed: every choice is the n = 1 answer")
    check(roles == {0: "assistant", 1: "assistant", 2: "assistant"} and
          all(len(f) == 1 for f in finishes.values()) and sorted(finishes) == [0, 1, 2],
          "chat n = 3 streamed: each choice starts with the role and has one finish_reason")
    check(chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3 * r.usage.completion_tokens,
          "chat n = 3 streamed: the usage chunk counts all three")

    # Sampled choices with a seed: each its own seed derived from it, so they differ, and the
    # request is reproducible (choice 0 keeps the seed: it is the n = 1 result).
    seeded = dict(model=NAME, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=1234)
    a = [x.text for x in client.completions.create(n=3, **seeded).choices]
    b = [x.text for x in client.completions.create(n=3, **seeded).choices]
    check(a == b, "seeded n = 3: the same choices twice")
    check(len(set(a)) > 1, f"seeded n = 3: sampled choices differ {a}")
    check(client.completions.create(n=1, **seeded).choices[0].text == a[0],
          "seeded n = 3: choice 0 is the n = 1 result with that seed")
    texts, _, _ = by_choice(client.completions.create(n=3, stream=True, **seeded), chat=False)
    check(texts == dict(enumerate(a)), "seeded n = 3 streamed: the same choices")
    # Without a seed the server draws one per request: sampled requests differ from call to call.
    unseeded = {k: v for k, v in seeded.items() if k != "seed"}
    runs = {client.completions.create(**unseeded).choices[0].text for _ in range(3)}
    check(len(runs) > 1, f"unseeded sampled requests differ from call to call {sorted(runs)}")

    # Log-probabilities per choice: greedy choices carry the n = 1 values, sampled ones their own.
    lp2 = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=4, temperature=0, logprobs=True,
                                         top_logprobs=2, n=2)
    same = all(len(x.logprobs.content) == 4 and
               all(t.token == u.token and abs(t.logprob - u.logprob) < 1e-4 for t, u in zip(x.logprobs.content, content))
               for x in lp2.choices)
    check(len(lp2.choices) == 2 and same, "chat n = 2 log-probabilities: each choice has the n = 1 values")
    sampled = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=5,
                                        n=2, logprobs=1, extra_body={"ignore_eos": True})
    check(all(len(x.logprobs.tokens) == 6 and len(x.logprobs.token_logprobs) == 6 and
              all(v <= 0 for v in x.logprobs.token_logprobs) and
              (not x.text.isascii() or "".join(x.logprobs.tokens) == x.text) for x in sampled.choices),
          "completions n = 2 sampled: each choice's log-probabilities are of its own tokens")
    chunks = list(client.chat.completions.create(model=NAME, messages=msgs, max_tokens=5, temperature=1.0, seed=5,
                                                 n=2, logprobs=True, stream=True, extra_body={"ignore_eos": True}))
    per_choice = {}
    for ch in chunks:
        for x in ch.choices:
            if x.logprobs and x.logprobs.content:
                per_choice.setdefault(x.index, []).extend(x.logprobs.content)
    texts, _, _ = by_choice(chunks, chat=True)
    check(sorted(per_choice) == [0, 1] and all(len(v) == 5 for v in per_choice.values()) and
          all("".join(t.token for t in per_choice[i]) == texts[i] for i in (0, 1) if texts[i].isascii()),
          "chat n = 2 streamed: log-probabilities arrive with their choice")

    status, param, message = refusal("/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 1, "n": 17})
    check(status == 400 and param == "n" and "'n'" in message, f"n = 17: 400 naming n ({message})")
    status, param, message = refusal("/v1/chat/completions", {"model": NAME, "messages": msgs, "n": 0})
    check(status == 400 and param == "n", f"chat n = 0: 400 naming n ({message})")
    _, spec = raw("GET", "/openapi.json")
    n_schema = json.loads(spec)["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]
    check(n_schema["schema"]["properties"]["n"]["maximum"] == 16, "/openapi.json: n up to 16")

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

    # Slow readers: a client that stops reading does not hold up the others, gets everything when
    # it reads again, and frees all its sequences when it goes away instead.
    def serve_others():
        """A plain completion and a streamed chat from other clients, in parallel: (ok, seconds)."""
        got = {}

        def plain():
            got["plain"] = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0).choices[0].text

        def streamed():
            got["chat"] = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
                model=NAME, messages=msgs, max_tokens=12, temperature=0, stream=True) if ch.choices)

        t0 = time.time()
        threads = [threading.Thread(target=f) for f in (plain, streamed)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        return got == {"plain": text, "chat": answer}, time.time() - t0

    story = dict(model=NAME, prompt="Once upon a time", temperature=0, extra_body={"ignore_eos": True})
    want = client.completions.create(max_tokens=40, **story).choices[0].text
    s = open_raw_stream({"model": NAME, "prompt": "Once upon a time", "max_tokens": 40, "temperature": 0, "n": 2,
                         "ignore_eos": True, "stream": True})
    head = read_at_least(s, 12)  # the response has begun; then nothing is read for a while
    ok, took = serve_others()
    check(head.startswith(b"HTTP/1.1 200") and ok, f"while a client does not read, others are served ({took:.1f} s)")
    events = sse_data(head + read_to_end(s))
    s.close()
    done = [json.loads(e) for e in events if e != "[DONE]"]
    resumed = {}
    for ch in done:
        for x in ch["choices"]:
            resumed[x["index"]] = resumed.get(x["index"], "") + x["text"]
    check(events[-1:] == ["[DONE]"] and resumed == {0: want, 1: want},
          "the slow reader gets both choices whole when it reads again")

    before = metric("kestrel_generation_tokens_total")
    s = open_raw_stream({"model": NAME, "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "n": 3,
                         "ignore_eos": True, "stream": True, "logprobs": 5}, rcvbuf=4096)
    read_at_least(s, 12)
    ok, took = serve_others()
    check(ok, f"while a client with a full receive buffer does not read, others are served ({took:.1f} s)")
    # (the others' sequences leave the running set just after their last token)
    for _ in range(20):
        running = metric("kestrel_requests_running")
        if running in (0, 3):
            break
        time.sleep(0.05)
    check(running in (0, 3), f"the slow reader's three sequences run (or were dropped) together ({running:.0f})")
    s.close()  # goes away without reading the rest
    t0 = time.time()
    while time.time() - t0 < 30 and metric("kestrel_requests_running") != 0:
        time.sleep(0.1)
    others = 8 + r.usage.completion_tokens  # what serve_others generated
    slow = metric("kestrel_generation_tokens_total") - before - others
    check(metric("kestrel_requests_running") == 0 and metric("kestrel_kv_positions_used") == 0 and slow < 3 * 200,
          f"the slow reader that goes away frees its three sequences ({time.time() - t0:.1f} s, {slow:.0f} of 600 tokens made)")
    check(client.completions.create(model=NAME, prompt="Hi", max_tokens=2, temperature=0).usage.completion_tokens == 2,
          "the server serves after the slow reader left")

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
    # A second server with a short context, a small batch and a small KV cache: the limits on n,
    # then schemathesis against its OpenAPI description (generated requests stay quick there): no
    # 5xx, only documented status codes.
    small, small_port = start_server(BIN, MODEL, "--context", "48", "--max-batch", "4", "--kv-tokens", "128")
    try:
        few = {"model": NAME, "prompt": "Once upon a time", "max_tokens": 40}
        status, param, message = refusal("/v1/completions", {**few, "n": 5}, small_port)
        check(status == 400 and param == "n" and "--max-batch" in message,
              f"n above --max-batch: 400 naming n ({message})")
        status, param, message = refusal("/v1/completions", {**few, "n": 3}, small_port)
        check(status == 400 and param == "n" and "KV" in message,
              f"n sequences that never fit the KV cache together: 400 naming n ({message})")
        two = openai.OpenAI(base_url=f"http://127.0.0.1:{small_port}/v1", api_key=KEY, max_retries=0,
                            timeout=120).completions.create(n=2, **few)
        check(len(two.choices) == 2, "n sequences that fit the KV cache together run")
        c = http.client.HTTPConnection("127.0.0.1", small_port, timeout=60)
        c.request("GET", "/openapi.json")
        spec = json.loads(c.getresponse().read())
        c.close()
        check(spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
              ["properties"]["n"]["maximum"] == 4, "/openapi.json: n up to --max-batch 4")

        st = os.path.join(os.path.dirname(sys.executable), "schemathesis")
        if os.path.exists(st):
            r = subprocess.run([st, "run", f"http://127.0.0.1:{small_port}/openapi.json", "--checks",
                                "not_a_server_error,status_code_conformance", "-n", "15"],
                               capture_output=True, text=True, timeout=600)
            summary = [l for l in r.stdout.splitlines() if "generated" in l or "issues" in l or "passed" in l]
            check(r.returncode == 0, "schemathesis: " + " / ".join(x.strip(" =") for x in summary[-2:]))
            if r.returncode != 0:
                print(r.stdout[-3000:])
        else:
            print("skip schemathesis: not installed next to", sys.executable)
    finally:
        stop_server(small)
finally:
    rc = stop_server(proc)
    check(rc == 0, f"SIGTERM: exit status {rc}")

finish()
