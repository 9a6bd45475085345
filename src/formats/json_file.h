// JSON files of a model folder (config.json, generation_config.json, ...) and typed access to
// their fields with errors that name the file and the key.
#pragma once
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace kestrel {

nlohmann::json read_json_file(const std::string& path);

// A JSON object and the file it came from.
class JsonFields {
 public:
  JsonFields(const nlohmann::json& j, std::string file) : j_(j), file_(std::move(file)) {}

  bool has(const std::string& key) const { return j_.contains(key) && !j_.at(key).is_null(); }
  int64_t get_int(const std::string& key) const;
  int64_t get_int(const std::string& key, int64_t def) const;
  double get_num(const std::string& key) const;
  double get_num(const std::string& key, double def) const;
  bool get_bool(const std::string& key, bool def) const;
  std::string get_str(const std::string& key, const std::string& def) const;
  std::vector<int64_t> get_int_list(const std::string& key) const;  // int or list of ints; [] if absent
  const nlohmann::json& raw() const { return j_; }
  const std::string& file() const { return file_; }

 private:
  [[noreturn]] void bad(const std::string& key, const char* want) const;
  const nlohmann::json& j_;
  std::string file_;
};

}  // namespace kestrel
