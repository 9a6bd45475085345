// OpenAI request bodies from arbitrary bytes: an ApiRequest (whose messages can be handed to a
// template and whose response, tool calls included, can be built) or an ApiError with a 4xx
// status, never a crash or another exception.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "server/openai_api.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string body(reinterpret_cast<const char*>(data), size);
  using namespace kestrel::server;
  for (Endpoint e : {Endpoint::Completions, Endpoint::Chat}) {
    try {
      const ApiRequest r = parse_request(e, body);
      if (r.n < 1 || r.n > kMaxChoices) std::abort();
      Completion c;
      c.model = r.model;
      c.choices.resize(size_t(r.n));
      c.choices.back().text = r.prompt;
      (void)template_messages(r.messages, true);
      (void)template_messages(r.messages, false);
      (void)dump(response_json(e, c, r.top_logprobs >= 0));
      (void)sse(chunk_json(e, c, r.n - 1, r.prompt, {}, false, "", true, r.model));
      if (e == Endpoint::Chat) {
        c.choices[0].tool_calls.push_back({r.model, "{}", "call_0"});
        (void)dump(response_json(e, c, false));
        (void)sse(tool_call_chunk_json(c, 0, 0, c.choices[0].tool_calls[0], true));
      }
    } catch (const ApiError& err) {
      if (err.status < 400 || err.status >= 500) std::abort();
      (void)error_body(err);
    }
  }
  return 0;
}
