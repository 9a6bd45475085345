#!/usr/bin/env python3
"""What agents ask of `kestrel serve`, on the real SmolLM2-135M-Instruct (CPU) with the official
`openai` client: 100 json_schema requests (five schemas, twenty prompts each, eight at a time),
every reply valid against its schema; tool_choice "required" and a named function on a model
whose template has no tool format of its own (the call constrained to the tools' schemas); and
the prefix cache: a ~2,000-token prompt's repeat gets its first token in at most 10% of the first
one's time, with the same text (prefix_cache_ttft.py).

Usage: test_agents_smollm2.py KESTREL_BINARY MODEL_PATH. Exits 77 (skipped) when the model or the
`openai` package is absent."""
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import prefix_cache_ttft
from serve_harness import NAME, arguments, check, finish, parsed, start_server, stop_server, valid

BIN, MODEL = arguments()
try:
    import openai
except ImportError:
    print("skipped: the openai package is not installed (scripts/install_deps.sh makes .venv)")
    sys.exit(77)


def obj(props, required=None):
    return {"type": "object", "properties": props, "required": required or list(props), "additionalProperties": False}


def text(n):
    return {"type": "string", "maxLength": n}


SCHEMAS = {
    "person": obj({"name": text(20), "age": {"type": "integer", "minimum": 0, "maximum": 120}, "city": text(20)}),
    "sentiment": obj({"label": {"enum": ["positive", "negative", "neutral"]},
                      "confidence": {"type": "integer", "minimum": 0, "maximum": 100}}),
    "shopping": obj({"items": {"type": "array", "items": text(15), "minItems": 1, "maxItems": 3}}),
    "event": obj({"title": text(24), "day": {"enum": ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]},
                  "attendees": {"type": "array", "items": obj({"name": text(10)}), "minItems": 1, "maxItems": 2},
                  "online": {"type": "boolean"}}),
    "answer": obj({"answer": text(40), "sources": {"type": "integer", "minimum": 0, "maximum": 9}}),
}
ASK = {
    "person": "Describe a person who lives in {}.",
    "sentiment": "What is the sentiment of this review: 'The {} was unforgettable.'",
    "shopping": "List what to buy for a dinner with {}.",
    "event": "Plan a meeting about {}.",
    "answer": "Answer briefly: what is {} known for?",
}
TOPICS = ["Paris", "Tokyo", "a lighthouse", "the harbour", "rain", "jazz", "a bakery", "Mars", "a garden", "chess",
          "winter", "the museum", "trains", "a violin", "the desert", "coffee", "bridges", "a library", "tea", "robots"]
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": obj({"city": text(12), "days": {"type": "integer", "minimum": 1, "maximum": 7}})}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The time in a zone", "parameters": obj({"zone": {"enum": ["UTC", "CET"]}})}},
]

proc, port = start_server(BIN, MODEL, "--device", "cpu", "--max-batch", "8")
client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)

try:
    def structured(job):
        name, topic = job
        rf = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}
        r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": ASK[name].format(topic)}],
                                           response_format=rf, temperature=0, max_tokens=300)
        c = r.choices[0]
        value = parsed(c.message.content)
        return name, topic, c.finish_reason, c.message.content, value is not None and valid(value, SCHEMAS[name])

    jobs = [(name, topic) for name in SCHEMAS for topic in TOPICS]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(structured, jobs))
    good = [r for r in results if r[2] == "stop" and r[4]]
    for name, topic, reason, content, ok in results:
        if not (reason == "stop" and ok):
            print(f"     {name} / {topic}: {reason}: {content!r}")
    print(f"     e.g. {results[0][1]!r}: {results[0][3]}; {results[40][1]!r}: {results[40][3]}")
    check(len(good) == len(jobs), f"json_schema: {len(good)} of {len(jobs)} replies valid against their schemas "
                                  f"({time.perf_counter() - t0:.0f} s)")

    # No tool format in SmolLM2's template: required and named calls take the Llama JSON form.
    user = [{"role": "user", "content": "What is the weather in Oslo for the next three days?"}]
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        t = client.chat.completions.create(model=NAME, messages=user, tools=TOOLS, tool_choice=choice,
                                           parallel_tool_calls=False, temperature=0, max_tokens=200)
        tc = t.choices[0]
        calls = tc.message.tool_calls or []
        check(tc.finish_reason == "tool_calls" and len(calls) == 1, f"tool_choice {choice}: one call")
        if calls:
            fn, args = calls[0].function.name, parsed(calls[0].function.arguments)
            check(fn in params and args is not None and valid(args, params[fn]),
                  f"tool_choice {choice}: {fn}({calls[0].function.arguments}) valid")
            if isinstance(choice, dict):
                check(fn == "get_time", "the named function is the one called")

    # The prefix cache: ~2,000 tokens of shared beginning.
    failed = prefix_cache_ttft.run(port, words=2000)  # SmolLM2: a token per word
    check(not failed, "prefix cache: the repeat's first token in at most 10% of the first's, the same text")
finally:
    check(stop_server(proc) == 0, "the server exits 0 on SIGTERM")
finish()
