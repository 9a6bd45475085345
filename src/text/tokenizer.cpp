#include "text/tokenizer.h"

#include <algorithm>
#include <array>
#include <unordered_set>

#include "common/error.h"
#include "formats/json_file.h"
#include "text/bpe.h"
#include "text/normalize.h"
#include "text/pretokenize.h"
#include "text/tokenizer_json.h"
#include "text/utf8.h"

namespace kestrel::text {
namespace {

struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool special = false, single_word = false, lstrip = false, rstrip = false, normalized = false;
};

// Byte trie over added-token contents: at each position the longest token that starts there.
class TokenTrie {
 public:
  TokenTrie() : nodes_(1) { first_.fill(false); }
  void add(std::string_view s, int32_t token) {
    if (s.empty()) return;
    first_[static_cast<unsigned char>(s[0])] = true;
    int32_t n = 0;
    for (char c : s) {
      auto& next = nodes_[n].next;
      const auto b = static_cast<unsigned char>(c);
      auto it = std::lower_bound(next.begin(), next.end(), b, [](const auto& p, unsigned char v) { return p.first < v; });
      if (it == next.end() || it->first != b) {
        it = next.insert(it, {b, static_cast<int32_t>(nodes_.size())});
        const int32_t child = it->second;
        nodes_.emplace_back();
        n = child;
      } else {
        n = it->second;
      }
    }
    nodes_[n].token = token;
  }
  bool empty() const { return nodes_.size() == 1; }
  // (token, length) of the longest token at s[i], or (-1, 0).
  std::pair<int32_t, size_t> longest_at(std::string_view s, size_t i) const {
    if (!first_[static_cast<unsigned char>(s[i])]) return {-1, 0};
    std::pair<int32_t, size_t> best{-1, 0};
    int32_t n = 0;
    for (size_t k = i; k < s.size(); ++k) {
      const auto& next = nodes_[n].next;
      const auto b = static_cast<unsigned char>(s[k]);
      auto it = std::lower_bound(next.begin(), next.end(), b, [](const auto& p, unsigned char v) { return p.first < v; });
      if (it == next.end() || it->first != b) break;
      n = it->second;
      if (nodes_[n].token >= 0) best = {nodes_[n].token, k + 1 - i};
    }
    return best;
  }

 private:
  struct Node {
    std::vector<std::pair<unsigned char, int32_t>> next;
    int32_t token = -1;
  };
  std::vector<Node> nodes_;
  std::array<bool, 256> first_;
};

struct Segment {
  size_t begin, end;
  int32_t token;  // index into the added tokens, or -1 for text
};

char32_t char_before(std::string_view s, size_t end) {
  size_t p = end - 1;
  while (p > 0 && (static_cast<unsigned char>(s[p]) & 0xC0) == 0x80) --p;
  char32_t c = 0;
  utf8_decode(s, p, c);
  return c;
}

bool word_char(char32_t c) { return c == '_' || is_alphanumeric(c); }

// One post-processing step as a template over the encoded sequence: ids before and after it.
struct Template {
  std::vector<int32_t> before, after;
};

}  // namespace

struct Tokenizer::Impl {
  std::string name;
  std::unique_ptr<BpeModel> model;
  std::unique_ptr<Normalizer> normalizer;
  std::unique_ptr<PreTokenizer> pre_tokenizer;
  std::unique_ptr<Decoder> decoder;
  std::vector<Template> post;  // applied in order

  std::vector<AddedToken> added;  // one per distinct content
  TokenMap added_by_content;      // content -> index into added
  std::unordered_map<int32_t, int32_t> added_by_id;  // id -> index into added
  std::unordered_set<std::string> special_contents;
  TokenTrie raw_trie, normalized_trie;
  int32_t max_id = -1;

  void load_added(const nlohmann::json& list, const std::string& where);
  void load_post(const nlohmann::json& j, const std::string& where);
  using Spans = std::span<const std::pair<size_t, size_t>>;
  std::vector<Segment> split_added(std::string_view s, const TokenTrie& trie, bool parse_special, Spans literal = {}) const;
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens, bool parse_special, Spans literal) const;
  void encode_text(std::string_view text, bool at_start, std::vector<int32_t>& ids) const;
  const std::string* content(int32_t id) const {
    auto it = added_by_id.find(id);
    return it != added_by_id.end() ? &added[it->second].content : model->token(id);
  }
};

void Tokenizer::Impl::load_added(const nlohmann::json& list, const std::string& where) {
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string w = tj::sub(where, i);
    const auto& j = list[i];
    AddedToken t;
    t.content = tj::str(j, "content", w);
    t.special = tj::bool_or(j, "special", false, w);
    t.single_word = tj::bool_or(j, "single_word", false, w);
    t.lstrip = tj::bool_or(j, "lstrip", false, w);
    t.rstrip = tj::bool_or(j, "rstrip", false, w);
    t.normalized = tj::bool_or(j, "normalized", !t.special, w);
    if (t.content.empty()) continue;
    if (t.special) special_contents.insert(t.content);
    // Ids are assigned as the reference library does on load: the model's id if the content is in
    // its vocabulary, else the next id after the model and the tokens added so far. The "id" field
    // of the file is not consulted, so a file whose ids disagree loads as the library loads it.
    auto it = added_by_content.find(t.content);
    if (it != added_by_content.end()) {
      t.id = added[it->second].id;
      added[it->second] = t;  // the last entry's flags win
      continue;
    }
    t.id = model->token_id(t.content);
    if (t.id < 0) {
      const auto vocab = static_cast<int64_t>(model->size());
      int64_t max_added = -1;
      for (const auto& a : added) max_added = std::max<int64_t>(max_added, a.id);
      const int64_t id = max_added < 0 ? vocab : (max_added >= vocab || vocab == 0 ? max_added + 1 : vocab);
      if (id > INT32_MAX) fail(w, ": no id left for '", t.content, "'");
      t.id = static_cast<int32_t>(id);
    }
    added_by_content.emplace(t.content, static_cast<int32_t>(added.size()));
    added.push_back(t);
  }
  for (size_t k = 0; k < added.size(); ++k) {
    added_by_id[added[k].id] = static_cast<int32_t>(k);
    max_id = std::max(max_id, added[k].id);
    if (!added[k].normalized) {
      raw_trie.add(added[k].content, static_cast<int32_t>(k));
    } else {
      std::string n = added[k].content;
      if (normalizer) normalizer->normalize(n);
      normalized_trie.add(n, static_cast<int32_t>(k));
    }
  }
}

void Tokenizer::Impl::load_post(const nlohmann::json& j, const std::string& where) {
  const std::string t = tj::type(j, where);
  auto special_id = [&](const nlohmann::json& pair, const std::string& w) {
    if (!pair.is_array() || pair.size() != 2 || !pair[1].is_number_integer())
      fail(w, ": must be [\"token\", id], got ", pair.dump().substr(0, 80));
    const int64_t id = pair[1].get<int64_t>();
    if (id < 0 || id > INT32_MAX) fail(w, ": id out of range: ", id);
    return static_cast<int32_t>(id);
  };
  if (t == "ByteLevel") return;  // only adjusts offsets
  if (t == "Sequence") {
    const auto& list = tj::array(j, "processors", where);
    for (size_t i = 0; i < list.size(); ++i) load_post(list[i], tj::sub(tj::sub(where, "processors"), i));
    return;
  }
  if (t == "RobertaProcessing" || t == "BertProcessing") {
    post.push_back({{special_id(tj::field(j, "cls", where), tj::sub(where, "cls"))},
                    {special_id(tj::field(j, "sep", where), tj::sub(where, "sep"))}});
    return;
  }
  if (t == "TemplateProcessing") {
    const auto& specials = tj::field(j, "special_tokens", where);
    tj::need_object(specials, tj::sub(where, "special_tokens"));
    const auto& single = tj::array(j, "single", where);
    Template tpl;
    bool seen_a = false;
    for (size_t i = 0; i < single.size(); ++i) {
      const std::string w = tj::sub(tj::sub(where, "single"), i);
      const auto& item = single[i];
      if (tj::present(item, "Sequence")) {
        const std::string seq = tj::str(item.at("Sequence"), "id", tj::sub(w, "Sequence"));
        if (seq != "A") fail(w, ": a single-sequence template can only hold sequence A, got '", seq, "'");
        if (seen_a) fail(w, ": sequence A appears twice");
        seen_a = true;
      } else if (tj::present(item, "SpecialToken")) {
        const std::string name = tj::str(item.at("SpecialToken"), "id", tj::sub(w, "SpecialToken"));
        auto it = specials.find(name);
        if (it == specials.end()) fail(w, ": special token '", name, "' is not in special_tokens");
        const std::string sw = tj::sub(tj::sub(where, "special_tokens"), name);
        const auto& ids = tj::array(*it, "ids", sw);
        for (size_t k = 0; k < ids.size(); ++k) {
          if (!ids[k].is_number_integer() || ids[k].get<int64_t>() < 0 || ids[k].get<int64_t>() > INT32_MAX)
            fail(tj::sub(tj::sub(sw, "ids"), k), ": must be a token id, got ", ids[k].dump().substr(0, 40));
          (seen_a ? tpl.after : tpl.before).push_back(static_cast<int32_t>(ids[k].get<int64_t>()));
        }
      } else {
        fail(w, ": must be {\"Sequence\": ...} or {\"SpecialToken\": ...}, got ", item.dump().substr(0, 80));
      }
    }
    if (!seen_a) fail(tj::sub(where, "single"), ": has no sequence A");
    post.push_back(std::move(tpl));
    return;
  }
  fail(where, ": post-processor type '", t, "' is not supported (TemplateProcessing, ByteLevel, RobertaProcessing, ",
       "BertProcessing, Sequence)");
}

// Cuts `s` at added tokens as the reference AddedVocabulary::find_matches does: leftmost-longest
// matches, single_word tokens only between non-word characters, lstrip/rstrip taking the
// whitespace around them, special tokens ignored when not parsing them. A special token that
// overlaps a literal span is not a match there: the search goes on from its next byte.
std::vector<Segment> Tokenizer::Impl::split_added(std::string_view s, const TokenTrie& trie, bool parse_special,
                                                  Spans literal) const {
  std::vector<Segment> out;
  if (trie.empty()) {
    out.push_back({0, s.size(), -1});
    return out;
  }
  size_t start_offset = 0;
  size_t i = 0;
  while (i < s.size()) {
    const auto [tok, len] = trie.longest_at(s, i);
    if (tok < 0) {
      ++i;
      continue;
    }
    size_t start = i, stop = i + len;
    i = stop;
    const AddedToken& t = added[tok];
    if (!parse_special && special_contents.count(t.content)) continue;
    if (!literal.empty() && special_contents.count(t.content)) {
      while (!literal.empty() && literal.front().second <= start) literal = literal.subspan(1);
      if (!literal.empty() && literal.front().first < stop) {
        i = start + 1;
        continue;
      }
    }
    if (t.single_word) {
      const bool space_before = start == 0 || !word_char(char_before(s, start));
      char32_t next = 0;
      const bool space_after = stop == s.size() || (utf8_decode(s, stop, next), !word_char(next));
      if (!space_before || !space_after) continue;
    }
    if (t.lstrip) {
      size_t b = start;
      while (b > 0) {
        size_t p = b - 1;
        while (p > 0 && (static_cast<unsigned char>(s[p]) & 0xC0) == 0x80) --p;
        char32_t c = 0;
        utf8_decode(s, p, c);
        if (!is_whitespace(c)) break;
        b = p;
      }
      start = std::max(b, start_offset);
    }
    if (t.rstrip) {
      while (stop < s.size()) {
        char32_t c = 0;
        const size_t n = utf8_decode(s, stop, c);
        if (!is_whitespace(c)) break;
        stop += n;
      }
      i = stop;
    }
    if (start_offset < start) out.push_back({start_offset, start, -1});
    out.push_back({start, stop, tok});
    start_offset = stop;
  }
  if (start_offset != s.size()) out.push_back({start_offset, s.size(), -1});
  return out;
}

void Tokenizer::Impl::encode_text(std::string_view text, bool at_start, std::vector<int32_t>& ids) const {
  std::vector<Piece> pieces{{std::string(text), at_start}};
  if (pre_tokenizer) pre_tokenizer->run(pieces);
  for (const auto& p : pieces) model->tokenize(p.text, ids);
}

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::from_file(const std::string& path) { return Tokenizer(load_impl(read_json_file(path), path)); }

Tokenizer Tokenizer::from_json_text(std::string_view json, const std::string& name) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json);
  } catch (const nlohmann::json::exception& e) {
    fail(name, ": not valid JSON: ", e.what());
  }
  return Tokenizer(load_impl(j, name));
}

std::unique_ptr<Tokenizer::Impl> Tokenizer::load_impl(const nlohmann::json& j, const std::string& w) {
  auto impl = std::make_unique<Impl>();
  impl->name = w;
  tj::need_object(j, w);
  const auto& model = tj::field(j, "model", w);
  const std::string mw = tj::sub(w, "model");
  tj::need_object(model, mw);
  std::string type = model.contains("merges") ? "BPE" : "";
  if (tj::present(model, "type")) type = tj::type(model, mw);
  if (type != "BPE") fail(mw, ": model type '", type, "' is not supported (only BPE)");
  impl->model = BpeModel::from_json(model, mw);
  impl->max_id = impl->model->max_id();
  if (tj::present(j, "normalizer")) impl->normalizer = Normalizer::from_json(j.at("normalizer"), tj::sub(w, "normalizer"));
  if (tj::present(j, "pre_tokenizer"))
    impl->pre_tokenizer = PreTokenizer::from_json(j.at("pre_tokenizer"), tj::sub(w, "pre_tokenizer"));
  if (tj::present(j, "decoder")) impl->decoder = Decoder::from_json(j.at("decoder"), tj::sub(w, "decoder"));
  if (tj::present(j, "post_processor")) impl->load_post(j.at("post_processor"), tj::sub(w, "post_processor"));
  if (tj::present(j, "added_tokens")) impl->load_added(tj::array(j, "added_tokens", w), tj::sub(w, "added_tokens"));
  return impl;
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens, bool parse_special) const {
  return impl_->encode(text, add_special_tokens, parse_special, {});
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens,
                                       std::span<const std::pair<size_t, size_t>> literal) const {
  for (size_t k = 0; k < literal.size(); ++k)
    if (literal[k].first > literal[k].second || literal[k].second > text.size() ||
        (k > 0 && literal[k].first < literal[k - 1].second))
      fail("tokenize: literal span ", k, " [", literal[k].first, ", ", literal[k].second, ") is out of order or outside the text");
  return impl_->encode(text, add_special_tokens, true, literal);
}

std::vector<std::string> Tokenizer::special_tokens() const {
  std::vector<std::string> out(impl_->special_contents.begin(), impl_->special_contents.end());
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<int32_t> Tokenizer::Impl::encode(std::string_view text, bool add_special_tokens, bool parse_special,
                                             Spans literal) const {
  const Impl& m = *this;
  const size_t bad = utf8_invalid_at(text);
  if (bad != text.size()) fail("tokenize: text is not valid UTF-8 (byte ", bad, ")");
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 8);
  for (const Segment& seg : m.split_added(text, m.raw_trie, parse_special, literal)) {
    if (seg.token >= 0) {
      ids.push_back(m.added[seg.token].id);
      continue;
    }
    if (seg.end == seg.begin) continue;
    std::string s(text.substr(seg.begin, seg.end - seg.begin));
    if (m.normalizer) m.normalizer->normalize(s);
    // Offsets move under normalization: a piece that holds literal text parses no special token
    // among the normalized ones (which are rare: special tokens are usually matched raw).
    bool holds_literal = false;
    for (const auto& [b, e] : literal) holds_literal |= b < seg.end && seg.begin < e;
    for (const Segment& sub : m.split_added(s, m.normalized_trie, parse_special && !holds_literal)) {
      if (sub.token >= 0) ids.push_back(m.added[sub.token].id);
      else if (sub.end > sub.begin)
        m.encode_text(std::string_view(s).substr(sub.begin, sub.end - sub.begin), seg.begin == 0 && sub.begin == 0, ids);
    }
  }
  if (add_special_tokens) {
    for (const Template& t : m.post) {
      ids.insert(ids.begin(), t.before.begin(), t.before.end());
      ids.insert(ids.end(), t.after.begin(), t.after.end());
    }
  }
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special) const {
  const Impl& m = *impl_;
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    const std::string* c = m.content(id);
    if (!c || (skip_special && m.special_contents.count(*c))) continue;
    tokens.push_back(*c);
  }
  return decode_tokens(m.decoder.get(), std::move(tokens));
}

int32_t Tokenizer::token_id(std::string_view token) const {
  auto it = impl_->added_by_content.find(token);
  if (it != impl_->added_by_content.end()) return impl_->added[it->second].id;
  return impl_->model->token_id(token);
}

std::string_view Tokenizer::token(int32_t id) const {
  const std::string* c = impl_->content(id);
  return c ? std::string_view(*c) : std::string_view();
}

size_t Tokenizer::vocab_size() const { return static_cast<size_t>(impl_->max_id + 1); }

bool Tokenizer::is_special(int32_t id) const {
  const std::string* c = impl_->content(id);
  return c && impl_->special_contents.count(*c);
}

bool Tokenizer::is_byte_fallback_token(int32_t id) const {
  if (!impl_->decoder || !impl_->decoder->groups_byte_tokens()) return false;
  const std::string* c = impl_->content(id);
  return c && c->size() == 6 && c->compare(0, 3, "<0x") == 0 && (*c)[5] == '>';
}

}  // namespace kestrel::text
