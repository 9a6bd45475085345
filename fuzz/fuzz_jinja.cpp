// Jinja templates from arbitrary bytes: the first line (up to a newline) is a JSON object of
// variables when it parses as one, the rest is the template. Parsing and rendering give text or a
// kestrel::Error, never a crash, a hang or an absurd allocation.
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "common/error.h"
#include "text/jinja.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string input(reinterpret_cast<const char*>(data), size);
  nlohmann::ordered_json vars = nlohmann::ordered_json::object();
  std::string source = input;
  size_t nl = input.find('\n');
  if (nl != std::string::npos) {
    try {
      auto j = nlohmann::ordered_json::parse(input.substr(0, nl));
      if (j.is_object()) {
        vars = std::move(j);
        source = input.substr(nl + 1);
      }
    } catch (const nlohmann::json::exception&) {
    }
  }
  kestrel::jinja::Options opt;
  opt.limits.max_output_bytes = 1 << 20;
  opt.limits.max_steps = 200000;
  try {
    kestrel::jinja::Template t(source, "fuzz", opt);
    (void)t.render(vars);
  } catch (const kestrel::Error&) {
  }
  return 0;
}
