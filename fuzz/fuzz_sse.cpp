// Server-sent event streams from arbitrary bytes. The first byte picks how the rest is cut into
// reads; the events (and whether an overlong line throws kestrel::Error) must be the same as for
// the whole stream read at once, and a request tracked over those reads must give a consistent
// record: never a crash or another exception.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <vector>

#include "client/sse.h"
#include "client/stream.h"
#include "common/error.h"

namespace {

using kestrel::client::SseEvent;
using kestrel::client::SseParser;

// Feeds `pieces` to a parser with a small size limit; returns whether it threw.
bool parse(const std::vector<std::string_view>& pieces, std::vector<SseEvent>& out, bool& partial) {
  SseParser p(4096);
  try {
    for (std::string_view s : pieces) p.feed(s, out);
  } catch (const kestrel::Error&) {
    return true;
  }
  partial = p.partial();
  return false;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const size_t step = 1 + data[0] % 13;
  const std::string_view stream(reinterpret_cast<const char*>(data + 1), size - 1);
  std::vector<std::string_view> pieces;
  for (size_t i = 0; i < stream.size(); i += step) pieces.push_back(stream.substr(i, step));

  std::vector<SseEvent> whole, cut;
  bool whole_partial = false, cut_partial = false;
  const bool whole_threw = parse({stream}, whole, whole_partial);
  const bool cut_threw = parse(pieces, cut, cut_partial);
  if (whole_threw != cut_threw || whole != cut || whole_partial != cut_partial) std::abort();

  for (const SseEvent& e : whole) (void)kestrel::client::parse_chunk(e.data, e.event);

  kestrel::client::StreamTracker t(0.0);
  t.head(200, "text/event-stream");
  double now = 0;
  for (std::string_view s : pieces) {
    now += 0.001;
    if (!t.body(now, s)) break;
  }
  const kestrel::client::RequestRecord r = t.finish(now + 0.001, "");
  if (r.ok != r.error.empty()) std::abort();
  if (r.text_chunks > 0 && (r.ttft_s < 0 || r.itl_s.size() != size_t(r.text_chunks - 1))) std::abort();
  for (double v : r.itl_s)
    if (!(v >= 0)) std::abort();
  return 0;
}
