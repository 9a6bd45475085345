#!/usr/bin/env python3
"""Structured outputs through `kestrel serve` with the official `openai` client, on the qwen3-chat
fixture (Qwen3's template over a tiny random model, whose unconstrained text is noise): a reply
that parses as JSON and validates against its schema is the grammar's doing. response_format
json_object and json_schema (nested objects, arrays, enums, required fields) whole and streamed,
greedy replies that repeat, tool_choice "required" and a named function (arguments valid against
the tool's parameters), and 400s for bad schemas.

Usage: test_structured_outputs_server.py KESTREL_BINARY MODEL_DIR. Exits 77 (skipped) when the
`openai` package is absent; validates with `jsonschema` when it is installed, by hand otherwise."""
import sys
import time

import serve_harness
from serve_harness import arguments, check, finish, parsed, start_server, stop_server, valid

try:
    import openai
except ImportError:
    print("skipped: the openai package is not installed (scripts/install_deps.sh makes .venv)")
    sys.exit(77)
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 12},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "genre": {"enum": ["drama", "comedy", "horror"]},
        "cast": {"type": "array", "items": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
                                            "required": ["name"], "additionalProperties": False},
                 "minItems": 1, "maxItems": 2},
        "studio": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "open": {"type": "boolean"}},
                   "required": ["city", "open"], "additionalProperties": False},
    },
    "required": ["title", "rating", "genre", "cast", "studio"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                       "required": ["city", "days"]}}},
    {"type": "function", "function": {
        "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                           "required": ["zone"]}}},
]
USER = [{"role": "user", "content": "Describe a film."}]


BIN, MODEL = arguments()
serve_harness.NAME = NAME = "qwen3-chat"
proc, port = start_server(BIN, MODEL, "--device", "cpu", "--threads", "1", "--context", "2048")
client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
RF = {"type": "json_schema", "json_schema": {"name": "film", "schema": SCHEMA, "strict": True}}

try:
    # json_schema, greedy: valid, the same twice, and the same streamed.
    r = client.chat.completions.create(model=NAME, messages=USER, response_format=RF, temperature=0, max_tokens=800)
    c = r.choices[0]
    film = parsed(c.message.content)
    check(c.finish_reason == "stop", f"json_schema finish_reason stop ({c.finish_reason})")
    check(film is not None and valid(film, SCHEMA), f"json_schema reply validates ({c.message.content!r})")
    again = client.chat.completions.create(model=NAME, messages=USER, response_format=RF, temperature=0, max_tokens=800)
    check(again.choices[0].message.content == c.message.content, "greedy constrained replies repeat")
    text, reason = "", None
    for chunk in client.chat.completions.create(model=NAME, messages=USER, response_format=RF, temperature=0,
                                                max_tokens=800, stream=True):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
    check(text == c.message.content and reason == "stop", "streamed: the same reply, finish_reason stop")

    # Sampled, several choices and seeds: every one valid.
    s = client.chat.completions.create(model=NAME, messages=USER, response_format=RF, temperature=1.0, seed=11, n=3,
                                       max_tokens=800)
    check(all(ch.finish_reason == "stop" and valid(parsed(ch.message.content), SCHEMA) for ch in s.choices),
          "sampled choices validate")

    # json_object: an object (when it ends within max_tokens).
    o = client.chat.completions.create(model=NAME, messages=USER, response_format={"type": "json_object"},
                                       temperature=0, max_tokens=800)
    oc = o.choices[0]
    check(oc.message.content.startswith("{") and (oc.finish_reason != "stop" or isinstance(parsed(oc.message.content), dict)),
          f"json_object reply is an object ({oc.finish_reason}: {oc.message.content[:80]!r})")

    # /v1/completions takes response_format too.
    p = client.completions.create(model=NAME, prompt="Film:", max_tokens=800, temperature=0,
                                  extra_body={"response_format": RF})
    check(valid(parsed(p.choices[0].text), SCHEMA), "completions with response_format validate")

    # tool_choice required (one of the tools) and named (that one), arguments valid.
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        t = client.chat.completions.create(model=NAME, messages=USER, tools=TOOLS, tool_choice=choice,
                                           parallel_tool_calls=False, temperature=0, max_tokens=400)
        tc = t.choices[0]
        calls = tc.message.tool_calls or []
        check(tc.finish_reason == "tool_calls" and len(calls) == 1, f"tool_choice {choice}: one call ({tc})")
        if calls:
            name, args = calls[0].function.name, parsed(calls[0].function.arguments)
            check(name in tools and args is not None and valid(args, tools[name]), f"tool_choice {choice}: valid arguments")
            if isinstance(choice, dict):
                check(name == "get_time", "the named function is the one called")
        built, reason = {}, None
        for chunk in client.chat.completions.create(model=NAME, messages=USER, tools=TOOLS, tool_choice=choice,
                                                    parallel_tool_calls=False, temperature=0, max_tokens=400,
                                                    stream=True):
            for d in chunk.choices[0].delta.tool_calls or []:
                b = built.setdefault(d.index, {"name": "", "arguments": ""})
                if d.function:
                    b["name"] += d.function.name or ""
                    b["arguments"] += d.function.arguments or ""
            reason = chunk.choices[0].finish_reason or reason
        check(reason == "tool_calls" and calls and list(built.values()) ==
              [{"name": calls[0].function.name, "arguments": calls[0].function.arguments}],
              f"tool_choice {choice}: streamed the same call")

    # Bad schemas: 400s naming the field, and the server goes on.
    for rf, param in [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
         "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                                 "schema": {"type": "object", "properties": {"a": {"type": "string"}}}}},
         "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
        ({"type": "xml"}, "response_format.type"),
        # Past kestrel's limits on what a schema may cost to compile: refused before compiling.
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": list(range(10000))}}},
         "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"x": {"type": "string", "pattern": "^(a{1000}){1000}$"}}}}},
         "response_format.json_schema.schema.properties.x.pattern"),
    ]:
        t0 = time.monotonic()
        try:
            client.chat.completions.create(model=NAME, messages=USER, response_format=rf, max_tokens=4)
            check(False, f"{rf} refused")
        except openai.BadRequestError as e:
            check((e.body or {}).get("param", "").startswith(param), f"{rf}: 400 naming {param} ({e.body})")
        check(time.monotonic() - t0 < 2, f"{param}: refused within 2 s")
    ok = client.chat.completions.create(model=NAME, messages=USER, max_tokens=2)
    check(len(ok.choices) == 1, "the server serves after refusals")
finally:
    check(stop_server(proc) == 0, "the server exits 0 on SIGTERM")
finish()
