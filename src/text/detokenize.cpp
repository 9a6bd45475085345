#include "text/detokenize.h"

#include "text/pretokenize.h"
#include "text/tokenizer.h"
#include "text/tokenizer_json.h"
#include "text/utf8.h"

namespace kestrel::text {
namespace {

// Byte-level characters back to bytes; a token with any other character keeps its own bytes.
class ByteLevelDecoder : public Decoder {
 public:
  void chain(std::vector<std::string>& tokens) const override {
    std::string bytes;
    for (const auto& t : tokens) {
      const size_t start = bytes.size();
      bool mapped = true;
      for (size_t i = 0; i < t.size();) {
        char32_t c = 0;
        const size_t n = utf8_decode(t, i, c);
        const int b = n ? unicode_to_byte(c) : -1;
        if (b < 0) {
          mapped = false;
          break;
        }
        bytes += static_cast<char>(b);
        i += n;
      }
      if (!mapped) {
        bytes.resize(start);
        bytes += t;
      }
    }
    tokens.assign(1, utf8_lossy(bytes));
  }
};

class ReplaceDecoder : public Decoder {
 public:
  ReplaceDecoder(Regex re, std::string content) : re_(std::move(re)), content_(std::move(content)) {}
  void chain(std::vector<std::string>& tokens) const override {
    for (auto& t : tokens) {
      const auto matches = re_.find_all(t);
      if (matches.empty()) continue;
      std::string out;
      size_t last = 0;
      for (const auto& [b, e] : matches) {
        out.append(t, last, b - last);
        out += content_;
        last = e;
      }
      out.append(t, last, std::string::npos);
      t = std::move(out);
    }
  }

 private:
  Regex re_;
  std::string content_;
};

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// The byte a "<0xHH>" token stands for, or -1. Like Rust's u8::from_str_radix it also takes a
// plus sign and one digit.
int byte_token_value(const std::string& t) {
  if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return -1;
  const int lo = hex_digit(t[4]);
  if (lo < 0) return -1;
  if (t[3] == '+') return lo;
  const int hi = hex_digit(t[3]);
  return hi < 0 ? -1 : hi * 16 + lo;
}

// Runs of <0xHH> tokens become their UTF-8 text, or one U+FFFD per byte if the run is not valid.
class ByteFallbackDecoder : public Decoder {
 public:
  bool groups_byte_tokens() const override { return true; }
  void chain(std::vector<std::string>& tokens) const override {
    std::vector<std::string> out;
    out.reserve(tokens.size());
    std::string run;
    auto flush = [&] {
      if (run.empty()) return;
      if (utf8_valid(run)) {
        out.push_back(run);
      } else {
        for (size_t i = 0; i < run.size(); ++i) out.emplace_back(kReplacementChar);
      }
      run.clear();
    };
    for (auto& t : tokens) {
      const int b = byte_token_value(t);
      if (b >= 0) {
        run += static_cast<char>(b);
      } else {
        flush();
        out.push_back(std::move(t));
      }
    }
    flush();
    tokens = std::move(out);
  }
};

class FuseDecoder : public Decoder {
 public:
  void chain(std::vector<std::string>& tokens) const override {
    std::string all;
    for (const auto& t : tokens) all += t;
    tokens.assign(1, std::move(all));
  }
};

// Removes up to `start` leading and `stop` trailing copies of one character from each token.
class StripDecoder : public Decoder {
 public:
  StripDecoder(char32_t c, size_t start, size_t stop) : c_(c), start_(start), stop_(stop) {}
  void chain(std::vector<std::string>& tokens) const override {
    for (auto& t : tokens) {
      std::vector<std::pair<size_t, char32_t>> chars;  // byte offset, code point
      for (size_t i = 0; i < t.size();) {
        char32_t c = 0;
        const size_t n = utf8_decode(t, i, c);
        chars.emplace_back(i, c);
        i += n ? n : 1;
      }
      size_t b = 0;
      while (b < start_ && b < chars.size() && chars[b].second == c_) ++b;
      size_t e = chars.size();
      for (size_t k = 0; k < stop_ && e > b && chars[e - 1].second == c_; ++k) --e;
      const size_t bb = b < chars.size() ? chars[b].first : t.size();
      const size_t eb = e < chars.size() ? chars[e].first : t.size();
      t = t.substr(bb, eb - bb);
    }
  }

 private:
  char32_t c_;
  size_t start_, stop_;
};

// The replacement character becomes a space, except in the first token where it is dropped
// (unless the prepend scheme is "never").
class MetaspaceDecoder : public Decoder {
 public:
  MetaspaceDecoder(char32_t replacement, bool drop_first) : drop_first_(drop_first) { utf8_append(rep_, replacement); }
  void chain(std::vector<std::string>& tokens) const override {
    for (size_t i = 0; i < tokens.size(); ++i) {
      std::string& t = tokens[i];
      std::string out;
      out.reserve(t.size());
      for (size_t p = 0; p < t.size();) {
        if (t.compare(p, rep_.size(), rep_) == 0) {
          if (!(i == 0 && drop_first_)) out += ' ';
          p += rep_.size();
        } else {
          out += t[p++];
        }
      }
      t = std::move(out);
    }
  }

 private:
  std::string rep_;
  bool drop_first_;
};

class SequenceDecoder : public Decoder {
 public:
  explicit SequenceDecoder(std::vector<std::unique_ptr<Decoder>> parts) : parts_(std::move(parts)) {
    for (const auto& p : parts_) groups_ = groups_ || p->groups_byte_tokens();
  }
  bool groups_byte_tokens() const override { return groups_; }
  void chain(std::vector<std::string>& tokens) const override {
    for (const auto& p : parts_) p->chain(tokens);
  }

 private:
  std::vector<std::unique_ptr<Decoder>> parts_;
  bool groups_ = false;
};

size_t size_field(const nlohmann::json& j, const char* key, const std::string& where) {
  const int64_t v = tj::int_or(j, key, 0, where);
  if (v < 0) fail(tj::sub(where, key), ": must not be negative, got ", v);
  return static_cast<size_t>(v);
}

}  // namespace

std::unique_ptr<Decoder> Decoder::from_json(const nlohmann::json& j, const std::string& where) {
  const std::string t = tj::type(j, where);
  if (t == "ByteLevel") return std::make_unique<ByteLevelDecoder>();
  if (t == "Replace") return std::make_unique<ReplaceDecoder>(tj::pattern(j, "pattern", where), tj::str(j, "content", where));
  if (t == "ByteFallback") return std::make_unique<ByteFallbackDecoder>();
  if (t == "Fuse") return std::make_unique<FuseDecoder>();
  if (t == "Strip")
    return std::make_unique<StripDecoder>(tj::one_char(j, "content", where), size_field(j, "start", where),
                                          size_field(j, "stop", where));
  if (t == "Metaspace") {
    bool drop_first = tj::bool_or(j, "add_prefix_space", true, where);
    if (tj::present(j, "prepend_scheme")) drop_first = tj::str(j, "prepend_scheme", where) != "never";
    return std::make_unique<MetaspaceDecoder>(tj::one_char(j, "replacement", where), drop_first);
  }
  if (t == "Sequence") {
    const auto& list = tj::array(j, "decoders", where);
    std::vector<std::unique_ptr<Decoder>> parts;
    for (size_t i = 0; i < list.size(); ++i) parts.push_back(from_json(list[i], tj::sub(tj::sub(where, "decoders"), i)));
    return std::make_unique<SequenceDecoder>(std::move(parts));
  }
  fail(where, ": decoder type '", t, "' is not supported (ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace, ",
       "Sequence)");
}

std::string decode_tokens(const Decoder* d, std::vector<std::string> tokens) {
  std::string out;
  if (!d) {
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (i) out += ' ';
      out += tokens[i];
    }
    return out;
  }
  d->chain(tokens);
  for (const auto& t : tokens) out += t;
  return out;
}

StreamDecoder::StreamDecoder(const Tokenizer& tok, bool skip_special) : tok_(&tok), skip_special_(skip_special) {}

std::string StreamDecoder::push(int32_t id) {
  ids_.push_back(id);
  // A run of byte-fallback tokens is decoded as a whole; wait until it ends. Skipped and unknown
  // ids do not end a run because decode drops them before the decoder sees the run.
  for (size_t i = ids_.size(); i-- > context_;) {
    if (tok_->token(ids_[i]).empty() || (skip_special_ && tok_->is_special(ids_[i]))) continue;
    if (tok_->is_byte_fallback_token(ids_[i])) return {};
    break;
  }
  const std::string text = tok_->decode(ids_, skip_special_);
  const size_t base = context_end(text);
  // Trailing U+FFFD may be an incomplete character that later bytes complete.
  size_t stable = text.size();
  while (stable >= base + emitted_ + kReplacementChar.size() &&
         text.compare(stable - kReplacementChar.size(), kReplacementChar.size(), kReplacementChar) == 0)
    stable -= kReplacementChar.size();
  std::string out;
  if (stable > base + emitted_) out = text.substr(base + emitted_, stable - base - emitted_);
  emitted_ = std::max(emitted_, stable - std::min(stable, base));
  if (stable == text.size()) settle();
  return out;
}

// Everything decoded so far is out: keep only the last ids whose text is not empty, as context
// for what follows (a decoder may treat the first token of its input differently).
void StreamDecoder::settle() {
  size_t k = ids_.size();
  std::string ctx;
  while (k > 0) {
    --k;
    ctx = tok_->decode(std::span<const int32_t>(ids_).subspan(k), skip_special_);
    if (!ctx.empty()) break;
  }
  ids_.erase(ids_.begin(), ids_.begin() + static_cast<std::ptrdiff_t>(k));
  context_ = ids_.size();
  context_text_ = std::move(ctx);
  emitted_ = 0;
}

size_t StreamDecoder::context_end(const std::string& text) const {
  if (text.compare(0, context_text_.size(), context_text_) == 0) return context_text_.size();
  // Not expected for the supported decoders; continue from the common prefix.
  size_t base = 0;
  while (base < text.size() && base < context_text_.size() && text[base] == context_text_[base]) ++base;
  while (base > 0 && base < text.size() && (static_cast<unsigned char>(text[base]) & 0xC0) == 0x80) --base;
  return base;
}

std::string StreamDecoder::flush() {
  const std::string text = tok_->decode(ids_, skip_special_);
  const std::string out = text.substr(std::min(text.size(), context_end(text) + emitted_));
  ids_.clear();
  context_ = 0;
  context_text_.clear();
  emitted_ = 0;
  return out;
}

}  // namespace kestrel::text
