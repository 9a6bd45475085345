#include "text/model_chat.h"

#include <filesystem>

#include "common/error.h"
#include "common/mapped_file.h"
#include "formats/gguf_vocab.h"
#include "text/chat_template.h"

namespace kestrel::text {

std::string ModelChat::prompt(const nlohmann::ordered_json& messages) const {
  nlohmann::ordered_json opts = options;
  opts["add_generation_prompt"] = true;
  return ChatTemplate(source).render(messages, opts);
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
