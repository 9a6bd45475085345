// One HTTP/1.1 request read by Boost.Beast's parser into plain strings, under the front's limits:
// header bytes (Beast's header_limit, request line included), header field count (counted here:
// Beast has no such limit) and body bytes (set once the headers are in, so that the API key is
// checked before any limit on a body that may never be read; Beast applies it to chunked bodies
// chunk by chunk).
#pragma once
#include <boost/beast/http/basic_parser.hpp>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace kestrel::server {

class RequestParser : public boost::beast::http::basic_parser<true> {
 public:
  RequestParser(uint32_t max_header_bytes, int max_headers);

  // Before the body is read: the most bytes it may have (error::body_limit beyond).
  void limit_body(uint64_t max_body) { body_limit(max_body); }

  std::string method, target;
  int version = 11;
  std::vector<std::pair<std::string, std::string>> fields;
  std::string body;
  bool too_many_fields = false;  // why a header_limit error came, when it was the count

 private:
  void on_request_impl(boost::beast::http::verb, boost::beast::string_view method, boost::beast::string_view target,
                       int version, boost::beast::error_code&) override;
  void on_response_impl(int, boost::beast::string_view, int, boost::beast::error_code&) override {}
  void on_field_impl(boost::beast::http::field, boost::beast::string_view name, boost::beast::string_view value,
                     boost::beast::error_code& ec) override;
  void on_header_impl(boost::beast::error_code&) override {}
  void on_body_init_impl(boost::optional<std::uint64_t> const& length, boost::beast::error_code&) override;
  std::size_t on_body_impl(boost::beast::string_view data, boost::beast::error_code&) override;
  void on_chunk_header_impl(std::uint64_t, boost::beast::string_view, boost::beast::error_code&) override {}
  std::size_t on_chunk_body_impl(std::uint64_t, boost::beast::string_view data, boost::beast::error_code&) override;
  void on_finish_impl(boost::beast::error_code&) override {}

  int max_headers_;
};

}  // namespace kestrel::server
