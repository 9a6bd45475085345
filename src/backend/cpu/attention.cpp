#include "backend/cpu/attention.h"

#include <vector>

#include "backend/cpu/linear.h"
#include "backend/cpu/ops.h"

namespace kestrel::cpu {

void attention(const float* q, int64_t tokens, int64_t start, int64_t heads, int64_t kv_heads, int64_t head_dim,
               float scale, const KvCache& cache, int64_t layer, float* out, ThreadPool& pool) {
  const int64_t group = heads / kv_heads;
  pool.parallel_for(size_t(tokens * heads), 1, [&](size_t begin, size_t end) {
    thread_local std::vector<float> p;
    for (size_t job = begin; job < end; ++job) {
      const int64_t t = int64_t(job) / heads, h = int64_t(job) % heads, kvh = h / group;
      const int64_t len = start + t + 1;  // causal: positions 0..start+t
      const float* qv = q + (t * heads + h) * head_dim;
      p.resize(size_t(len));
      for (int64_t j = 0; j < len; ++j) p[size_t(j)] = dot(qv, cache.k(layer, j) + kvh * head_dim, head_dim) * scale;
      softmax(p.data(), len);
      float* o = out + (t * heads + h) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) o[d] = 0.0f;
      for (int64_t j = 0; j < len; ++j) {
        const float* vv = cache.v(layer, j) + kvh * head_dim;
        const float pj = p[size_t(j)];
        for (int64_t d = 0; d < head_dim; ++d) o[d] += pj * vv[d];
      }
    }
  });
}

}  // namespace kestrel::cpu
