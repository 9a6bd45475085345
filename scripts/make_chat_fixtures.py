#!/usr/bin/env python3
"""Reference renderings for kestrel's chat templates and Jinja interpreter.

Renders the committed chat templates (tests/text/data/chat/templates/*.jinja) with transformers'
own apply_chat_template(tokenize=False) on a small stand-in tokenizer that carries each family's
special tokens, and a set of small Jinja snippets with the exact jinja2 environment transformers
compiles chat templates in. Writes:

  tests/text/data/chat/renderings.json   chat conversations -> expected text or error message
  tests/text/data/chat/jinja_cases.json  snippets + variables -> expected text or error message

Usage: python scripts/make_chat_fixtures.py   (needs transformers, tokenizers and jinja2)
"""
import json
import pathlib
import sys

import jinja2
import transformers
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast
from transformers.utils.chat_template_utils import _compile_jinja_template

ROOT = pathlib.Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "text" / "data" / "chat"
TEMPLATES = DATA / "templates"

SPECIAL = {
    "qwen": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "llama": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "mixtral": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    "glm": {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
    "deepseek": {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"},
}

FAMILY = {
    "qwen3.jinja": "qwen",
    "qwen2.5.jinja": "qwen",
    "llama3.1.jinja": "llama",
    "llama3.2.jinja": "llama",
    "mixtral.jinja": "mixtral",
    "glm-4.5.jinja": "glm",
    "deepseek-v3.jinja": "deepseek",
    "deepseek-r1.jinja": "deepseek",
    "deepseek-v3.1.jinja": "deepseek",
}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Zürich or 東京"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web and return \"snippets\".",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "threshold": {"type": "number", "default": 0.5},
                "safe": {"type": "boolean", "default": True},
                "sites": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["query"],
        },
    },
}
TOOLS = [WEATHER, SEARCH]

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
USER1 = {"role": "user", "content": "What is the capital of France?"}
ASSIST1 = {"role": "assistant", "content": "The capital of France is Paris."}
USER2 = {"role": "user", "content": "And of Germany?"}
UNICODE = {"role": "user", "content": "Grüße aus Zürich — 你好，世界 🚀 «quotes» \"double\" 'single' \\ back\\slash\ttab\nnew line"}
UNICODE_REPLY = {"role": "assistant", "content": "Ciao! Привет! こんにちは 👋"}
THINK_REPLY = {"role": "assistant", "content": "<think>\nThe user asks about Germany.\n</think>\n\nThe capital of Germany is Berlin."}
REASONING_REPLY = {
    "role": "assistant",
    "content": "The capital of Germany is Berlin.",
    "reasoning_content": "Germany's capital has been Berlin since 1990.",
}


def tool_turns(args_as_string=False, with_content=False):
    args = {"city": "Zürich", "unit": "celsius", "days": 3}
    arguments = json.dumps(args, ensure_ascii=False) if args_as_string else args
    call = {"role": "assistant", "content": "Let me check." if with_content else "",
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]}
    result = {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 21.5, \"condition\": \"sunny\"}"}
    return [{"role": "user", "content": "What's the weather in Zürich for the next 3 days?"}, call, result]


def two_tool_calls(args_as_string=False):
    a1 = {"city": "Paris"}
    a2 = {"query": "Paris events", "threshold": 0.25, "safe": False, "sites": ["a.fr", "b.fr"]}
    if args_as_string:
        a1, a2 = json.dumps(a1), json.dumps(a2)
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": a1}},
                           {"id": "c2", "type": "function", "function": {"name": "search", "arguments": a2}}]}
    return [{"role": "user", "content": "Weather and events in Paris?"}, call,
            {"role": "tool", "tool_call_id": "c1", "content": "rainy"},
            {"role": "tool", "tool_call_id": "c2", "content": "[\"concert\", \"expo\"]"}]


def common_cases():
    return [
        ("system_user_gen", [SYSTEM, USER1], {"add_generation_prompt": True}),
        ("system_user_nogen", [SYSTEM, USER1], {"add_generation_prompt": False}),
        ("user_only_gen", [USER1], {"add_generation_prompt": True}),
        ("multi_turn_gen", [SYSTEM, USER1, ASSIST1, USER2], {"add_generation_prompt": True}),
        ("multi_turn_closed", [USER1, ASSIST1, USER2, {"role": "assistant", "content": "Berlin."}], {}),
        ("unicode", [SYSTEM, UNICODE, UNICODE_REPLY, USER2], {"add_generation_prompt": True}),
        ("whitespace_content", [{"role": "user", "content": "  padded  \n\n"}, {"role": "assistant", "content": "\n ok \n"}], {}),
        ("null_keys_dropped", [{"role": "user", "content": "hi", "name": None}, {"role": "assistant", "content": "hello", "tool_calls": None}], {}),
    ]


def cases_for(name):
    c = common_cases()
    if name == "qwen3.jinja":
        c += [
            ("tools_gen", [SYSTEM, USER1], {"tools": TOOLS, "add_generation_prompt": True}),
            ("tools_no_system", [USER1], {"tools": TOOLS, "add_generation_prompt": True}),
            ("tool_call_and_result", [SYSTEM] + tool_turns(), {"tools": TOOLS, "add_generation_prompt": True}),
            ("tool_call_with_content", tool_turns(with_content=True) + [{"role": "assistant", "content": "It is sunny."}], {"tools": TOOLS}),
            ("tool_call_string_args", tool_turns(args_as_string=True), {"tools": TOOLS, "add_generation_prompt": True}),
            ("two_tool_calls", two_tool_calls(), {"tools": TOOLS, "add_generation_prompt": True}),
            ("think_in_content", [USER1, ASSIST1, USER2, THINK_REPLY], {}),
            ("reasoning_content_last", [USER1, ASSIST1, USER2, REASONING_REPLY], {}),
            ("reasoning_content_history", [USER2, REASONING_REPLY, USER1], {"add_generation_prompt": True}),
            ("thinking_field_alias", [USER2, {"role": "assistant", "content": "Berlin.", "thinking": "It is Berlin."}], {}),
            ("enable_thinking_false", [SYSTEM, USER1], {"add_generation_prompt": True, "enable_thinking": False}),
            ("enable_thinking_true", [SYSTEM, USER1], {"add_generation_prompt": True, "enable_thinking": True}),
            ("continue_final_message", [USER1, {"role": "assistant", "content": "The capital is"}], {"continue_final_message": True}),
            ("content_not_string_error", [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], {"add_generation_prompt": True}),
        ]
    elif name == "qwen2.5.jinja":
        c += [
            ("tools_gen", [SYSTEM, USER1], {"tools": TOOLS, "add_generation_prompt": True}),
            ("tools_default_system", [USER1], {"tools": TOOLS, "add_generation_prompt": True}),
            ("tool_call_and_result", [SYSTEM] + tool_turns(), {"tools": TOOLS, "add_generation_prompt": True}),
            ("tool_call_with_content", tool_turns(with_content=True), {"tools": TOOLS, "add_generation_prompt": True}),
            ("two_tool_calls", two_tool_calls(), {"tools": TOOLS, "add_generation_prompt": True}),
            ("continue_final_message", [USER1, {"role": "assistant", "content": "The capital is"}], {"continue_final_message": True}),
        ]
    elif name in ("llama3.1.jinja", "llama3.2.jinja"):
        c += [
            ("tools_in_user_message", [SYSTEM, USER1], {"tools": TOOLS, "add_generation_prompt": True, "date_string": "26 Jul 2024"}),
            ("tools_in_system", [SYSTEM, USER1], {"tools": TOOLS, "tools_in_user_message": False, "add_generation_prompt": True, "date_string": "01 Jan 2025"}),
            ("tool_call_and_result", [SYSTEM] + tool_turns(), {"tools": TOOLS, "add_generation_prompt": True, "date_string": "26 Jul 2024"}),
            ("tool_result_mapping", tool_turns()[:2] + [{"role": "tool", "content": {"temperature": 21.5, "ok": True}}], {"tools": TOOLS, "add_generation_prompt": True, "date_string": "26 Jul 2024"}),
            ("two_tool_calls_error", two_tool_calls(), {"tools": TOOLS, "date_string": "26 Jul 2024"}),
            ("tools_without_user_error", [SYSTEM], {"tools": TOOLS, "date_string": "26 Jul 2024"}),
        ]
        if name == "llama3.1.jinja":
            c += [
                ("builtin_tools", [SYSTEM, USER1], {"builtin_tools": ["brave_search", "wolfram_alpha", "code_interpreter"], "add_generation_prompt": True, "date_string": "26 Jul 2024"}),
                ("builtin_tool_call", [USER1, {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "brave_search", "arguments": {"query": "capital of France"}}}]}, {"role": "ipython", "content": "Paris"}],
                 {"builtin_tools": ["brave_search", "wolfram_alpha"], "add_generation_prompt": True, "date_string": "26 Jul 2024"}),
            ]
        # the default date: Llama 3.2 asks strftime_now, so it is only rendered with a fixed date_string
        c = [(n, m, dict({"date_string": "26 Jul 2024"}, **o)) for n, m, o in c]
    elif name == "mixtral.jinja":
        c = [x for x in c if x[0] not in ("multi_turn_closed",)]
        c += [
            ("alternation", [USER1, ASSIST1, USER2, {"role": "assistant", "content": "Berlin."}], {}),
            ("roles_must_alternate_error", [USER1, USER2], {"add_generation_prompt": True}),
            ("system_not_first_error", [USER1, ASSIST1, SYSTEM], {}),
            ("assistant_first_error", [ASSIST1, USER1], {}),
            ("tool_role_error", [USER1, {"role": "tool", "content": "x"}], {}),
        ]
        c = [x for x in c if not (x[0] == "whitespace_content")] + [("whitespace_content", [{"role": "user", "content": "  padded  \n\n"}, {"role": "assistant", "content": "\n ok \n"}], {})]
    elif name == "glm-4.5.jinja":
        c += [
            ("tools_gen", [SYSTEM, USER1], {"tools": TOOLS, "add_generation_prompt": True}),
            ("tool_call_and_result", [SYSTEM] + tool_turns(), {"tools": TOOLS, "add_generation_prompt": True}),
            ("two_tool_calls", two_tool_calls(), {"tools": TOOLS, "add_generation_prompt": True}),
            ("think_in_content", [USER1, ASSIST1, USER2, THINK_REPLY], {}),
            ("reasoning_content", [USER1, ASSIST1, USER2, REASONING_REPLY], {}),
            ("enable_thinking_false", [SYSTEM, USER1, ASSIST1, USER2], {"add_generation_prompt": True, "enable_thinking": False}),
            ("nothink_already", [{"role": "user", "content": "Quick answer /nothink"}], {"add_generation_prompt": True, "enable_thinking": False}),
            ("content_blocks", [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                                {"role": "user", "content": [{"type": "text", "text": "Part one. "}, {"type": "image"}, {"type": "text", "text": "Part two."}]}],
             {"add_generation_prompt": True}),
            ("tool_results_list", [USER1, {"role": "tool", "content": [{"output": "first"}, "second"]}], {"add_generation_prompt": True}),
        ]
    elif name in ("deepseek-v3.jinja", "deepseek-r1.jinja", "deepseek-v3.1.jinja"):
        c += [
            ("two_system_messages", [SYSTEM, {"role": "system", "content": "Answer in French."}, USER1], {"add_generation_prompt": True}),
            ("tool_call_and_result", tool_turns(args_as_string=True) + [{"role": "assistant", "content": "It is sunny."}, USER2], {"add_generation_prompt": True}),
            ("two_tool_calls", two_tool_calls(args_as_string=True), {"add_generation_prompt": True}),
            ("think_in_content", [USER1, ASSIST1, USER2, THINK_REPLY], {}),
        ]
        if name == "deepseek-v3.jinja":
            c += [("tool_call_null_content_error", [USER1, {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}], {})]
        if name == "deepseek-v3.1.jinja":
            c += [
                ("thinking_true", [SYSTEM, USER1], {"add_generation_prompt": True, "thinking": True}),
                ("prefix_thinking", [USER1, {"role": "assistant", "content": "Paris", "prefix": True}], {"thinking": True}),
            ]
    return c


def make_tokenizer(family):
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")), **SPECIAL[family]
    )
    return tok


def render_chat_cases():
    out = []
    for path in sorted(TEMPLATES.glob("*.jinja")):
        name = path.name
        source = path.read_text(encoding="utf-8")
        tok = make_tokenizer(FAMILY[name])
        tok.chat_template = source
        for case, messages, kwargs in cases_for(name):
            kwargs = dict(kwargs)
            entry = {"template": name, "case": case, "messages": messages}
            # What the template sees besides messages: the tokenizer's special tokens, then the kwargs.
            options = dict(tok.special_tokens_map)
            options.update(kwargs)
            entry["options"] = options
            try:
                text = tok.apply_chat_template(messages, tokenize=False, **kwargs)
                entry["expected"] = text
            except (jinja2.exceptions.TemplateError, ValueError, TypeError) as e:
                entry["error"] = str(e)
            out.append(entry)
    return out


# Snippets: (template, variables). Each is rendered in transformers' jinja2 environment.
JINJA_CASES = [
    # whitespace control, trim_blocks and lstrip_blocks
    ("  {% if true %}\n  x\n  {% endif %}\n", {}),
    ("a  {%- if true -%}  b  {%- endif %}  c\n{# comment #}\nd\n  {#- x -#}  e", {}),
    ("{{ 'a' }}\n{{ 'b' }}\n", {}),
    ("{%+ if true %}x{% endif +%}\ny", {}),
    ("\t{% if true %}\n\tx\n{% endif %}", {}),
    ("line1\r\nline2\r{{ 'x' }}\r\n", {}),
    ("{% raw %}{{ x }} {% if %}{% endraw %}", {}),
    ("  {%- raw -%}  a  {%- endraw -%}  b", {}),
    ("{% for i in [1, 2] %}\n  {{ i }}\n{% endfor %}\n", {}),
    ("{{- ' x ' -}}\n\n{{ 'y' }}", {}),
    ("A\n    {#- c #}\nB\n  {# c #}\nC", {}),
    # loops
    ("{% for a in [] %}x{% else %}empty{% endfor %}", {}),
    ("{% for a in [1,2,3,4] if a > 1 %}{{ loop.index }}{{ loop.length }}{{ loop.last }}{% endfor %}", {}),
    ("{% for i in 'ab' %}{{ loop.previtem }}|{{ loop.nextitem }}|{{ loop.revindex }}{{ loop.cycle('x','y') }};{% endfor %}", {}),
    ("{% for i in [1,2,3] %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}", {}),
    ("{% for i in [1,2,3] %}{% if i == 2 %}{% continue %}{% endif %}{{ i }}{% endfor %}", {}),
    ("{% for k, v in {'a':1,'b':2}.items() %}{{k}}={{v}};{% endfor %}", {}),
    ("{% for k in {'b':1,'a':2} %}{{k}}{% endfor %}", {}),
    ("{% for x in xs %}{{ loop.index0 }}{{ loop.first }}{{ loop.revindex0 }}{% endfor %}", {"xs": ["p", "q"]}),
    ("{% for m in messages[::-1] %}{{ m.role }}{% endfor %}", {"messages": [{"role": "a"}, {"role": "b"}]}),
    ("{% set x = 1 %}{% for i in range(3) %}{{ x }}{% set x = 2 %}{% endfor %}{{ x }}", {}),
    ("{% for i in range(3) %}{% if i == 0 %}{% set y = 5 %}{% endif %}{{ y }}{% endfor %}", {}),
    ("{% for a, b in [[1, 2], (3, 4)] %}{{ a + b }}{% endfor %}", {}),
    ("{% for x in none %}{% endfor %}", {}),
    ("{% for a, b in [[1, 2, 3]] %}{% endfor %}", {}),
    # set, namespace, macro, call, filter blocks, with
    ("{% set a, b = 1, 2 %}{{ a }}{{ b }}", {}),
    ("{% set ns = namespace(a=1) %}{% set ns.a = ns.a + 1 %}{{ ns.a }}{{ ns }}", {}),
    ("{% set ns = namespace(n=0) %}{% for i in range(4) %}{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}", {}),
    ("{% set x = 1 %}{% set x.y = 2 %}", {}),
    ("{% set ns = namespace() %}{% set ns._x = 2 %}", {}),
    ("{% set s %}a{{ 1 }}b{% endset %}{{ s }}|{{ s|length }}", {}),
    ("{% set s | upper %}a{{ 1 }}b{% endset %}{{ s }}", {}),
    ("{% filter upper %}hello {{ 'x' }}{% endfilter %}", {}),
    ("{% macro f(a, b=2) %}[{{a}}{{b}}]{% endmacro %}{{ f(1) }}{{ f(1, b=3) }}{{ f(a=4) }}", {}),
    ("{% macro f() %}{{ y }}{% endmacro %}{% set y = 1 %}{{ f() }}{% set y = 2 %}{{ f() }}", {}),
    ("{% set y = 0 %}{% macro f() %}{{ y }}{% endmacro %}{% for i in [1] %}{% set y = 5 %}{{ f() }}{% endfor %}", {}),
    ("{% macro m(a) %}<{{ caller(a) }}>{% endmacro %}{% call(x) m(5) %}[{{ x }}]{% endcall %}", {}),
    ("{% macro m() %}{{ varargs }}{{ kwargs }}{% endmacro %}{{ m(1,2,c=3) }}", {}),
    ("{% macro m() %}x{% endmacro %}{{ m(1) }}", {}),
    ("{% macro m(a) %}{{ a }}{% endmacro %}{{ m() }}|{{ m(b=1) }}", {}),
    ("{% macro r(n) %}{% if n > 0 %}{{ n }}{{ r(n - 1) }}{% endif %}{% endmacro %}{{ r(5) }}", {}),
    ("{% with a = 1, b = 2 %}{{ a + b }}{% endwith %}{{ a }}", {}),
    ("{% generation %}gen{% endgeneration %}", {}),
    # expressions
    ("{{ [1,2] }}{{ {'a': 1, 'b': 'x'} }}{{ none }}{{ true }}{{ 1.0 }}{{ 1e20 }}{{ 1e-5 }}{{ 10/4 }}{{ 7//2 }}{{ -7 % 3 }}{{ 2**10 }}", {}),
    ("{{ 0.1 + 0.2 }}|{{ 1/3 }}|{{ 100000000000000000.0 }}|{{ 1e16 }}|{{ 123456789012345.6 }}|{{ 1e100 }}|{{ -0.0 }}|{{ 0.000123 }}|{{ 1234567.0 }}|{{ 0.0001 }}", {}),
    ("{{ 2 ** -1 }}{{ 7 % -3 }}{{ -7 // 2 }}{{ 7.5 // 2 }}{{ 7.5 % 2 }}{{ true + true }}{{ -7.5 // 2 }}{{ -7.5 % 2 }}", {}),
    ("{{ 'a' * 3 }}{{ [1] * 2 }}{{ [1]+[2] }}{{ (1,)+(2,) }}{{ (1, 2) }}{{ (1,) }}{{ () }}", {}),
    ("{{ 1 + 'a' }}", {}), ("{{ 'x' + 1 }}", {}), ("{{ 10 / 0 }}", {}), ("{{ 1 < 'a' }}", {}),
    ("{{ 5 > 3 > 1 }}{{ 1 == 1.0 }}{{ 'a' < 'b' }}{{ [1,2] < [1,3] }}{{ (1,2) == [1,2] }}{{ {'a':1} == {'a':1} }}", {}),
    ("{{ 'a' in 'cat' }}{{ 1 in [1] }}{{ 'x' in {'x':1} }}{{ 'z' not in 'abc' }}{{ 3 not in [1] }}", {}),
    ("{{ true and 'x' }}{{ 0 or 'y' }}{{ none or none }}{{ not 'a' }}{{ '' and 1 }}{{ not x }}", {}),
    ("{{ 'a' if true }}{{ 'b' if false else 'c' }}{{ 'd' if false }}|{{ 'e' if x is defined else 'f' }}", {}),
    ("{{ 'x' ~ 1 ~ none ~ true ~ 1.5 ~ [1] ~ undefined_thing }}", {}),
    ("{{ -x }}", {"x": 3}), ("{{ -'a' }}", {}), ("{{ +2.5 }}{{ -(-3) }}", {}),
    ("{{ 'abc'[::-1] }}{{ 'héllo'[1:3] }}{{ 'héllo'|length }}{{ 'héllo'[-1] }}{{ 'abc'[10] }}|", {}),
    ("{{ [1,2,3][1:] }}{{ [1,2,3][:-1] }}{{ [1,2,3][::2] }}{{ 'abcdef'[-2:] }}{{ 'abcdef'[5:1:-1] }}{{ [1,2,3][-1] }}{{ [1,2,3][5] }}|", {}),
    ("{{ x[1:] }}", {"x": None}),
    ("{{ 'abc'[::0] }}", {}),
    ("{{ [1, 'a', none, true, 1.5] }}{{ ['it\\'s', 'a\"b', 'x\\ny', 'both\\'\"'] }}{{ {'k': [1, {'n': none}]} }}", {}),
    ("{{ '\\u00e9\\x41\\n\\t\\\\' }}|{{ \"a\" 'b' }}|{{ 'tab\\there' }}", {}),
    ("{{ 1_000 + 0x10 + 0o7 + 0b11 }}{{ 1_0.5 }}", {}),
    ("{{ {'a': {'b': [10, 20]}}.a.b.1 }}{{ d['k'] }}{{ d.k }}", {"d": {"k": "v"}}),
    # undefined behaviour
    ("{{ x }}|{{ x is defined }}|{{ x is undefined }}|{{ x|default('d') }}|{{ x|length }}|{{ x|list }}|{{ x is none }}", {}),
    ("{{ x.y }}", {}), ("{{ x + 'a' }}", {}), ("{{ x < 1 }}", {}),
    ("{% set d = {} %}{{ d.y }}|{{ d.y is defined }}", {}),
    ("{% set d = {} %}{{ d.y.z }}", {}),
    ("{{ none.x }}|{{ [1][5] }}|", {}),
    ("{{ x == y }}{{ x == none }}{{ x != 1 }}", {}),
    ("{{ x is iterable }}{{ x is sequence }}{{ x is mapping }}{{ x|string }}{{ x|trim }}{{ x|upper }}{{ x|join }}", {}),
    ("{{ x|tojson }}", {}),
    ("{{ x() }}", {}),
    ("{{ (1 if false).x }}", {}),
    ("{{ m.content.split('a') }}", {"m": {"role": "user"}}),
    # tests
    ("{{ none is iterable }}{{ 'a' is iterable }}{{ {} is sequence }}{{ 'a' is sequence }}{{ 1 is number }}{{ true is number }}{{ true is integer }}", {}),
    ("{{ 1 is divisibleby 1 }}{{ 4 is divisibleby(2) }}{{ 'A' is upper }}{{ 2 is even }}{{ 3 is odd }}{{ 1 is sameas 1 }}{{ 'a' is lower }}", {}),
    ("{{ [1,2] is sequence }}{{ 'x' is in 'xyz' }}{{ 1 is eq 1 }}{{ 2 is gt 1 }}{{ 2 is ge 3 }}{{ 2 is lt 3 }}{{ 2 is ne 2 }}{{ 1 is equalto 1 }}", {}),
    ("{{ 1 is boolean }}{{ false is false }}{{ 1 is true }}{{ 1.0 is float }}{{ range is callable }}{{ 'upper' is filter }}{{ 'odd' is test }}", {}),
    ("{{ {} is mapping }}{{ [] is mapping }}{{ 'x' is string }}{{ 1 is string }}{{ none is none }}{{ x is not none }}", {}),
    ("{{ 1 is not defined }}{{ y is not string }}", {"y": 5}),
    # filters
    ("{{ [1,2,3]|join(',') }}{{ ['a', x, 'b']|join }}{{ [1, 'a', none]|join('-') }}{{ [{'n': 'a'}, {'n': 'b'}]|join('+', attribute='n') }}", {}),
    ("{{ {'b':1,'a':2}|tojson }}|{{ {'b':1,'a':[1,2]}|tojson(indent=2) }}|{{ [1, [2, {}], []]|tojson(indent=4) }}", {}),
    ("{{ 'ü<>&\\''|tojson }}{{ '\\u0001\\x7f\\u2028'|tojson }}{{ 'é😀'|tojson(ensure_ascii=True) }}", {}),
    ("{{ {'a':1, 'b': [1, 2]}|tojson(separators=(',', ':')) }}{{ {'b':1,'a':2}|tojson(sort_keys=true) }}{{ {'x': 1}|tojson(indent='\\t') }}", {}),
    ("{{ {'a': none, 'b': true, 'c': 1.0, 'd': 2.5e-7, 'e': 1e22, 'f': -3}|tojson }}", {}),
    ("{{ {1: 'a', none: 'b', true: 'c', 2.5: 'd'}|tojson }}", {}),
    ("{{ d|tojson }}{{ d|tojson(indent=2) }}", {"d": {"z": 1, "a": {"y": [], "b": {}}, "m": "é"}}),
    ("{{ 'hello world'|title }}{{ 'hELLO'|capitalize }}{{ 'hello-world (foo) [bar]'|title }}{{ \"they're bill's\".title() }}", {}),
    ("{{ 'ABC'|lower }}{{ 'abc'|upper }}{{ 'é'|upper }}{{ 'ÉCOLE straße'|lower }}{{ 'straße'|upper }}{{ 'Привет'|upper }}", {}),
    ("{{ x|default('d') }}{{ ''|default('d') }}{{ ''|default('d', true) }}{{ none|default('n') }}{{ false|d('f', boolean=true) }}", {}),
    ("{{ range(3)|list }}{{ [3,1,2]|sort }}{{ [1,2]|first }}{{ 'abc'|last }}{{ []|first }}|{{ {'a': 1}|first }}", {}),
    ("{{ ['b','A','a','C']|sort }}{{ ['b','A','a']|sort(case_sensitive=true) }}{{ [3,1,2]|sort(reverse=true) }}", {}),
    ("{{ [{'n': 2}, {'n': 1}]|sort(attribute='n') }}{{ [{'n': 'b'}, {'n': 'A'}]|map(attribute='n')|sort|join }}", {}),
    ("{{ ['b','A','a']|unique|list }}{{ [3,1]|max }}{{ [3,1]|min }}{{ ['a','B']|max }}{{ [1,2]|sum }}{{ [{'v': 2}, {'v': 3}]|sum(attribute='v') }}", {}),
    ("{{ {'a':1}.items()|list }}{{ {'a':1}|items|list }}{{ {'a':1}.keys()|list }}{{ {'a':1}.values()|list }}", {}),
    ("{{ [{'a':1},{'a':2},{'b':3}]|selectattr('a')|list }}{{ [{'a':1},{'a':2}]|map(attribute='a')|list }}", {}),
    ("{{ [{'a':'x'},{'a':'y'}]|selectattr('a','equalto','y')|list }}{{ [{'a':'x'},{'a':'y'}]|rejectattr('a','equalto','y')|list }}", {}),
    ("{{ ['a','b']|map('upper')|join }}{{ [1,2,3]|select('odd')|list }}{{ [1,2,3]|reject('odd')|list }}{{ [0, 1, '']|select|list }}", {}),
    ("{{ [{'a': {'b': 1}}, {'a': {'b': 2}}]|map(attribute='a.b')|list }}{{ [{'x': 1}, {}]|map(attribute='x', default=0)|list }}", {}),
    ("{{ messages|selectattr('role', 'equalto', 'user')|list|length }}", {"messages": [{"role": "user"}, {"role": "assistant"}, {"role": "user"}]}),
    ("{{ ['brave_search', 'code_interpreter']|reject('equalto', 'code_interpreter')|join(', ') }}", {}),
    ("{{ '  x\\n'|trim }}|{{ 'xxhixx'|trim('x') }}|{{ 'aXbX'|replace('X','-') }}|{{ 'aXbX'|replace('X','-',1) }}", {}),
    ("{{ 'abc'|center(7) }}|{{ 'a\\nb'|indent(2) }}|{{ 'a\\nb'|indent(2, true) }}|{{ 'a\\n\\nb'|indent(2, blank=true) }}|", {}),
    ("{{ 3.7|round }}{{ 3.75|round(1) }}{{ 2.5|round }}{{ 3|round }}{{ -3|abs }}{{ 3.14159|round(2, 'floor') }}{{ 2.675|round(2) }}{{ 1.5|round(0, 'ceil') }}", {}),
    ("{{ '%s-%d'|format('a', 3) }}{{ '%s' % 'x' }}{{ '%05.1f' % 2.25 }}{{ '%(a)s!' % {'a': 1} }}{{ '%x %o %%' % (255, 8) }}{{ '%-4s|%4s' % ('a', 'b') }}", {}),
    ("{{ {'b':1,'a':2}|dictsort }}{{ [1,2]|reverse|list }}{{ 'abc'|reverse }}{{ {'a': 2, 'b': 1}|dictsort(by='value') }}", {}),
    ("{{ 10|string + 'a' }}{{ '12'|int + 1 }}{{ '1.5'|float }}{{ 'x'|int }}{{ '0x1A'|int(base=16) }}{{ ' 7 '|int }}{{ '3.9'|int }}{{ 'abc'|float }}{{ 3.9|int }}", {}),
    ("{{ '<a href=\"x\">&</a>'|e }}{{ '<a>'|safe }}{{ '<b>'|escape }}", {}),
    ("{{ 'hello big world'|wordcount }}{{ 'hello big world'|truncate(9) }}{{ 'hello big world'|truncate(9, true, '..', 0) }}", {}),
    ("{{ [1, 2]|count }}{{ 'abc'|attr('upper')() }}{{ [1, 2, 2]|unique|list }}{{ {'a': 1}|pprint }}", {}),
    ("{{ [1, 2]|length }}{{ {'a': 1}|length }}{{ 5|length }}", {}),
    # string methods
    ("{{ 'a,b,c'.split(',', 1) }}{{ 'a b  c'.split() }}{{ ' a b '.split(None, 1) }}{{ 'a,b,c'.rsplit(',', 1) }}{{ 'abc'.startswith(('x','a')) }}{{ 'abc'.endswith('bc') }}", {}),
    ("{{ ' x '.strip() }}|{{ 'xxhixx'.strip('x') }}|{{ '\\n\\nhi\\n'.lstrip('\\n') }}|{{ 'ab'.rstrip('b') }}|{{ '\\u3000wide\\u00a0'.strip() }}|", {}),
    ("{{ 'aXbX'.replace('X','-') }}{{ 'abc'.replace('', '.') }}{{ 'a{}b'.format(1) }}{{ '{}-{}'.format('a', 'b') }}{{ '{x}'.format(x=1) }}{{ '{0}{0}'.format('z') }}", {}),
    ("{{ '{:>5}|{:<4}|{:^7}|{:05d}|{:.2f}|{!r}'.format('a', 'b', 'c', 42, 3.14159, 'q') }}", {}),
    ("{{ 'abc'.upper() }}{{ 'ABC'.lower() }}{{ 'hello world'.title() }}{{ 'hello'.capitalize() }}{{ 'abcabc'.find('c') }}{{ 'abcabc'.rfind('c') }}{{ 'abcabc'.count('b') }}", {}),
    ("{{ '-'.join(['a', 'b']) }}{{ '12'.isdigit() }}{{ 'ab'.isalpha() }}{{ '  '.isspace() }}{{ '7'.zfill(3) }}{{ 'a=b=c'.partition('=') }}{{ 'x.py'.removesuffix('.py') }}", {}),
    ("{{ 'a\\nb\\r\\nc'.splitlines() }}{{ 'ab'.ljust(4, '*') }}{{ 'ab'.rjust(4) }}{{ 'abc'.index('c') }}", {}),
    ("{{ '-'.join([1, 2]) }}", {}),
    ("{{ 'abc'.index('z') }}", {}),
    ("{{ d.get('a') }}{{ d.get('zz') }}{{ d.get('zz', 3) }}", {"d": {"a": 1}}),
    ("{{ [1, 2, 1].count(1) }}{{ [1, 2].index(2) }}", {}),
    # globals
    ("{{ range(2, 10, 3)|list }}{{ range(5, 0, -2)|list }}{{ dict(a=1, b=2) }}{{ dict({'x':1}, y=2) }}{{ namespace(a=1).a }}", {}),
    ("{{ range(100001)|length }}", {}),
    ("{{ raise_exception('custom failure: ' ~ 42) }}", {}),
    ("{% if messages|length > 1 %}{{ raise_exception('Only one message allowed, got ' ~ messages|length) }}{% endif %}", {"messages": [1, 2]}),
    # sandbox
    ("{{ [1,2].append(3) }}", {}),
    ("{{ 'x'.__class__ }}|{{ 'x'.__class__ is defined }}", {}),
    ("{{ 'x'.__class__.__mro__ }}", {}),
    ("{% set d = {'_x': 1} %}{{ d._x }}", {}),
    # syntax errors
    ("{% if true %}unclosed", {}),
    ("{% for x in y %}{% endif %}", {}),
    ("{{ x | nosuchfilter }}", {}),
    ("{{ x is nosuchtest }}", {}),
    ("{% foo %}", {}),
    ("{{ 1 + }}", {}),
    ("{{ (1, 2 }}", {}),
    ("{{ 'unterminated }}", {}),
    ("{# unclosed comment", {}),
    ("{{ x ", {}),
    ("{% endfor %}", {}),
    ("{% break %}", {}),
]


def render_jinja_cases():
    out = []
    for source, variables in JINJA_CASES:
        entry = {"template": source, "variables": variables}
        try:
            entry["expected"] = _compile_jinja_template(source).render(**variables)
        except (jinja2.exceptions.TemplateError, TypeError, ValueError, ZeroDivisionError, OverflowError, AttributeError,
                SyntaxError) as e:
            entry["error"] = str(e)
            entry["error_type"] = type(e).__name__
        out.append(entry)
    return out


def main():
    chat = render_chat_cases()
    jcases = render_jinja_cases()
    meta = {"transformers": transformers.__version__, "jinja2": jinja2.__version__}
    (DATA / "renderings.json").write_text(
        json.dumps({"generator": meta, "cases": chat}, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    (DATA / "jinja_cases.json").write_text(
        json.dumps({"generator": meta, "cases": jcases}, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    n_err = sum("error" in c for c in chat)
    print(f"{len(chat)} chat renderings ({n_err} errors), {len(jcases)} jinja cases", file=sys.stderr)


if __name__ == "__main__":
    main()
