// The Jinja interpreter: snippets rendered by jinja2 in transformers' environment (recorded by
// scripts/make_chat_fixtures.py) and unit tests of its pieces, its error messages and its limits.
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/error.h"
#include "common/mapped_file.h"
#include "text/jinja.h"

namespace kestrel::jinja {
namespace {

using ojson = nlohmann::ordered_json;


std::string render(const std::string& src, const ojson& vars = ojson::object(), Options opt = {}) {
  return Template(src, "t", opt).render(vars);
}

// The error message of rendering `src`, or "" when it renders.
std::string error_of(const std::string& src, const ojson& vars = ojson::object(), Options opt = {}) {
  try {
    Template(src, "t", opt).render(vars);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

struct JinjaCase {
  size_t index;
  std::string source;
  ojson variables;
  bool is_error = false;
  std::string expected;
  std::string error_type;
};

std::vector<JinjaCase> load_cases() {
  std::vector<JinjaCase> out;
  ojson j = ojson::parse(read_text_file(std::string(KESTREL_TEXT_DATA) + "/chat/jinja_cases.json"));
  size_t i = 0;
  for (const auto& c : j.at("cases")) {
    JinjaCase r;
    r.index = i++;
    r.source = c.at("template").get<std::string>();
    r.variables = c.at("variables");
    r.is_error = c.contains("error");
    r.expected = r.is_error ? c.at("error").get<std::string>() : c.at("expected").get<std::string>();
    if (r.is_error) r.error_type = c.at("error_type").get<std::string>();
    out.push_back(std::move(r));
  }
  return out;
}

void PrintTo(const JinjaCase& c, std::ostream* os) { *os << c.source; }

class Jinja2Case : public ::testing::TestWithParam<JinjaCase> {};

TEST_P(Jinja2Case, MatchesJinja2) {
  const JinjaCase& c = GetParam();
  SCOPED_TRACE("template: " + c.source);
  if (!c.is_error) {
    EXPECT_EQ(render(c.source, c.variables), c.expected);
    return;
  }
  std::string err = error_of(c.source, c.variables);
  ASSERT_FALSE(err.empty()) << "expected an error like: " << c.expected << "\ngot: " << render(c.source, c.variables);
  EXPECT_EQ(err.rfind("t:", 0), 0u) << err;  // names the template and the line
  // Syntax errors are worded by each parser; runtime errors carry jinja2's (and Python's) message.
  if (c.error_type != "TemplateSyntaxError" && c.error_type != "SyntaxError") {
    EXPECT_NE(err.find(c.expected), std::string::npos) << "error: " << err << "\njinja2: " << c.expected;
  }
}

INSTANTIATE_TEST_SUITE_P(Recorded, Jinja2Case, ::testing::ValuesIn(load_cases()),
                         [](const ::testing::TestParamInfo<JinjaCase>& info) { return "case" + std::to_string(info.param.index); });

// ---- whitespace control ------------------------------------------------------------------

TEST(JinjaWhitespace, TrimAndLstripBlocks) {
  EXPECT_EQ(render("{% if true %}\nyes\n{% endif %}\n"), "yes\n");
  EXPECT_EQ(render("    {% if true %}\n    x\n    {% endif %}"), "    x\n");
  EXPECT_EQ(render("a {{ 'b' }} c"), "a b c");  // variables are never stripped
  EXPECT_EQ(render("a\n  {{ 'b' }}\n"), "a\n  b");
  Options plain;
  plain.trim_blocks = plain.lstrip_blocks = false;
  EXPECT_EQ(render("  {% if true %}\nx\n  {% endif %}\n", ojson::object(), plain), "  \nx\n  ");
}

TEST(JinjaWhitespace, DashAndPlusModifiers) {
  EXPECT_EQ(render("a\n\n  {%- if true -%}\n\n  b  \n{%- endif %}"), "ab");
  EXPECT_EQ(render("x  {{- 1 -}}  y"), "x1y");
  EXPECT_EQ(render("  {%+ if true %}k{% endif %}"), "  k");
  EXPECT_EQ(render("{% if true +%}\nk{% endif %}"), "\nk");
  EXPECT_EQ(render("a  {#- note -#}  b"), "ab");
}

TEST(JinjaWhitespace, NewlinesNormalizedAndFinalNewlineDropped) {
  EXPECT_EQ(render("a\r\nb\rc\n"), "a\nb\nc");
  EXPECT_EQ(render("a\n\n"), "a\n");
}

// ---- statements --------------------------------------------------------------------------

TEST(JinjaLoops, LoopVariables) {
  EXPECT_EQ(render("{% for x in 'abc' %}{{ loop.index }}{{ x }}{% if not loop.last %},{% endif %}{% endfor %}"), "1a,2b,3c");
  EXPECT_EQ(render("{% for x in [1,2,3] %}{{ loop.revindex }}{{ loop.length }}{% endfor %}"), "332313");
  EXPECT_EQ(render("{% for x in [1,2] %}{{ loop.previtem is defined }}{{ loop.nextitem }}{% endfor %}"), "False2True");
  EXPECT_EQ(render("{% for x in [1,2,3,4] if x is even %}{{ x }}{{ loop.first }}{% endfor %}"), "2True4False");
  EXPECT_EQ(render("{% for x in [] %}a{% else %}b{% endfor %}"), "b");
  EXPECT_EQ(render("{% for a in [1,2] %}{% for b in [3,4] %}{{ a * b }}{% if b == 3 %}{% continue %}{% endif %};{% endfor %}{% endfor %}"),
            "34;68;");
}

TEST(JinjaLoops, ScopeIsPerIteration) {
  EXPECT_EQ(render("{% set n = 0 %}{% for i in [1,2] %}{% set n = n + i %}{{ n }}{% endfor %}{{ n }}"), "120");
  EXPECT_EQ(render("{% set ns = namespace(n=0) %}{% for i in [1,2] %}{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}"), "3");
}

TEST(JinjaSet, BlockSetAndTuples) {
  EXPECT_EQ(render("{% set x %}  hi {{ 1 + 1 }}{% endset %}[{{ x }}]"), "[  hi 2]");
  EXPECT_EQ(render("{% set a, b = 'xy' %}{{ b }}{{ a }}"), "yx");
  EXPECT_EQ(render("{% set t = (1, 2) %}{{ t[1] }}{{ t|length }}"), "22");
}

TEST(JinjaMacros, DefaultsCallerAndRecursion) {
  EXPECT_EQ(render("{% macro g(name, greeting='Hi') %}{{ greeting }} {{ name }}{% endmacro %}{{ g('A') }}/{{ g('B', greeting='Yo') }}"),
            "Hi A/Yo B");
  EXPECT_EQ(render("{% macro wrap() %}<{{ caller() }}>{% endmacro %}{% call wrap() %}in{% endcall %}"), "<in>");
  EXPECT_EQ(render("{% macro f(n) %}{% if n %}{{ n }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(3) }}"), "321");
}

// ---- expressions ------------------------------------------------------------------------

TEST(JinjaExpr, Slicing) {
  ojson v = ojson::parse(R"({"xs": [0, 1, 2, 3, 4], "s": "héllo"})");
  EXPECT_EQ(render("{{ xs[::-1] }}", v), "[4, 3, 2, 1, 0]");
  EXPECT_EQ(render("{{ xs[1:] }}{{ xs[:2] }}{{ xs[-2:] }}{{ xs[1:4:2] }}", v), "[1, 2, 3, 4][0, 1][3, 4][1, 3]");
  EXPECT_EQ(render("{{ s[::-1] }}|{{ s[1] }}|{{ s[-3:] }}", v), "olléh|é|llo");
  EXPECT_EQ(render("{{ xs[10:] }}{{ xs[-10:1] }}", v), "[][0]");
}

TEST(JinjaExpr, PythonPrinting) {
  EXPECT_EQ(render("{{ 1.0 }} {{ 0.1 }} {{ 1e22 }} {{ 1.5e-7 }} {{ 2**62 }} {{ 3/2 }} {{ none }} {{ true }}"),
            "1.0 0.1 1e+22 1.5e-07 4611686018427387904 1.5 None True");
  EXPECT_EQ(render("{{ {'a': [1, 'b'], 'c': none} }}"), "{'a': [1, 'b'], 'c': None}");
  EXPECT_EQ(render("{{ [\"it's\"] }}"), "[\"it's\"]");
}

TEST(JinjaExpr, TestsAndOperators) {
  EXPECT_EQ(render("{{ x is defined }}{{ x is none }}{{ y is none }}{{ y is not none }}", ojson::parse(R"({"y": null})")),
            "FalseFalseTrueFalse");
  EXPECT_EQ(render("{{ 'ab' in 'cabd' }}{{ 2 not in [1] }}{{ 1 < 2 < 3 }}{{ 3 > 2 > 2 }}"), "TrueTrueTrueFalse");
  EXPECT_EQ(render("{{ 'a' ~ 1 ~ none }}{{ 7 // 2 }}{{ -7 // 2 }}{{ 7 % 3 }}{{ 2 ** 3 ** 2 }}"), "a1None3-4164");
  EXPECT_EQ(render("{{ (1 + 2) * 3 - -1 }}{{ not false and true }}"), "10True");
}

TEST(JinjaFilters, ToJsonMatchesPythonJsonDumps) {
  ojson v = ojson::parse(R"({"t": {"name": "f", "p": {"x": [1, 2.5, true, null], "é": "ü\n\"q\""}, "e": {}, "l": []}})");
  EXPECT_EQ(render("{{ t | tojson }}", v),
            "{\"name\": \"f\", \"p\": {\"x\": [1, 2.5, true, null], \"é\": \"ü\\n\\\"q\\\"\"}, \"e\": {}, \"l\": []}");
  EXPECT_EQ(render("{{ t.p | tojson(indent=2) }}", v),
            "{\n  \"x\": [\n    1,\n    2.5,\n    true,\n    null\n  ],\n  \"é\": \"ü\\n\\\"q\\\"\"\n}");
  EXPECT_EQ(render("{{ t.p.x | tojson(separators=(',', ':')) }}", v), "[1,2.5,true,null]");
  EXPECT_EQ(render("{{ 'é' | tojson(ensure_ascii=true) }}"), "\"\\u00e9\"");
}

TEST(JinjaFilters, Common) {
  EXPECT_EQ(render("{{ '  a b  ' | trim }}|{{ 'ab' | upper }}|{{ 'AB' | lower }}|{{ 'ab cd' | title }}|{{ 'aB' | capitalize }}"),
            "a b|AB|ab|Ab Cd|Ab");
  EXPECT_EQ(render("{{ [3, 1, 2] | sort | join('-') }}|{{ [1, 2] | first }}{{ [1, 2] | last }}|{{ 'abc' | list }}"),
            "1-2-3|12|['a', 'b', 'c']");
  EXPECT_EQ(render("{{ {'b': 1, 'a': 2} | items | list }}|{{ x | default('d') }}|{{ 'a.b' | replace('.', '/') }}"),
            "[('b', 1), ('a', 2)]|d|a/b");
  EXPECT_EQ(render("{{ ms | selectattr('r', 'equalto', 'u') | map(attribute='c') | join(',') }}",
                   ojson::parse(R"({"ms": [{"r": "u", "c": 1}, {"r": "a", "c": 2}, {"r": "u", "c": 3}]})")),
            "1,3");
  EXPECT_EQ(render("{{ '3' | int + 1 }}{{ 2 | string }}{{ '<' | e }}{{ '<' | safe }}"), "42&lt;<");
}

TEST(JinjaMethods, StringMethods) {
  EXPECT_EQ(render("{{ 'a</think>b</think>c'.split('</think>')[-1] }}|{{ '\\n\\nx\\n'.lstrip('\\n') }}|{{ ' x '.strip() }}"),
            "c|x\n|x");
  EXPECT_EQ(render("{{ 'abc'.startswith('ab') }}{{ 'abc'.endswith('bc') }}{{ 'a-b'.replace('-', '+') }}{{ 'Ab'.upper() }}"),
            "TrueTruea+bAB");
  EXPECT_EQ(render("{{ 'x{}y{k}'.format(1, k=2) }}"), "x1y2");
}

// ---- errors and limits ---------------------------------------------------------------------

TEST(JinjaErrors, SyntaxErrorsNameLineAndColumn) {
  std::string e = error_of("line one\n{% if true %}\nno end");
  EXPECT_NE(e.find("t:"), std::string::npos);
  EXPECT_NE(e.find("endif"), std::string::npos) << e;
  e = error_of("ok\n  {{ x | nosuch }}");
  EXPECT_EQ(e.rfind("t:2:", 0), 0u) << e;
  EXPECT_NE(e.find("No filter named 'nosuch'"), std::string::npos) << e;
  EXPECT_NE(error_of("{% for x in y %}").find("endfor"), std::string::npos);
  EXPECT_NE(error_of("{{ 1 +* 2 }}"), "");
  EXPECT_NE(error_of("{{ [1, 2 }}"), "");
  EXPECT_NE(error_of("{{ 'abc }}"), "");
  EXPECT_NE(error_of("{{ x.__class__.__mro__ }}", ojson::parse(R"({"x": "s"})")), "");
  EXPECT_NE(error_of("{% include 'x' %}"), "");
  EXPECT_NE(error_of("{% macro %}{% endmacro %}"), "");
  EXPECT_NE(error_of("{{ }}"), "");
  EXPECT_NE(error_of("{% set %}"), "");
  EXPECT_NE(error_of("{% endset %}"), "");
}

TEST(JinjaErrors, RuntimeErrorsNameLine) {
  std::string e = error_of("a\nb {{ 1 / 0 }}");
  EXPECT_EQ(e.rfind("t:2:", 0), 0u) << e;
  e = error_of("{{ raise_exception('boom') }}");
  EXPECT_NE(e.find("boom"), std::string::npos);
  try {
    render("{{ raise_exception('boom') }}");
  } catch (const TemplateRaise& r) {
    EXPECT_EQ(r.message(), "boom");
  }
}

TEST(JinjaLimits, RunawayRecursionIsAnError) {
  std::string e = error_of("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}");
  EXPECT_NE(e.find("recursion"), std::string::npos) << e;
}

TEST(JinjaLimits, DeepNestingIsAnErrorNotACrash) {
  std::string parens(5000, '(');
  EXPECT_NE(error_of("{{ " + parens + "1" + std::string(5000, ')') + " }}"), "");
  std::string ifs;
  for (int i = 0; i < 5000; ++i) ifs += "{% if true %}";
  EXPECT_NE(error_of(ifs), "");
  std::string chain = "{{ 1";
  for (int i = 0; i < 100000; ++i) chain += " + 1";
  EXPECT_NE(error_of(chain + " }}"), "");
  std::string nots = "{{ ";
  for (int i = 0; i < 100000; ++i) nots += "not ";
  EXPECT_NE(error_of(nots + "1 }}"), "");
  std::string lists(3000, '[');
  EXPECT_NE(error_of("{{ " + lists + std::string(3000, ']') + " }}"), "");
}

TEST(JinjaLimits, WorkAndSizeAreBounded) {
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_NE(error_of("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"), "");
  EXPECT_NE(error_of("{{ range(1000000) }}"), "");
  EXPECT_NE(error_of("{% set s = 'x' * 100000 %}{% for i in range(100000) %}{{ s }}{% endfor %}"), "");
  EXPECT_NE(error_of("{{ 'ab' * 9000000000000 }}"), "");
  EXPECT_NE(error_of("{{ [1] * 9000000000000 }}"), "");
  EXPECT_NE(error_of("{{ 10 ** 100 }}"), "");
  Options small;
  small.limits.max_output_bytes = 1000;
  EXPECT_NE(error_of("{% for i in range(1000) %}xx{% endfor %}", ojson::object(), small).find("exceeds"), std::string::npos);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 20.0);
}

TEST(JinjaTemplate, ReusableAcrossRenders) {
  Template t("{% macro m(x) %}[{{ x }}]{% endmacro %}{{ m(v) }}", "reuse");
  EXPECT_EQ(t.render(ojson::parse(R"({"v": 1})")), "[1]");
  EXPECT_EQ(t.render(ojson::parse(R"({"v": "two"})")), "[two]");
  EXPECT_THROW(t.render(ojson::parse("[1]")), Error);
}

}  // namespace
}  // namespace kestrel::jinja
