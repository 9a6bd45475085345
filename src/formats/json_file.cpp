#include "formats/json_file.h"

#include "common/error.h"
#include "common/mapped_file.h"

namespace kestrel {

nlohmann::json read_json_file(const std::string& path) {
  const std::string text = read_text_file(path);
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail(path, ": not valid JSON: ", e.what());
  }
}

void JsonFields::bad(const std::string& key, const char* want) const {
  if (!j_.contains(key)) fail(file_, ": missing field '", key, "'");
  fail(file_, ": field '", key, "' must be ", want, ", got ", j_.at(key).dump());
}

int64_t JsonFields::get_int(const std::string& key) const {
  if (!has(key) || !j_.at(key).is_number_integer()) bad(key, "an integer");
  return j_.at(key).get<int64_t>();
}
int64_t JsonFields::get_int(const std::string& key, int64_t def) const { return has(key) ? get_int(key) : def; }

double JsonFields::get_num(const std::string& key) const {
  if (!has(key) || !j_.at(key).is_number()) bad(key, "a number");
  return j_.at(key).get<double>();
}
double JsonFields::get_num(const std::string& key, double def) const { return has(key) ? get_num(key) : def; }

bool JsonFields::get_bool(const std::string& key, bool def) const {
  if (!has(key)) return def;
  if (!j_.at(key).is_boolean()) bad(key, "true or false");
  return j_.at(key).get<bool>();
}

std::string JsonFields::get_str(const std::string& key, const std::string& def) const {
  if (!has(key)) return def;
  if (!j_.at(key).is_string()) bad(key, "a string");
  return j_.at(key).get<std::string>();
}

std::vector<int64_t> JsonFields::get_int_list(const std::string& key) const {
  std::vector<int64_t> out;
  if (!has(key)) return out;
  const auto& v = j_.at(key);
  if (v.is_number_integer()) return {v.get<int64_t>()};
  if (!v.is_array()) bad(key, "an integer or a list of integers");
  for (const auto& x : v) {
    if (!x.is_number_integer()) bad(key, "an integer or a list of integers");
    out.push_back(x.get<int64_t>());
  }
  return out;
}

}  // namespace kestrel
