#!/usr/bin/env python3
"""Tool calls and reasoning through `kestrel serve` with the official `openai` client, on the
qwen3-chat fixture (Qwen3's template over a tiny random model) whose reply is scripted with
--test-scripted-reply: it thinks, then calls a tool. Non-streamed and streamed (the calls put
together from their deltas as clients do), the call sent back with its result, a plain request
(the call is then content), and tool_choice "required" constrained to a call.

Usage: test_tool_calls_server.py KESTREL_BINARY MODEL_DIR. Exits 77 (skipped) when the `openai`
package is absent."""
import json
import sys

import serve_harness
from serve_harness import arguments, check, finish, start_server, stop_server

try:
    import openai
except ImportError:
    print("skipped: the openai package is not installed (scripts/install_deps.sh makes .venv)")
    sys.exit(77)

REPLY = ("<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n"
         '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>')
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
USER = {"role": "user", "content": "Weather in Paris?"}

BIN, MODEL = arguments()
serve_harness.NAME = NAME = "qwen3-chat"
proc, port = start_server(BIN, MODEL, "--device", "cpu", "--threads", "1", "--context", "2048",
                          "--test-scripted-reply", REPLY)
client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)


def extra(obj, key):
    """A field the openai types do not declare (reasoning_content)."""
    return (obj.model_extra or {}).get(key)


try:
    r = client.chat.completions.create(model=NAME, messages=[USER], tools=TOOLS)
    c = r.choices[0]
    check(c.finish_reason == "tool_calls", f"finish_reason tool_calls ({c.finish_reason})")
    check(c.message.content is None, f"content null with only a call ({c.message.content!r})")
    check(extra(c.message, "reasoning_content") == "The user wants the weather.", "reasoning_content apart")
    calls = c.message.tool_calls or []
    check(len(calls) == 1 and calls[0].type == "function" and calls[0].id.startswith("call_"), "one call with an id")
    check(calls and calls[0].function.name == "get_weather", "the call's name")
    check(calls and json.loads(calls[0].function.arguments) == {"city": "Paris", "days": 2}, "the call's arguments")

    # Streamed: the call put together from its deltas by index, as clients do.
    reasoning, content, finish_reason, built = "", "", None, {}
    for chunk in client.chat.completions.create(model=NAME, messages=[USER], tools=TOOLS, stream=True):
        d = chunk.choices[0].delta
        reasoning += extra(d, "reasoning_content") or ""
        content += d.content or ""
        for t in d.tool_calls or []:
            b = built.setdefault(t.index, {"id": None, "name": "", "arguments": ""})
            b["id"] = t.id or b["id"]
            if t.function:
                b["name"] += t.function.name or ""
                b["arguments"] += t.function.arguments or ""
        finish_reason = chunk.choices[0].finish_reason or finish_reason
    check(reasoning == "The user wants the weather." and content == "", "streamed reasoning apart, no content")
    check(list(built) == [0] and built[0]["name"] == "get_weather" and built[0]["id"].startswith("call_"),
          f"streamed call head ({built})")
    check(built and json.loads(built[0]["arguments"]) == {"city": "Paris", "days": 2}, "streamed call arguments")
    check(finish_reason == "tool_calls", f"streamed finish_reason tool_calls ({finish_reason})")

    # The call and its result sent back (the assistant message as the client got it).
    back = client.chat.completions.create(model=NAME, tools=TOOLS, messages=[
        USER, c.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": calls[0].id, "content": '{"sky": "clear"}'}])
    check(back.usage.prompt_tokens > r.usage.prompt_tokens, "the conversation with the call and its result renders")

    # Without tools the call is content (the reasoning is still apart).
    plain = client.chat.completions.create(model=NAME, messages=[USER])
    check(plain.choices[0].message.content.startswith("<tool_call>") and not plain.choices[0].message.tool_calls
          and plain.choices[0].finish_reason == "stop", "without tools the call is content")

    # tool_choice "required": the reply is constrained to a call (the script is not used: a
    # constrained reply is sampled on the host), whatever the random model prefers. The city's
    # length is limited: greedy noise inside an unlimited string may never close it.
    short = [{"type": "function", "function": {**TOOLS[0]["function"], "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
        "required": ["city"]}}}]
    forced = client.chat.completions.create(model=NAME, messages=[USER], tools=short, tool_choice="required",
                                            temperature=0, max_tokens=400)
    fc = forced.choices[0]
    fcalls = fc.message.tool_calls or []
    check(fc.finish_reason == "tool_calls" and len(fcalls) >= 1 and fcalls[0].function.name == "get_weather",
          f"tool_choice required gives a call ({fc})")
    check(bool(fcalls) and isinstance(json.loads(fcalls[0].function.arguments).get("city"), str),
          "the required call's arguments have the required city")
finally:
    check(stop_server(proc) == 0, "the server exits 0 on SIGTERM")
finish()
