#include "text/normalize.h"

#include <unicode/normalizer2.h>
#include <unicode/unistr.h>
#include <unicode/ustring.h>

#include <vector>

#include "text/tokenizer_json.h"
#include "text/utf8.h"

namespace kestrel::text {
namespace {

bool all_ascii(const std::string& s) {
  for (char c : s)
    if (static_cast<unsigned char>(c) >= 0x80) return false;
  return true;
}

enum class Form { NFC, NFD, NFKC, NFKD };

class UnicodeForm : public Normalizer {
 public:
  UnicodeForm(Form f, const std::string& where) {
    UErrorCode err = U_ZERO_ERROR;
    switch (f) {
      case Form::NFC: n_ = icu::Normalizer2::getNFCInstance(err); break;
      case Form::NFD: n_ = icu::Normalizer2::getNFDInstance(err); break;
      case Form::NFKC: n_ = icu::Normalizer2::getNFKCInstance(err); break;
      case Form::NFKD: n_ = icu::Normalizer2::getNFKDInstance(err); break;
    }
    if (U_FAILURE(err) || !n_) fail(where, ": ICU normalization data unavailable: ", u_errorName(err));
  }
  void normalize(std::string& s) const override {
    if (all_ascii(s)) return;  // ASCII is invariant under every normalization form
    const icu::UnicodeString u = icu::UnicodeString::fromUTF8(s);
    UErrorCode err = U_ZERO_ERROR;
    if (n_->isNormalized(u, err) && U_SUCCESS(err)) return;
    err = U_ZERO_ERROR;
    const icu::UnicodeString out = n_->normalize(u, err);
    if (U_FAILURE(err)) fail("normalizer: ICU failed: ", u_errorName(err));
    s.clear();
    out.toUTF8String(s);
  }

 private:
  const icu::Normalizer2* n_ = nullptr;
};

// Full lowercase mapping of each character on its own, as Rust's char::to_lowercase does (no
// context, so a final sigma stays σ).
class Lowercase : public Normalizer {
 public:
  void normalize(std::string& s) const override {
    std::string out;
    out.reserve(s.size());
    for (size_t i = 0; i < s.size();) {
      char32_t c = 0;
      const size_t n = utf8_decode(s, i, c);
      if (c < 0x80) {
        out += static_cast<char>(c >= 'A' && c <= 'Z' ? c + 32 : c);
      } else {
        UChar in[2];
        int32_t in_len = 0;
        U16_APPEND_UNSAFE(in, in_len, static_cast<UChar32>(c));
        UChar buf[8];
        UErrorCode err = U_ZERO_ERROR;
        const int32_t len = u_strToLower(buf, 8, in, in_len, "", &err);
        if (U_FAILURE(err)) {
          out.append(s, i, n);
        } else {
          icu::UnicodeString(buf, len).toUTF8String(out);
        }
      }
      i += n;
    }
    s = std::move(out);
  }
};

class Prepend : public Normalizer {
 public:
  explicit Prepend(std::string p) : p_(std::move(p)) {}
  void normalize(std::string& s) const override {
    if (!s.empty()) s.insert(0, p_);
  }

 private:
  std::string p_;
};

class Replace : public Normalizer {
 public:
  Replace(Regex re, std::string content) : re_(std::move(re)), content_(std::move(content)) {}
  void normalize(std::string& s) const override {
    const auto matches = re_.find_all(s);
    if (matches.empty()) return;
    std::string out;
    size_t last = 0;
    for (const auto& [b, e] : matches) {
      out.append(s, last, b - last);
      out += content_;
      last = e;
    }
    out.append(s, last, std::string::npos);
    s = std::move(out);
  }

 private:
  Regex re_;
  std::string content_;
};

class Strip : public Normalizer {
 public:
  Strip(bool left, bool right) : left_(left), right_(right) {}
  void normalize(std::string& s) const override {
    size_t b = 0, e = s.size();
    if (left_) {
      while (b < e) {
        char32_t c = 0;
        const size_t n = utf8_decode(s, b, c);
        if (!is_whitespace(c)) break;
        b += n;
      }
    }
    if (right_) {
      while (e > b) {
        size_t p = e - 1;
        while (p > b && (static_cast<unsigned char>(s[p]) & 0xC0) == 0x80) --p;
        char32_t c = 0;
        utf8_decode(s, p, c);
        if (!is_whitespace(c)) break;
        e = p;
      }
    }
    s = s.substr(b, e - b);
  }

 private:
  bool left_, right_;
};

class Sequence : public Normalizer {
 public:
  explicit Sequence(std::vector<std::unique_ptr<Normalizer>> parts) : parts_(std::move(parts)) {}
  void normalize(std::string& s) const override {
    for (const auto& p : parts_) p->normalize(s);
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> parts_;
};

}  // namespace

std::unique_ptr<Normalizer> Normalizer::from_json(const nlohmann::json& j, const std::string& where) {
  const std::string t = tj::type(j, where);
  if (t == "NFC") return std::make_unique<UnicodeForm>(Form::NFC, where);
  if (t == "NFD") return std::make_unique<UnicodeForm>(Form::NFD, where);
  if (t == "NFKC") return std::make_unique<UnicodeForm>(Form::NFKC, where);
  if (t == "NFKD") return std::make_unique<UnicodeForm>(Form::NFKD, where);
  if (t == "Lowercase") return std::make_unique<Lowercase>();
  if (t == "Prepend") return std::make_unique<Prepend>(tj::str(j, "prepend", where));
  if (t == "Replace") return std::make_unique<Replace>(tj::pattern(j, "pattern", where), tj::str(j, "content", where));
  if (t == "Strip")
    return std::make_unique<Strip>(tj::bool_or(j, "strip_left", true, where), tj::bool_or(j, "strip_right", true, where));
  if (t == "Sequence") {
    const auto& list = tj::array(j, "normalizers", where);
    std::vector<std::unique_ptr<Normalizer>> parts;
    for (size_t i = 0; i < list.size(); ++i)
      parts.push_back(from_json(list[i], tj::sub(tj::sub(where, "normalizers"), i)));
    return std::make_unique<Sequence>(std::move(parts));
  }
  fail(where, ": normalizer type '", t, "' is not supported (NFC, NFD, NFKC, NFKD, Lowercase, Prepend, Replace, ",
       "Strip, Sequence)");
}

}  // namespace kestrel::text
