#include "server/metrics.h"

#include <cstdio>

namespace kestrel::server {
namespace {

std::string num(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

void gauge(std::string& out, const char* name, const char* help, const char* type, double v) {
  out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n" + name + " " + num(v) + "\n";
}

}  // namespace

void Histogram::observe(double v) {
  size_t i = 0;
  while (i < bounds_.size() && v > bounds_[i]) ++i;
  ++counts_[i];
  sum_ += v;
  ++count_;
}

void Histogram::render(std::string& out, const std::string& name, const std::string& help) const {
  out += "# HELP " + name + " " + help + "\n# TYPE " + name + " histogram\n";
  uint64_t cum = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cum += counts_[i];
    out += name + "_bucket{le=\"" + num(bounds_[i]) + "\"} " + std::to_string(cum) + "\n";
  }
  out += name + "_bucket{le=\"+Inf\"} " + std::to_string(count_) + "\n";
  out += name + "_sum " + num(sum_) + "\n" + name + "_count " + std::to_string(count_) + "\n";
}

void Metrics::request(const std::string& endpoint, int status) {
  std::lock_guard<std::mutex> lock(mu_);
  ++requests_[{endpoint, status}];
}

void Metrics::first_token(double s) {
  std::lock_guard<std::mutex> lock(mu_);
  ttft_.observe(s);
}

void Metrics::inter_token(double s) {
  std::lock_guard<std::mutex> lock(mu_);
  itl_.observe(s);
}

void Metrics::request_time(double s) {
  std::lock_guard<std::mutex> lock(mu_);
  e2e_.observe(s);
}

std::string Metrics::render(const EngineStats& e, const HttpStats& h) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out = "# HELP kestrel_requests_total HTTP requests by endpoint and status.\n# TYPE kestrel_requests_total counter\n";
  for (const auto& [key, n] : requests_)
    out += "kestrel_requests_total{endpoint=\"" + key.first + "\",status=\"" + std::to_string(key.second) + "\"} " +
           std::to_string(n) + "\n";
  gauge(out, "kestrel_prompt_tokens_total", "Prompt tokens run.", "counter", double(e.prompt_tokens));
  gauge(out, "kestrel_prompt_tokens_cached_total", "Prompt tokens whose KV came from the prefix cache.", "counter",
        double(e.cached_tokens));
  gauge(out, "kestrel_prefix_cache_queries_total", "Prompts looked up in the prefix cache.", "counter",
        double(e.prefix.lookups));
  gauge(out, "kestrel_prefix_cache_query_tokens_total", "Prompt positions the prefix cache was asked for.", "counter",
        double(e.prefix.lookup_tokens));
  gauge(out, "kestrel_prefix_cache_hit_tokens_total", "Prompt positions found in the prefix cache.", "counter",
        double(e.prefix.hit_tokens));
  gauge(out, "kestrel_prefix_cache_evictions_total", "Cached KV blocks given to other positions.", "counter",
        double(e.prefix.evictions));
  gauge(out, "kestrel_prefix_cache_blocks", "KV blocks of 16 positions the prefix cache holds.", "gauge",
        double(e.prefix.cached_blocks));
  gauge(out, "kestrel_generation_tokens_total", "Tokens generated.", "counter", double(e.generated_tokens));
  gauge(out, "kestrel_speculation_verifications_total", "Checks of drafted tokens (--speculative).", "counter",
        double(e.speculation.verifications));
  gauge(out, "kestrel_speculation_draft_tokens_total", "Tokens drafted by prompt lookup.", "counter",
        double(e.speculation.drafted));
  gauge(out, "kestrel_speculation_accepted_tokens_total", "Drafted tokens the checks accepted.", "counter",
        double(e.speculation.accepted));
  gauge(out, "kestrel_speculation_acceptance_rate", "Accepted drafted tokens over drafted tokens (0 before any).",
        "gauge", e.speculation.acceptance());
  gauge(out, "kestrel_speculation_mean_accepted_length",
        "Tokens a check yields on average: its accepted drafts and the target's own token (0 before any).", "gauge",
        e.speculation.mean_accepted_length());
  gauge(out, "kestrel_requests_running", "Sequences in the running batch.", "gauge", e.running);
  gauge(out, "kestrel_requests_waiting", "Sequences queued for admission (n per request of n choices).", "gauge", e.waiting);
  gauge(out, "kestrel_kv_positions_used", "KV cache positions reserved by running sequences.", "gauge", double(e.kv_used));
  gauge(out, "kestrel_kv_positions_capacity", "KV cache positions in all.", "gauge", double(e.kv_capacity));
  gauge(out, "kestrel_http_connections", "HTTP connections open.", "gauge", double(h.open));
  gauge(out, "kestrel_http_connections_accepted_total", "HTTP connections accepted.", "counter", double(h.accepted));
  gauge(out, "kestrel_http_connections_refused_total",
        "HTTP connections refused over --max-connections or --max-connections-per-client.", "counter", double(h.refused));
  gauge(out, "kestrel_http_timeouts_total", "HTTP connections cut by a timeout (idle, headers, body or write).", "counter",
        double(h.timed_out));
  gauge(out, "kestrel_http_client_gone_total", "Replies cancelled because their client went away.", "counter",
        double(h.client_gone));
  ttft_.render(out, "kestrel_time_to_first_token_seconds", "Time from request to first generated token.");
  itl_.render(out, "kestrel_inter_token_latency_seconds", "Time between consecutive generated tokens.");
  e2e_.render(out, "kestrel_request_duration_seconds", "Time from request to its last token.");
  return out;
}

}  // namespace kestrel::server
