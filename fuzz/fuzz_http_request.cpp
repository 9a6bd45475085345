// HTTP requests from arbitrary bytes through the front's parser, under small limits. The first
// byte picks how the rest is cut into reads; the outcome (the request, or that it failed) must be
// the same as for the bytes read at once (but at the header limit's edge), the limits must hold,
// and nothing may crash.
#include <boost/beast/core/buffers_to_string.hpp>
#include <boost/beast/http/error.hpp>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "server/http_request_parser.h"

namespace {

using kestrel::server::RequestParser;
namespace http = boost::beast::http;

constexpr uint32_t kHeaderBytes = 1024;
constexpr int kHeaders = 8;
constexpr uint64_t kBody = 512;

struct Outcome {
  bool ok = false;
  bool header_limit = false;  // failed on the header's size
  std::string error, method, target, body;
  std::vector<std::pair<std::string, std::string>> fields;
  bool operator==(const Outcome&) const = default;
};

// Feeds the pieces as a connection would: bytes accumulate until the parser takes them; the body
// limit is set once the header is in.
Outcome parse(const std::vector<std::string_view>& pieces) {
  RequestParser p(kHeaderBytes, kHeaders);  // not eager: it stops after the header
  std::string pending;
  boost::beast::error_code ec;
  bool limited = false;
  for (std::string_view s : pieces) {
    pending.append(s);
    while (!pending.empty() && !p.is_done()) {
      const size_t used = p.put(boost::asio::buffer(pending), ec);
      pending.erase(0, used);
      if (ec == http::error::need_more) {
        ec = {};
        break;
      }
      if (ec) break;
      if (p.is_header_done() && !limited) {
        // As the connection does: a declared length over the limit is refused before the body
        // (Beast checks the limit against a declared length only while the header completes).
        if (const auto length = p.content_length(); length && *length > kBody) {
          ec = http::error::body_limit;
          break;
        }
        p.limit_body(kBody);
        p.eager(true);
        limited = true;
      } else if (used == 0) {
        break;
      }
    }
    if (ec || p.is_done()) break;
  }
  if (!ec && !p.is_done()) p.put_eof(ec);
  Outcome o;
  o.ok = !ec && p.is_done();
  o.error = ec ? ec.message() : "";
  o.header_limit = ec == http::error::header_limit && !p.too_many_fields;
  if (p.fields.size() > size_t(kHeaders)) std::abort();
  if (p.body.size() > kBody) std::abort();
  o.method = p.method;
  o.target = p.target;
  o.fields = p.fields;
  o.body = p.body;
  return o;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const size_t step = 1 + data[0] % 17;
  const std::string_view bytes(reinterpret_cast<const char*>(data + 1), size - 1);
  std::vector<std::string_view> pieces;
  for (size_t i = 0; i < bytes.size(); i += step) pieces.push_back(bytes.substr(i, step));
  const Outcome whole = parse({bytes}), cut = parse(pieces);
  // A header whose size sits at the limit may pass read whole and fail read in pieces (Beast
  // counts an unfinished header by the bytes it holds, and folded lines end later than they
  // seem): either answer is right there. Anything else must not depend on the reads.
  if (whole.header_limit != cut.header_limit) return 0;
  if (whole.ok != cut.ok || (whole.ok && !(whole == cut))) std::abort();
  return 0;
}
