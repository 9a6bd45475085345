#!/usr/bin/env python3
"""A bounded load test for any OpenAI-compatible server: N streaming completion requests from C
concurrent clients; reports errors, time to first token, inter-token latency and request time
(p50/p90/p99) and tokens/s. Standard library only.

Usage: load_test.py --url http://127.0.0.1:8000 --model NAME [--requests 200] [--concurrency 16]
                    [--max-tokens 4] [--prompt TEXT] [--api-key KEY]
Exits 1 when any request failed."""
import argparse
import http.client
import json
import threading
import time
import urllib.parse


def percentile(values, p):
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, int(round(p / 100 * (len(v) - 1))))]


def one_request(host, port, path_prefix, model, prompt, max_tokens, api_key):
    """Returns (ttft, [inter-token gaps], total seconds, tokens) or raises."""
    c = http.client.HTTPConnection(host, port, timeout=300)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "ignore_eos": True})
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    t0 = time.perf_counter()
    c.request("POST", path_prefix + "/v1/completions", body=body, headers=headers)
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:200]!r}")
    ttft, gaps, last, tokens = None, [], None, 0
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            raise RuntimeError(chunk["error"]["message"])
        if chunk["choices"] and chunk["choices"][0].get("finish_reason") is None:
            now = time.perf_counter()
            if ttft is None:
                ttft = now - t0
            else:
                gaps.append(now - last)
            last = now
            tokens += 1
    c.close()
    return ttft, gaps, time.perf_counter() - t0, tokens


def run(url, model, requests=200, concurrency=16, max_tokens=4, prompt="Hello, my name is", api_key=""):
    u = urllib.parse.urlparse(url)
    host, port, prefix = u.hostname, u.port or 80, u.path.rstrip("/")
    lock = threading.Lock()
    next_index = [0]
    ttfts, gaps, totals, errors, tokens = [], [], [], [], [0]

    def worker():
        while True:
            with lock:
                if next_index[0] >= requests:
                    return
                next_index[0] += 1
            try:
                ttft, g, total, n = one_request(host, port, prefix, model, prompt, max_tokens, api_key)
                with lock:
                    ttfts.append(ttft)
                    gaps.extend(g)
                    totals.append(total)
                    tokens[0] += n
            except Exception as e:  # noqa: BLE001 - every failure is counted and shown
                with lock:
                    errors.append(str(e))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    print(f"{requests} requests, {concurrency} concurrent, {max_tokens} tokens each: {len(errors)} errors, "
          f"{wall:.1f} s, {tokens[0] / wall:.1f} tokens/s, {len(totals) / wall:.2f} requests/s")
    print(f"{'':24s} {'p50':>9s} {'p90':>9s} {'p99':>9s}")
    for name, v in (("time to first token ms", ttfts), ("inter-token ms", gaps), ("request ms", totals)):
        print(f"{name:24s} " + " ".join(f"{percentile([x * 1e3 for x in v if x is not None], p):9.1f}"
                                         for p in (50, 90, 99)))
    for e in errors[:5]:
        print("error:", e)
    return {"errors": len(errors), "requests": len(totals), "wall_s": wall,
            "ttft_p99_ms": percentile(ttfts, 99) * 1e3, "request_p99_ms": percentile(totals, 99) * 1e3}


if __name__ == "__main__":
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--url", required=True)
    a.add_argument("--model", required=True)
    a.add_argument("--requests", type=int, default=200)
    a.add_argument("--concurrency", type=int, default=16)
    a.add_argument("--max-tokens", type=int, default=4)
    a.add_argument("--prompt", default="Hello, my name is")
    a.add_argument("--api-key", default="")
    o = a.parse_args()
    result = run(o.url, o.model, o.requests, o.concurrency, o.max_tokens, o.prompt, o.api_key)
    raise SystemExit(1 if result["errors"] else 0)
