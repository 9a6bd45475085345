#include "text/spm_merges.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string_view>
#include <unordered_map>

#include "text/utf8.h"

namespace kestrel::text {

std::vector<std::pair<std::string, std::string>> merges_from_scores(const std::vector<std::string>& tokens,
                                                                    const std::vector<float>& scores) {
  // As Python dicts built from the list: a repeated token keeps its last id and its last score,
  // but the place of its first appearance.
  std::unordered_map<std::string_view, size_t> id, score_of;
  std::vector<size_t> order;
  for (size_t i = 0; i < tokens.size(); ++i) {
    id[tokens[i]] = i;
    if (score_of.emplace(tokens[i], i).second) order.push_back(i);
    else score_of[tokens[i]] = i;
  }
  struct Merge {
    std::string_view left, right;
    float score;
    size_t left_len, right_len;  // code points
  };
  std::vector<Merge> merges;
  std::vector<size_t> cuts;  // byte offsets of code point boundaries
  for (size_t i : order) {
    const std::string_view t = tokens[i];
    float score = scores[score_of[t]];
    if (std::isnan(score)) score = -std::numeric_limits<float>::infinity();  // keeps the sort well defined
    cuts.clear();
    for (size_t b = 0; b < t.size(); b += utf8_len(static_cast<unsigned char>(t[b]))) cuts.push_back(b);
    const size_t first = merges.size();
    for (size_t k = 1; k < cuts.size(); ++k) {
      const std::string_view l = t.substr(0, cuts[k]), r = t.substr(cuts[k]);
      if (id.count(l) && id.count(r)) merges.push_back({l, r, score, k, cuts.size() - k});
    }
    std::sort(merges.begin() + std::ptrdiff_t(first), merges.end(), [&](const Merge& a, const Merge& b) {
      return std::pair(id.at(a.left), id.at(a.right)) < std::pair(id.at(b.left), id.at(b.right));
    });
  }
  std::stable_sort(merges.begin(), merges.end(), [](const Merge& a, const Merge& b) {
    if (a.score != b.score) return a.score > b.score;
    if (a.left_len != b.left_len) return a.left_len > b.left_len;
    return a.right_len > b.right_len;
  });
  std::vector<std::pair<std::string, std::string>> out;
  out.reserve(merges.size());
  for (const Merge& m : merges) out.emplace_back(m.left, m.right);
  return out;
}

}  // namespace kestrel::text
