// Tool calls parsed from arbitrary generated text. The first byte picks the format and the second
// where the text is cut; the content and calls must be the same for the text whole, cut there, and
// (short texts) fed byte by byte: never a crash, an exception, or a result that depends on the cut.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "server/tool_calls.h"

namespace {

using kestrel::ToolCall;
using kestrel::ToolCallParser;
using kestrel::ToolFormat;

std::string parse(ToolFormat f, const std::vector<std::string_view>& pieces, std::vector<ToolCall>& calls) {
  ToolCallParser p(f, {{"f", {{"n", "integer"}, {"s", "string"}}}});
  std::string content;
  for (std::string_view s : pieces) content += p.push(s, calls);
  return content + p.finish(calls);
}

bool same(const std::vector<ToolCall>& a, const std::vector<ToolCall>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].name != b[i].name || a[i].arguments != b[i].arguments) return false;
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const ToolFormat f = ToolFormat(data[0] % 5);
  const std::string_view text(reinterpret_cast<const char*>(data + 2), size - 2);
  const size_t cut = text.empty() ? 0 : data[1] % (text.size() + 1);
  std::vector<ToolCall> whole, split;
  const std::string a = parse(f, {text}, whole);
  const std::string b = parse(f, {text.substr(0, cut), text.substr(cut)}, split);
  if (a != b || !same(whole, split)) std::abort();
  if (text.size() <= 512) {
    std::vector<std::string_view> bytes;
    for (size_t i = 0; i < text.size(); ++i) bytes.push_back(text.substr(i, 1));
    std::vector<ToolCall> each;
    if (parse(f, bytes, each) != a || !same(whole, each)) std::abort();
  }
  return 0;
}
