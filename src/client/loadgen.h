// `kestrel loadgen`: streaming requests from concurrent client threads against any
// OpenAI-compatible server, measured as their bytes arrive (cpp-httplib client).
//
// Each of `streams` threads sends one request at a time, taking the next request number until
// `requests` have been sent: POST /v1/completions (or /v1/chat/completions with `chat`) with
// stream: true, stream_options.include_usage: true, max_tokens and temperature 0, and request i's
// own synthetic prompt (synthetic_prompt(prompt_tokens, i)). A thread keeps its connection
// alive between its requests. Times are taken from one steady clock when the request is sent
// (connecting included) and when each read of the body returns; client/stream.h says what is
// measured from them, client/stats.h how it is summarized.
#pragma once
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "client/stats.h"
#include "client/stream.h"

namespace kestrel::client {

struct LoadgenOptions {
  std::string url = "http://127.0.0.1:8000";  // scheme://host[:port][/prefix]; a trailing /v1 is dropped
  std::string model;       // empty: the first model GET /v1/models lists
  std::string api_key;     // sent as "Authorization: Bearer KEY" when not empty
  bool chat = false;
  int streams = 8, requests = 64, prompt_tokens = 128, max_tokens = 128;
  double timeout_s = 300;  // per request, connecting included
};

struct LoadgenResult {
  LoadgenOptions options;  // as run (model filled in)
  std::string origin;      // scheme://host[:port] of the server
  std::string endpoint;    // the path requests went to
  std::vector<RequestRecord> records;  // by request number
  RunStats stats;
};

// Checks the options (throws kestrel::Error naming the flag).
void check_options(const LoadgenOptions& o);

// Runs the load. `progress` (may be empty) is called after each request with the number done;
// calls come from the client threads, one at a time.
LoadgenResult run_loadgen(LoadgenOptions o, const std::function<void(int done)>& progress = {});

// The options, the summary and every request record.
nlohmann::ordered_json result_json(const LoadgenResult& r);

}  // namespace kestrel::client
