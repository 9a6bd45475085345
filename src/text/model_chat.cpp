#include "text/model_chat.h"

#include <algorithm>
#include <filesystem>

#include "common/error.h"
#include "common/mapped_file.h"
#include "formats/gguf_vocab.h"
#include "text/chat_template.h"
#include "text/utf8.h"

namespace kestrel::text {

std::string ModelChat::prompt(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools) const {
  nlohmann::ordered_json opts = options;
  opts["add_generation_prompt"] = true;
  if (!tools.is_null()) opts["tools"] = tools;
  return ChatTemplate(template_for(!tools.is_null())).render(messages, opts);
}

namespace {

// Special-token text in message strings is swapped for code points of the supplementary private
// use area that appear nowhere in the template, its options or the messages, one per special
// token, before rendering; templates pass such characters through untouched (they are neither
// whitespace nor markup), so afterwards every one of them in the prompt is a place where message
// text held that token's text. They are put back, and their byte ranges handed to the tokenizer
// as literal text.
constexpr char32_t kFirstMark = 0xF0000, kLastMark = 0xFFFFD;

struct Marks {
  std::vector<std::string> specials;  // by mark
  char32_t first = 0;                 // the mark of specials[0]; then consecutive
  bool starts[256] = {};              // bytes some special token begins with
};

void collect_text_marks(std::string_view s, std::vector<bool>& used) {
  for (size_t i = 0; i < s.size();) {
    char32_t c = 0;
    const size_t n = utf8_decode(s, i, c);
    if (n == 0) break;
    if (c >= kFirstMark && c <= kLastMark) used[size_t(c - kFirstMark)] = true;
    i += n;
  }
}

void collect_marks(const nlohmann::ordered_json& j, std::vector<bool>& used) {
  if (j.is_string()) return collect_text_marks(j.get_ref<const std::string&>(), used);
  if (j.is_structured())
    for (const auto& [k, v] : j.items()) {
      collect_text_marks(k, used);
      collect_marks(v, used);
    }
}

// Replaces, leftmost and longest first, every special token's text in `s` by its mark.
bool mark_specials(std::string& s, const Marks& m) {
  std::string out;
  bool any = false;
  for (size_t i = 0; i < s.size();) {
    if (!m.starts[static_cast<unsigned char>(s[i])]) {
      out += s[i++];
      continue;
    }
    size_t best = m.specials.size(), len = 0;
    for (size_t k = 0; k < m.specials.size(); ++k) {
      const std::string& t = m.specials[k];
      if (t.size() > len && s.compare(i, t.size(), t) == 0) best = k, len = t.size();
    }
    if (best == m.specials.size()) {
      out += s[i++];
      continue;
    }
    utf8_append(out, m.first + char32_t(best));
    i += len;
    any = true;
  }
  if (any) s = std::move(out);
  return any;
}

bool mark_specials(nlohmann::ordered_json& j, const Marks& m) {
  if (j.is_string()) return mark_specials(j.get_ref<std::string&>(), m);
  bool any = false;
  if (j.is_structured())
    for (auto& v : j) any |= mark_specials(v, m);
  return any;
}

}  // namespace

std::vector<int32_t> ModelChat::encode(const nlohmann::ordered_json& messages, const Tokenizer& tok,
                                       bool allow_special, const nlohmann::ordered_json& tools) const {
  Marks m;
  if (!allow_special) m.specials = tok.special_tokens();
  for (const std::string& t : m.specials) m.starts[static_cast<unsigned char>(t[0])] = true;
  std::vector<bool> used(size_t(kLastMark - kFirstMark + 1), false);
  if (!m.specials.empty()) {
    collect_text_marks(template_for(!tools.is_null()), used);
    collect_marks(options, used);
    collect_marks(messages, used);
    collect_marks(tools, used);
    // The first run of free marks long enough for every special token.
    size_t run = 0;
    for (size_t k = 0; k < used.size() && run < m.specials.size(); ++k) {
      run = used[k] ? 0 : run + 1;
      if (run == m.specials.size()) m.first = kFirstMark + char32_t(k + 1 - run);
    }
    if (run < m.specials.size()) fail("chat: the messages use the private code points kestrel marks message text with");
  }
  nlohmann::ordered_json marked = messages, marked_tools = tools;
  const bool in_messages = !m.specials.empty() && mark_specials(marked, m);
  const bool in_tools = !m.specials.empty() && mark_specials(marked_tools, m);
  if (!in_messages && !in_tools) return tok.encode(prompt(messages, tools), false, true);

  const std::string rendered = prompt(marked, marked_tools);
  std::string text;
  std::vector<std::pair<size_t, size_t>> literal;
  for (size_t i = 0; i < rendered.size();) {
    char32_t c = 0;
    const size_t n = utf8_decode(rendered, i, c);
    if (n == 0) {
      text += rendered[i++];
      continue;
    }
    if (c >= m.first && c < m.first + char32_t(m.specials.size())) {
      const std::string& t = m.specials[size_t(c - m.first)];
      if (!literal.empty() && literal.back().second == text.size()) literal.back().second += t.size();
      else literal.emplace_back(text.size(), text.size() + t.size());
      text += t;
    } else {
      text.append(rendered, i, n);
    }
    i += n;
  }
  return tok.encode(text, false, literal);
}

ModelChat load_model_chat(const Model& model, const std::string& path) {
  ModelChat c;
  if (model.gguf) {
    const GgufVocab v = read_gguf_vocab(model.gguf->index());
    if (v.chat_template.empty())
      fail(model.gguf->path(), ": metadata 'tokenizer.chat_template' is absent, so the model has no chat template");
    c.source = v.chat_template;
    auto name = [&](int64_t id) { return id >= 0 && size_t(id) < v.tokens.size() ? v.tokens[size_t(id)] : std::string(); };
    if (v.bos >= 0) c.options["bos_token"] = name(v.bos);
    if (v.eos >= 0) c.options["eos_token"] = name(v.eos);
    return c;
  }
  c.source = load_chat_template(path);
  if (std::string t = load_chat_template(path, true); t != c.source) c.tool_source = std::move(t);
  const std::filesystem::path cfg = std::filesystem::path(path) / "tokenizer_config.json";
  if (std::filesystem::exists(cfg)) {
    const auto j = nlohmann::json::parse(read_text_file(cfg.string()), nullptr, false);
    if (j.is_object())
      for (const char* key : {"bos_token", "eos_token", "unk_token", "pad_token"})
        if (j.contains(key) && j[key].is_string()) c.options[key] = j[key].get<std::string>();
  }
  return c;
}

}  // namespace kestrel::text
