// The server's OpenAPI 3 description (GET /openapi.json): what clients and API fuzzers
// (schemathesis, in the tests) are told the endpoints accept and answer.
#pragma once
#include <cstdint>
#include <string>

#include "server/openai_api.h"

namespace kestrel::server {

// `max_n`: the most choices a request may ask for here (kMaxChoices, or fewer with a smaller --max-batch).
json openapi_spec(const std::string& model_name, int64_t context, int max_n);

}  // namespace kestrel::server
