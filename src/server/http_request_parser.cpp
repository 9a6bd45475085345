#include "server/http_request_parser.h"

#include <algorithm>
#include <boost/beast/http/error.hpp>

namespace kestrel::server {

namespace http = boost::beast::http;

RequestParser::RequestParser(uint32_t max_header_bytes, int max_headers) : max_headers_(max_headers) {
  header_limit(max_header_bytes);
  body_limit(boost::none);  // limit_body() sets it once the request is known to be allowed
}

void RequestParser::on_request_impl(http::verb, boost::beast::string_view m, boost::beast::string_view t, int v,
                                    boost::beast::error_code&) {
  method.assign(m.data(), m.size());
  target.assign(t.data(), t.size());
  version = v;
}

void RequestParser::on_field_impl(http::field, boost::beast::string_view name, boost::beast::string_view value,
                                  boost::beast::error_code& ec) {
  if (int(fields.size()) >= max_headers_) {
    too_many_fields = true;
    ec = http::error::header_limit;
    return;
  }
  fields.emplace_back(std::string(name.data(), name.size()), std::string(value.data(), value.size()));
}

void RequestParser::on_body_init_impl(boost::optional<std::uint64_t> const& length, boost::beast::error_code&) {
  // A declared length was checked against the limit before the body is read; a chunked body
  // grows as it comes.
  if (length) body.reserve(size_t(std::min<uint64_t>(*length, 1u << 20)));
}

std::size_t RequestParser::on_body_impl(boost::beast::string_view data, boost::beast::error_code&) {
  body.append(data.data(), data.size());
  return data.size();
}

std::size_t RequestParser::on_chunk_body_impl(std::uint64_t, boost::beast::string_view data, boost::beast::error_code&) {
  body.append(data.data(), data.size());
  return data.size();
}

}  // namespace kestrel::server
