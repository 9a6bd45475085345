#include "text/bpe.h"

#include <cstdio>
#include <mutex>
#include <queue>

#include "text/tokenizer_json.h"
#include "text/utf8.h"

namespace kestrel::text {
namespace {

constexpr size_t kCacheMaxWordBytes = 256;
constexpr size_t kCacheMaxEntries = 1 << 16;
// Vocabulary ids index a table; a file whose ids are far sparser than its entries is refused
// rather than allowed to allocate gigabytes.
constexpr int64_t kMaxIdGap = 1 << 20;

struct Symbol {
  int32_t id;
  int32_t prev, next;
  bool alive;
};

struct QueuedMerge {
  int32_t rank;
  int32_t pos;
  int32_t new_id;
  // std::priority_queue pops the largest: make that the lowest rank, then the leftmost position.
  bool operator<(const QueuedMerge& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
};

}  // namespace

std::unique_ptr<BpeModel> BpeModel::from_json(const nlohmann::json& j, const std::string& where) {
  auto m = std::make_unique<BpeModel>();
  const auto& vocab = tj::field(j, "vocab", where);
  const std::string vw = tj::sub(where, "vocab");
  if (!vocab.is_object()) fail(vw, ": must be an object of token -> id, got ", vocab.dump().substr(0, 80));
  int64_t max_id = -1;
  for (const auto& [tok, idj] : vocab.items()) {
    if (!idj.is_number_integer()) fail(vw, ": id of '", tok, "' must be an integer, got ", idj.dump().substr(0, 40));
    const int64_t id = idj.get<int64_t>();
    if (id < 0 || id > INT32_MAX) fail(vw, ": id of '", tok, "' is out of range: ", id);
    m->vocab_.emplace(tok, static_cast<int32_t>(id));
    max_id = std::max(max_id, id);
  }
  if (max_id >= static_cast<int64_t>(m->vocab_.size()) + kMaxIdGap)
    fail(vw, ": ids are too sparse (largest id ", max_id, " for ", m->vocab_.size(), " tokens)");
  m->id_to_token_.assign(static_cast<size_t>(max_id + 1), nullptr);
  for (const auto& [tok, id] : m->vocab_) m->id_to_token_[id] = &tok;

  m->prefix_ = tj::str_or(j, "continuing_subword_prefix", "", where);
  m->suffix_ = tj::str_or(j, "end_of_word_suffix", "", where);
  m->fuse_unk_ = tj::bool_or(j, "fuse_unk", false, where);
  m->byte_fallback_ = tj::bool_or(j, "byte_fallback", false, where);
  m->ignore_merges_ = tj::bool_or(j, "ignore_merges", false, where);
  if (tj::present(j, "unk_token")) {
    m->unk_token_ = tj::str(j, "unk_token", where);
    m->has_unk_ = true;
  }
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    m->byte_ids_[b] = m->token_id(name);
  }

  const std::string mw = tj::sub(where, "merges");
  const nlohmann::json empty = nlohmann::json::array();
  const auto& merges = tj::present(j, "merges") ? tj::array(j, "merges", where) : empty;
  m->merges_.reserve(merges.size());
  int32_t rank = 0;
  for (size_t i = 0; i < merges.size(); ++i) {
    const auto& e = merges[i];
    std::string a, b;
    if (e.is_string()) {
      const std::string line = e.get<std::string>();
      if (line.rfind("#version", 0) == 0) continue;
      const size_t sp = line.find(' ');
      if (sp == std::string::npos || line.find(' ', sp + 1) != std::string::npos)
        fail(tj::sub(mw, i), ": \"", line, "\" must be two tokens separated by one space");
      a = line.substr(0, sp);
      b = line.substr(sp + 1);
    } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
      a = e[0].get<std::string>();
      b = e[1].get<std::string>();
    } else {
      fail(tj::sub(mw, i), ": must be \"a b\" or [\"a\", \"b\"], got ", e.dump().substr(0, 80));
    }
    const int32_t ia = m->token_id(a), ib = m->token_id(b);
    if (ia < 0) fail(tj::sub(mw, i), ": token '", a, "' is not in the vocabulary");
    if (ib < 0) fail(tj::sub(mw, i), ": token '", b, "' is not in the vocabulary");
    if (b.size() < m->prefix_.size()) fail(tj::sub(mw, i), ": token '", b, "' is shorter than the subword prefix");
    const std::string joined = a + b.substr(m->prefix_.size());
    const int32_t inew = m->token_id(joined);
    if (inew < 0) fail(tj::sub(mw, i), ": merged token '", joined, "' is not in the vocabulary");
    // A repeated pair takes its last rank, as in the reference library.
    m->merges_[pair_key(ia, ib)] = Merge{rank++, inew};
  }
  return m;
}

int32_t BpeModel::token_id(std::string_view token) const {
  auto it = vocab_.find(token);
  return it == vocab_.end() ? -1 : it->second;
}

const std::string* BpeModel::token(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < id_to_token_.size() ? id_to_token_[id] : nullptr;
}

void BpeModel::merge_word(std::string_view w, std::vector<int32_t>& out) const {
  std::vector<Symbol> sym;
  sym.reserve(w.size());
  auto add = [&](int32_t id) { sym.push_back({id, int32_t(sym.size()) - 1, int32_t(sym.size()) + 1, true}); };
  int32_t unk_pending = -1;
  std::string s;
  for (size_t i = 0; i < w.size();) {
    const size_t n = utf8_len(static_cast<unsigned char>(w[i]));
    const bool first = i == 0, last = i + n >= w.size();
    s.assign(w.substr(i, n));
    if (!first && !prefix_.empty()) s.insert(0, prefix_);
    if (last && !suffix_.empty()) s += suffix_;
    i += n;
    const int32_t id = token_id(s);
    if (id >= 0) {
      if (unk_pending >= 0) add(unk_pending);
      unk_pending = -1;
      add(id);
      continue;
    }
    if (byte_fallback_) {
      bool all = true;
      for (char c : s) all = all && byte_ids_[static_cast<unsigned char>(c)] >= 0;
      if (all) {
        // The reference library adds these before any pending unknown token; keep that order.
        for (char c : s) add(byte_ids_[static_cast<unsigned char>(c)]);
        continue;
      }
    }
    if (has_unk_) {
      const int32_t unk = token_id(unk_token_);
      if (unk < 0) fail("tokenizer: unknown token '", unk_token_, "' is not in the vocabulary");
      if (unk_pending >= 0 && !fuse_unk_) add(unk_pending);
      unk_pending = unk;
    }
  }
  if (unk_pending >= 0) add(unk_pending);
  if (sym.empty()) return;
  sym.back().next = -1;

  std::priority_queue<QueuedMerge> queue;
  auto lookup = [&](int32_t a, int32_t b) -> const Merge* {
    auto it = merges_.find(pair_key(a, b));
    return it == merges_.end() ? nullptr : &it->second;
  };
  for (size_t i = 0; i + 1 < sym.size(); ++i)
    if (const Merge* mg = lookup(sym[i].id, sym[i + 1].id)) queue.push({mg->rank, int32_t(i), mg->new_id});
  while (!queue.empty()) {
    const QueuedMerge top = queue.top();
    queue.pop();
    Symbol& cur = sym[top.pos];
    if (!cur.alive || cur.next < 0) continue;
    Symbol& right = sym[cur.next];
    const Merge* mg = lookup(cur.id, right.id);
    if (!mg || mg->new_id != top.new_id) continue;  // stale entry
    cur.id = top.new_id;
    right.alive = false;
    cur.next = right.next;
    if (cur.next >= 0) sym[cur.next].prev = top.pos;
    if (cur.prev >= 0)
      if (const Merge* p = lookup(sym[cur.prev].id, cur.id)) queue.push({p->rank, cur.prev, p->new_id});
    if (cur.next >= 0)
      if (const Merge* nx = lookup(cur.id, sym[cur.next].id)) queue.push({nx->rank, top.pos, nx->new_id});
  }
  for (const Symbol& x : sym)
    if (x.alive) out.push_back(x.id);
}

void BpeModel::tokenize(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    const int32_t id = token_id(word);
    if (id >= 0) {
      out.push_back(id);
      return;
    }
  }
  const bool cacheable = word.size() < kCacheMaxWordBytes;
  if (cacheable) {
    std::shared_lock lock(cache_mutex_);
    auto it = cache_.find(word);
    if (it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t begin = out.size();
  merge_word(word, out);
  if (cacheable) {
    std::unique_lock lock(cache_mutex_);
    if (cache_.size() < kCacheMaxEntries) cache_.emplace(std::string(word), std::vector<int32_t>(out.begin() + begin, out.end()));
  }
}

}  // namespace kestrel::text
