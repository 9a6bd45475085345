// kestrel tokenize: text to ids (one line, comma-separated) or ids back to text, with a
// tokenizer.json.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "apps/commands.h"
#include "common/error.h"
#include "common/mapped_file.h"
#include "text/tokenizer.h"

namespace kestrel::apps {
namespace {

std::vector<int32_t> parse_ids(const std::string& s) {
  std::vector<int32_t> ids;
  size_t i = 0;
  while (i < s.size()) {
    while (i < s.size() && (s[i] == ' ' || s[i] == ',' || s[i] == '\n' || s[i] == '\t')) ++i;
    if (i == s.size()) break;
    size_t j = i;
    while (j < s.size() && s[j] >= '0' && s[j] <= '9') ++j;
    if (j == i || j - i > 10) fail("--decode: expected comma-separated token ids, got '", s.substr(i, 20), "'");
    const long long v = std::stoll(s.substr(i, j - i));
    if (v > INT32_MAX) fail("--decode: token id ", v, " is out of range");
    ids.push_back(static_cast<int32_t>(v));
    i = j;
  }
  return ids;
}

struct Options {
  std::string tokenizer, text, text_file, decode;
  bool no_special = false;
};

}  // namespace

Run add_tokenize(CLI::App& app) {
  auto o = std::make_shared<Options>();
  app.add_option("--tokenizer", o->tokenizer, "tokenizer.json of a Hugging Face model")->required();
  auto* text = app.add_option("--text", o->text, "Text to encode");
  auto* file = app.add_option("--text-file", o->text_file, "File whose UTF-8 contents to encode");
  auto* dec = app.add_option("--decode", o->decode, "Comma-separated ids to decode instead");
  text->excludes(file)->excludes(dec);
  file->excludes(dec);
  app.add_flag("--no-special", o->no_special,
               "Encode: no BOS/EOS and special-token text is plain text. Decode: drop special tokens");
  return [o, text, file, dec]() {
    if (!*text && !*file && !*dec) fail("tokenize: give --text, --text-file or --decode");
    const text::Tokenizer tok = text::Tokenizer::from_file(o->tokenizer);
    if (*dec) {
      const std::string out = tok.decode(parse_ids(o->decode), o->no_special);
      std::printf("%s\n", out.c_str());
      return 0;
    }
    const std::string input = *file ? read_text_file(o->text_file) : o->text;
    const auto ids = tok.encode(input, !o->no_special, !o->no_special);
    std::string line;
    for (size_t i = 0; i < ids.size(); ++i) {
      if (i) line += ',';
      line += std::to_string(ids[i]);
    }
    std::printf("%s\n", line.c_str());
    return 0;
  };
}

}  // namespace kestrel::apps
