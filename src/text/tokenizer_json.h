// Typed access to the fields of tokenizer.json. `where` names the file and the path to the object
// (e.g. "tokenizer.json: pre_tokenizer.pretokenizers[1]") so that every error says what is wrong
// and where.
#pragma once
#include <nlohmann/json.hpp>
#include <string>

#include "common/error.h"
#include "text/pretokenize_regex.h"

namespace kestrel::text::tj {

using Json = nlohmann::json;

// The first step below the file name is written "file: key", later ones "file: a.b[2].c".
inline std::string sub(const std::string& where, const std::string& key) {
  return where + (where.find(": ") == std::string::npos ? ": " : ".") + key;
}
inline std::string sub(const std::string& where, size_t index) { return cat(where, "[", index, "]"); }

inline void need_object(const Json& j, const std::string& where) {
  if (!j.is_object()) fail(where, ": must be an object, got ", j.dump().substr(0, 80));
}

inline const Json& field(const Json& j, const char* key, const std::string& where) {
  need_object(j, where);
  auto it = j.find(key);
  if (it == j.end()) fail(where, ": missing field '", key, "'");
  return *it;
}

inline bool present(const Json& j, const char* key) { return j.is_object() && j.contains(key) && !j.at(key).is_null(); }

inline std::string str(const Json& j, const char* key, const std::string& where) {
  const Json& v = field(j, key, where);
  if (!v.is_string()) fail(sub(where, key), ": must be a string, got ", v.dump().substr(0, 80));
  return v.get<std::string>();
}

inline std::string str_or(const Json& j, const char* key, const std::string& def, const std::string& where) {
  return present(j, key) ? str(j, key, where) : def;
}

inline bool bool_or(const Json& j, const char* key, bool def, const std::string& where) {
  if (!present(j, key)) return def;
  const Json& v = j.at(key);
  if (!v.is_boolean()) fail(sub(where, key), ": must be true or false, got ", v.dump().substr(0, 80));
  return v.get<bool>();
}

inline int64_t int_or(const Json& j, const char* key, int64_t def, const std::string& where) {
  if (!present(j, key)) return def;
  const Json& v = j.at(key);
  if (!v.is_number_integer()) fail(sub(where, key), ": must be an integer, got ", v.dump().substr(0, 80));
  return v.get<int64_t>();
}

inline const Json& array(const Json& j, const char* key, const std::string& where) {
  const Json& v = field(j, key, where);
  if (!v.is_array()) fail(sub(where, key), ": must be a list, got ", v.dump().substr(0, 80));
  return v;
}

inline std::string type(const Json& j, const std::string& where) { return str(j, "type", where); }

// One character given as a string, as Metaspace's replacement and Strip's content are.
char32_t one_char(const Json& j, const char* key, const std::string& where);

// {"String": "..."} or {"Regex": "..."}.
Regex pattern(const Json& j, const char* key, const std::string& where);

}  // namespace kestrel::text::tj
