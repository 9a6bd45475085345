// Server metrics in the Prometheus text format: requests by endpoint and status, tokens in and
// out, time to first token and inter-token latency histograms, the engine's queue and KV use, its
// speculation's checks (drafted and accepted tokens), and the HTTP front's connections.
#pragma once
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/engine.h"
#include "server/http_front.h"

namespace kestrel::server {

class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}
  void observe(double v);
  void render(std::string& out, const std::string& name, const std::string& help) const;

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bucket, not cumulative; the last is +Inf
  double sum_ = 0;
  uint64_t count_ = 0;
};

class Metrics {
 public:
  void request(const std::string& endpoint, int status);
  void first_token(double seconds);
  void inter_token(double seconds);
  void request_time(double seconds);
  std::string render(const EngineStats& engine, const HttpStats& http) const;

 private:
  mutable std::mutex mu_;
  std::map<std::pair<std::string, int>, uint64_t> requests_;
  Histogram ttft_{{0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30}};
  Histogram itl_{{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1}};
  Histogram e2e_{{0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120}};
};

}  // namespace kestrel::server
