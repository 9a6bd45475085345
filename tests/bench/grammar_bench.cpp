// The cost of structured outputs per generated token on a real tokenizer: `kestrel_grammar_bench
// TOKENIZER_JSON [VOCAB]` builds the vocabulary's index, compiles a JSON schema and any JSON
// object, then walks valid replies token by token, timing what the engine adds per token of a
// constrained choice: accepting the token and computing the next mask (GrammarConstraint::accept),
// and masking the logits (apply_token_mask). Prints the figures; not a test (no thresholds).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <tuple>
#include <vector>

#include "runtime/sampler.h"
#include "server/grammar.h"
#include "text/tokenizer.h"

using namespace kestrel;
using clk = std::chrono::steady_clock;

static double us_since(clk::time_point t) { return std::chrono::duration<double, std::micro>(clk::now() - t).count(); }

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s TOKENIZER_JSON [VOCAB]\n", argv[0]);
    return 2;
  }
  const text::Tokenizer tok = text::Tokenizer::from_file(argv[1]);
  const int64_t vocab = argc > 2 ? std::atoll(argv[2]) : int64_t(tok.vocab_size());
  std::vector<int32_t> stop;
  for (const char* s : {"<|im_end|>", "<|endoftext|>", "<｜end▁of▁sentence｜>", "</s>", "<|eot_id|>"})
    if (tok.token_id(s) >= 0) stop.push_back(tok.token_id(s));
  server::Grammars g(tok, vocab, stop);
  const auto schema = nlohmann::ordered_json::parse(R"({
    "type": "object",
    "properties": {
      "name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"},
      "role": {"enum": ["admin", "user", "guest"]},
      "tags": {"type": "array", "items": {"type": "string"}},
      "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                  "zip": {"type": "string"}}, "required": ["street", "city"]}
    },
    "required": ["name", "age", "role", "address"]})");
  auto t0 = clk::now();
  const auto by_schema = g.json_schema(schema, false, "schema");
  const double compile_schema_ms = us_since(t0) / 1000 - g.setup_ms();
  t0 = clk::now();
  const auto any_object = g.json_object();
  const double compile_object_ms = us_since(t0) / 1000;
  const std::string reply =
      R"({"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "role": "admin", "tags": ["math", "poetry", )"
      R"("engines"], "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH"}})";
  const std::vector<int32_t> ids = tok.encode(reply, false, false);
  std::printf("vocabulary %lld tokens (tokenizer %zu), index built in %.1f ms\n", (long long)vocab, tok.vocab_size(),
              g.setup_ms());
  std::printf("compile: the schema %.1f ms, any JSON object %.1f ms; reply of %zu tokens\n", compile_schema_ms,
              compile_object_ms, ids.size());
  std::vector<float> logits(static_cast<size_t>(vocab));
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = float(int(i * 2654435761u % 1000)) / 100.0f;
  for (const auto& [name, c] : {std::pair{"json_schema", by_schema}, std::pair{"json_object", any_object}}) {
    std::vector<double> accept, mask;
    for (int round = 0; round < 20; ++round) {
      auto m = c();
      for (int32_t id : ids) {
        std::vector<float> l = logits;
        auto t = clk::now();
        apply_token_mask(l, m->allowed());
        mask.push_back(us_since(t));
        t = clk::now();
        if (!m->accept(id)) {
          std::fprintf(stderr, "%s: token %d refused\n", name, id);
          return 1;
        }
        accept.push_back(us_since(t));
      }
    }
    auto stats = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      double sum = 0;
      for (double x : v) sum += x;
      return std::tuple{sum / double(v.size()), v[v.size() / 2], v[v.size() * 99 / 100], v.back()};
    };
    const auto [am, a50, a99, amax] = stats(accept);
    const auto [mm, m50, m99, mmax] = stats(mask);
    std::printf("%s: accept + next mask: mean %.1f us, median %.1f, p99 %.1f, max %.1f; "
                "masking the logits: mean %.1f us, p99 %.1f\n",
                name, am, a50, a99, amax, mm, m99);
  }
  return 0;
}
