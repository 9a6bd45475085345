#include "text/pretokenize.h"

#include <algorithm>
#include <array>
#include <functional>

#include "text/pretokenize_regex.h"
#include "text/tokenizer_json.h"
#include "text/utf8.h"

namespace kestrel::text {
namespace {

// A stretch of a piece and whether the pattern matched it.
struct Mark {
  size_t b, e;
  bool match;
};

std::vector<Mark> marks_from(size_t n, const std::vector<std::pair<size_t, size_t>>& matches) {
  if (n == 0) return {{0, 0, false}};
  std::vector<Mark> m;
  size_t prev = 0;
  for (const auto& [b, e] : matches) {
    if (prev != b) m.push_back({prev, b, false});
    m.push_back({b, e, true});
    prev = e;
  }
  if (prev != n) m.push_back({prev, n, false});
  return m;
}

// Each character for which `pred` holds is its own match.
std::vector<Mark> marks_by_char(const std::string& s, const std::function<bool(char32_t)>& pred) {
  std::vector<std::pair<size_t, size_t>> matches;
  for (size_t i = 0; i < s.size();) {
    char32_t c = 0;
    const size_t n = utf8_decode(s, i, c);
    if (pred(c)) matches.emplace_back(i, i + n);
    i += n;
  }
  return marks_from(s.size(), matches);
}

enum class Behavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

Behavior behavior_from(const std::string& name, const std::string& where) {
  if (name == "Removed") return Behavior::Removed;
  if (name == "Isolated") return Behavior::Isolated;
  if (name == "MergedWithPrevious") return Behavior::MergedWithPrevious;
  if (name == "MergedWithNext") return Behavior::MergedWithNext;
  if (name == "Contiguous") return Behavior::Contiguous;
  fail(where, ": behavior '", name, "' is not one of Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous");
}

// Cuts `p` at the marks the way the reference library's NormalizedString::split does.
void split_piece(const Piece& p, std::vector<Mark> marks, Behavior beh, bool invert, std::vector<Piece>& out) {
  if (invert)
    for (auto& m : marks) m.match = !m.match;
  std::vector<Mark> r;
  r.reserve(marks.size());
  bool prev = false;
  switch (beh) {
    case Behavior::Isolated:
      for (const auto& m : marks) r.push_back({m.b, m.e, false});
      break;
    case Behavior::Removed:
      r = marks;
      break;
    case Behavior::MergedWithPrevious:
      for (const auto& m : marks) {
        if (m.match && !prev && !r.empty()) r.back().e = m.e;
        else r.push_back({m.b, m.e, false});
        prev = m.match;
      }
      break;
    case Behavior::MergedWithNext:
      for (auto it = marks.rbegin(); it != marks.rend(); ++it) {
        if (it->match && !prev && !r.empty()) r.back().b = it->b;
        else r.push_back({it->b, it->e, false});
        prev = it->match;
      }
      std::reverse(r.begin(), r.end());
      break;
    case Behavior::Contiguous:
      for (const auto& m : marks) {
        if (m.match == prev && !r.empty()) r.back().e = m.e;
        else r.push_back({m.b, m.e, false});
        prev = m.match;
      }
      break;
  }
  for (const auto& m : r)
    if (!m.match && m.e > m.b) out.push_back({p.text.substr(m.b, m.e - m.b), p.at_start && m.b == 0});
}

class Split : public PreTokenizer {
 public:
  Split(Regex re, Behavior beh, bool invert) : re_(std::move(re)), beh_(beh), invert_(invert) {}
  void run(std::vector<Piece>& pieces) const override {
    std::vector<Piece> out;
    out.reserve(pieces.size());
    for (const auto& p : pieces) split_piece(p, marks_from(p.text.size(), re_.find_all(p.text)), beh_, invert_, out);
    pieces = std::move(out);
  }

 private:
  Regex re_;
  Behavior beh_;
  bool invert_;
};

const Regex& gpt2_regex() {
  static const Regex re(R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)",
                        "ByteLevel pre-tokenizer");
  return re;
}

class ByteLevel : public PreTokenizer {
 public:
  ByteLevel(bool add_prefix_space, bool use_regex) : add_prefix_space_(add_prefix_space), use_regex_(use_regex) {}
  void run(std::vector<Piece>& pieces) const override {
    std::vector<Piece> out;
    out.reserve(pieces.size());
    for (auto& p : pieces) {
      // Prepending to an empty piece does nothing in the reference library.
      if (add_prefix_space_ && !p.text.empty() && p.text[0] != ' ') p.text.insert(0, 1, ' ');
      if (use_regex_) split_piece(p, marks_from(p.text.size(), gpt2_regex().find_all(p.text)), Behavior::Isolated, false, out);
      else if (!p.text.empty()) out.push_back(std::move(p));
    }
    for (auto& p : out) {
      std::string mapped;
      mapped.reserve(p.text.size() * 2);
      for (char c : p.text) mapped += byte_to_unicode(static_cast<unsigned char>(c));
      p.text = std::move(mapped);
    }
    pieces = std::move(out);
  }

 private:
  bool add_prefix_space_, use_regex_;
};

class Digits : public PreTokenizer {
 public:
  explicit Digits(bool individual) : individual_(individual) {}
  void run(std::vector<Piece>& pieces) const override {
    std::vector<Piece> out;
    out.reserve(pieces.size());
    for (const auto& p : pieces)
      split_piece(p, marks_by_char(p.text, is_numeric), individual_ ? Behavior::Isolated : Behavior::Contiguous, false,
                  out);
    pieces = std::move(out);
  }

 private:
  bool individual_;
};

enum class Prepend { Always, Never, First };

class Metaspace : public PreTokenizer {
 public:
  Metaspace(char32_t replacement, Prepend scheme, bool split) : replacement_(replacement), scheme_(scheme), split_(split) {
    utf8_append(rep_, replacement);
  }
  void run(std::vector<Piece>& pieces) const override {
    std::vector<Piece> out;
    out.reserve(pieces.size());
    for (auto& p : pieces) {
      std::string t;
      t.reserve(p.text.size() + 3);
      for (char c : p.text) {
        if (c == ' ') t += rep_;
        else t += c;
      }
      const bool starts = t.compare(0, rep_.size(), rep_) == 0;
      if (!t.empty() && !starts && (scheme_ == Prepend::Always || (scheme_ == Prepend::First && p.at_start)))
        t.insert(0, rep_);
      Piece q{std::move(t), p.at_start};
      if (split_) split_piece(q, marks_by_char(q.text, [this](char32_t c) { return c == replacement_; }),
                              Behavior::MergedWithNext, false, out);
      else if (!q.text.empty()) out.push_back(std::move(q));
    }
    pieces = std::move(out);
  }

 private:
  char32_t replacement_;
  std::string rep_;
  Prepend scheme_;
  bool split_;
};

class Sequence : public PreTokenizer {
 public:
  explicit Sequence(std::vector<std::unique_ptr<PreTokenizer>> parts) : parts_(std::move(parts)) {}
  void run(std::vector<Piece>& pieces) const override {
    for (const auto& p : parts_) p->run(pieces);
  }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> parts_;
};

struct ByteTable {
  std::array<std::string, 256> to_char;
  std::array<int, 512> to_byte;
  ByteTable() {
    to_byte.fill(-1);
    int extra = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const char32_t c = printable ? char32_t(b) : char32_t(256 + extra++);
      utf8_append(to_char[b], c);
      to_byte[c] = b;
    }
  }
};

const ByteTable& byte_table() {
  static const ByteTable t;
  return t;
}

}  // namespace

const std::string& byte_to_unicode(unsigned char b) { return byte_table().to_char[b]; }

int unicode_to_byte(char32_t c) { return c < 512 ? byte_table().to_byte[c] : -1; }

std::vector<std::string> pre_tokenize(const PreTokenizer& p, std::string_view text) {
  std::vector<Piece> pieces{{std::string(text), true}};
  p.run(pieces);
  std::vector<std::string> out;
  out.reserve(pieces.size());
  for (auto& q : pieces) out.push_back(std::move(q.text));
  return out;
}

std::unique_ptr<PreTokenizer> PreTokenizer::from_json(const nlohmann::json& j, const std::string& where) {
  const std::string t = tj::type(j, where);
  if (t == "Split")
    return std::make_unique<Split>(tj::pattern(j, "pattern", where),
                                   behavior_from(tj::str(j, "behavior", where), tj::sub(where, "behavior")),
                                   tj::bool_or(j, "invert", false, where));
  if (t == "ByteLevel")
    return std::make_unique<ByteLevel>(tj::bool_or(j, "add_prefix_space", true, where),
                                       tj::bool_or(j, "use_regex", true, where));
  if (t == "Digits") return std::make_unique<Digits>(tj::bool_or(j, "individual_digits", false, where));
  if (t == "Metaspace") {
    Prepend scheme = tj::bool_or(j, "add_prefix_space", true, where) ? Prepend::Always : Prepend::Never;
    if (tj::present(j, "prepend_scheme")) {
      const std::string s = tj::str(j, "prepend_scheme", where);
      if (s == "always") scheme = Prepend::Always;
      else if (s == "never") scheme = Prepend::Never;
      else if (s == "first") scheme = Prepend::First;
      else fail(tj::sub(where, "prepend_scheme"), ": must be always, never or first, got '", s, "'");
    }
    return std::make_unique<Metaspace>(tj::one_char(j, "replacement", where), scheme, tj::bool_or(j, "split", true, where));
  }
  if (t == "Sequence") {
    const auto& list = tj::array(j, "pretokenizers", where);
    std::vector<std::unique_ptr<PreTokenizer>> parts;
    for (size_t i = 0; i < list.size(); ++i)
      parts.push_back(from_json(list[i], tj::sub(tj::sub(where, "pretokenizers"), i)));
    return std::make_unique<Sequence>(std::move(parts));
  }
  fail(where, ": pre-tokenizer type '", t, "' is not supported (Split, ByteLevel, Digits, Metaspace, Sequence)");
}

}  // namespace kestrel::text
