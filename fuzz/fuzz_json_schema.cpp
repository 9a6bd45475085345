// JSON schemas from clients compiled into grammars (server/grammar.h) over the qwen3-chat
// fixture's tokenizer: the first byte picks strict (& 1) and what is compiled (/ 2 % 3: the
// schema as response_format, as a tool's parameters in Qwen3's format, in the JSON form); the
// rest is the schema. Invalid schemas must be a RequestError, never a crash or another exception;
// a compiled grammar's matcher then follows its first allowed token for a few steps, each accepted.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "runtime/engine.h"
#include "server/grammar.h"
#include "server/openai_api.h"
#include "text/tokenizer.h"

namespace {

using kestrel::ToolFormat;
using kestrel::server::Grammars;
using json = nlohmann::ordered_json;

struct Setup {
  kestrel::text::Tokenizer tok = kestrel::text::Tokenizer::from_file(KESTREL_FUZZ_TOKENIZER);
  Grammars grammars{tok, 256, {102, 103}};
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Setup* s = new Setup;
  if (size < 1) return 0;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  // The request parser's limit on nesting holds for schemas too.
  if (kestrel::server::json_nesting(text) > kestrel::server::kMaxJsonNesting) return 0;
  const json schema = json::parse(text, nullptr, false);
  if (schema.is_discarded() || !schema.is_object()) return 0;
  const bool strict = data[0] & 1;
  try {
    kestrel::server::CompiledConstraint c;
    switch (data[0] / 2 % 3) {
      case 0: c = s->grammars.json_schema(schema, strict, "schema"); break;
      default: {
        json tools = json::array({{{"type", "function"}, {"function", {{"name", "f"}, {"parameters", schema}, {"strict", strict}}}}});
        c = s->grammars.tool_calls(tools, data[0] / 2 % 3 == 1 ? ToolFormat::Hermes : ToolFormat::None, "", true);
      }
    }
    auto m = c();
    for (int step = 0; step < 32 && !m->ended(); ++step) {
      const auto mask = m->allowed();
      int32_t next = -1;
      for (size_t w = 0; w < mask.size() && next < 0; ++w)
        if (mask[w]) next = int32_t(w * 32 + size_t(__builtin_ctz(mask[w])));
      if (next < 0) abort();  // a grammar that is not complete allows some token
      if (!m->accept(next)) abort();
    }
  } catch (const kestrel::RequestError&) {
  }
  return 0;
}
