// Chat replies split from arbitrary generated text (server/chat_reply.h): reasoning, content and
// tool calls. The first byte picks the tool format (% 5) and the reasoning (/ 5 % 3: none, a reply
// that may open <think>, a reply that starts inside it), the second where the text is cut; the
// pieces must be the same for the text whole, cut there, and (short texts) fed byte by byte: never
// a crash, an exception, or a result that depends on the cut.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "server/chat_reply.h"

namespace {

using kestrel::ToolCall;
using kestrel::ToolFormat;
using kestrel::server::ChatReply;
using kestrel::server::ReplyPieces;

ReplyPieces parse(const ChatReply& proto, const std::vector<std::string_view>& pieces) {
  ChatReply r = proto;
  ReplyPieces all;
  auto add = [&](ReplyPieces p) {
    all.reasoning += p.reasoning;
    all.content += p.content;
    all.calls.insert(all.calls.end(), p.calls.begin(), p.calls.end());
  };
  for (std::string_view s : pieces) add(r.push(s));
  add(r.finish());
  return all;
}

bool same(const ReplyPieces& a, const ReplyPieces& b) {
  if (a.reasoning != b.reasoning || a.content != b.content || a.calls.size() != b.calls.size()) return false;
  for (size_t i = 0; i < a.calls.size(); ++i)
    if (a.calls[i].name != b.calls[i].name || a.calls[i].arguments != b.calls[i].arguments) return false;
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const ToolFormat f = ToolFormat(data[0] % 5);
  const int mode = data[0] / 5 % 3;
  const std::optional<bool> reasoning = mode == 0 ? std::nullopt : std::optional<bool>(mode == 2);
  const ChatReply proto(reasoning, f, {{"f", {{"n", "integer"}, {"s", "string"}}}});
  const std::string_view text(reinterpret_cast<const char*>(data + 2), size - 2);
  const size_t cut = text.empty() ? 0 : data[1] % (text.size() + 1);
  const ReplyPieces whole = parse(proto, {text});
  if (!same(whole, parse(proto, {text.substr(0, cut), text.substr(cut)}))) std::abort();
  if (text.size() <= 512) {
    std::vector<std::string_view> bytes;
    for (size_t i = 0; i < text.size(); ++i) bytes.push_back(text.substr(i, 1));
    if (!same(whole, parse(proto, bytes))) std::abort();
  }
  return 0;
}
