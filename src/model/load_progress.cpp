#include "model/load_progress.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "common/mapped_file.h"
#include "formats/nvfp4.h"
#include "model/weights.h"

namespace kestrel {
namespace {

// The byte ranges a matrix view covers: its rows, and for NVFP4 and FP8 its separate scales.
void add_ranges(const Linear& l, std::vector<std::pair<const uint8_t*, size_t>>& out) {
  if (l.format == WeightFormat::NVFP4) {
    out.push_back({l.data, size_t(l.out) * size_t(l.in / 2)});
    out.push_back({l.scales, size_t(l.out) * size_t(l.in / kNvfp4Block)});
  } else if (l.format == WeightFormat::FP8) {
    out.push_back({l.data, size_t(l.out) * size_t(l.in)});
    out.push_back({l.scales, l.scale_bytes()});
  } else {
    out.push_back({l.data, l.bytes()});
  }
}

std::vector<std::pair<const uint8_t*, size_t>> layer_ranges(const LayerWeights& L) {
  std::vector<std::pair<const uint8_t*, size_t>> r;
  for (const Linear* l : L.attention_linears()) add_ranges(*l, r);
  auto ffn = [&](const GatedFfn& f) {
    for (const Linear* l : {&f.gate, &f.up, &f.down}) add_ranges(*l, r);
  };
  if (!L.is_moe) {
    ffn(L.mlp);
    return r;
  }
  add_ranges(L.moe.router, r);
  for (const auto& e : L.moe.experts) ffn(e);
  if (L.moe.has_shared) ffn(L.moe.shared);
  return r;
}

size_t total(const std::vector<std::pair<const uint8_t*, size_t>>& r) {
  size_t n = 0;
  for (const auto& [p, k] : r) n += k;
  return n;
}

}  // namespace

bool progress_shown(Progress p) { return p == Progress::On || (p == Progress::Auto && ::isatty(STDERR_FILENO)); }

size_t read_weights_with_progress(const Model& m, const std::string& label) {
  const ModelWeights& w = m.weights;
  std::vector<std::pair<const uint8_t*, size_t>> head;  // embedding and an untied LM head
  add_ranges(w.embed, head);
  if (w.lm_head.data != w.embed.data) add_ranges(w.lm_head, head);
  std::vector<std::vector<std::pair<const uint8_t*, size_t>>> layers;
  size_t all = total(head);
  for (const auto& L : w.layers) {
    layers.push_back(layer_ranges(L));
    all += total(layers.back());
  }
  const auto start = std::chrono::steady_clock::now();
  const double mb = 1e6;
  size_t done = 0, shown = 0;
  const long long n = (long long)layers.size();
  // Each line overwrites the previous one; spaces clear what a longer one left behind.
  auto show = [&](const std::string& line, const char* end) {
    std::fprintf(stderr, "\r%s%*s%s", line.c_str(), int(shown > line.size() ? shown - line.size() : 0), "", end);
    std::fflush(stderr);
    shown = line.size();
  };
  auto read = [&](const std::vector<std::pair<const uint8_t*, size_t>>& r) {
    for (const auto& [p, k] : r) read_pages(p, k);
    done += total(r);
  };
  char buf[512];
  read(head);
  for (long long i = 0; i < n; ++i) {
    read(layers[size_t(i)]);
    std::snprintf(buf, sizeof buf, "loading %s: layer %lld/%lld, %.0f/%.0f MB", label.c_str(), i + 1, n,
                  double(done) / mb, double(all) / mb);
    show(buf, "");
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::snprintf(buf, sizeof buf, "loaded %s: %lld layers, %.0f MB in %.1f s (%.0f MB/s)", label.c_str(), n,
                double(done) / mb, s, s > 0 ? double(done) / mb / s : 0.0);
  show(buf, "\n");
  return done;
}

}  // namespace kestrel
