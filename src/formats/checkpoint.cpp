#include "formats/checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "common/error.h"
#include "formats/json_file.h"

namespace kestrel {
namespace fs = std::filesystem;

Checkpoint::Checkpoint(const std::string& dir) : dir_(dir) {
  if (!fs::is_directory(dir)) fail(dir, ": not a model folder");
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  std::vector<std::string> names;
  std::map<std::string, std::string> expected;  // tensor -> shard, from the index
  if (fs::exists(index)) {
    const nlohmann::json j = read_json_file(index.string());
    auto wm = j.find("weight_map");
    if (wm == j.end() || !wm->is_object()) fail(index.string(), ": missing object 'weight_map'");
    std::set<std::string> shards;
    for (const auto& [tensor, shard] : wm->items()) {
      if (!shard.is_string()) fail(index.string(), ": weight_map entry '", tensor, "' is not a file name");
      const std::string s = shard.get<std::string>();
      if (s.find('/') != std::string::npos || s.find("..") != std::string::npos)
        fail(index.string(), ": weight_map entry '", tensor, "' names a path outside the folder: ", s);
      shards.insert(s);
      expected[tensor] = s;
    }
    names.assign(shards.begin(), shards.end());
  } else if (fs::exists(fs::path(dir) / "model.safetensors")) {
    names.push_back("model.safetensors");
  } else {
    for (const auto& e : fs::directory_iterator(dir))
      if (e.path().extension() == ".safetensors") names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
  }
  if (names.empty()) fail(dir, ": no safetensors weights (model.safetensors or an index) in this folder");

  for (const auto& n : names) {
    files_.push_back(std::make_unique<SafetensorsFile>((fs::path(dir) / n).string()));
    for (const auto& [tname, view] : files_.back()->tensors()) {
      auto [it, fresh] = by_name_.emplace(tname, &view);
      if (!fresh) fail(dir, ": tensor '", tname, "' is stored twice: in ", it->second->file, " and in ", view.file);
    }
  }
  for (const auto& [tensor, shard] : expected) {
    auto it = by_name_.find(tensor);
    if (it == by_name_.end())
      fail((fs::path(dir) / shard).string(), ": tensor '", tensor, "' listed in the index is missing");
    if (fs::path(it->second->file).filename() != shard)
      fail(index.string(), ": tensor '", tensor, "' is listed in ", shard, " but stored in ", it->second->file);
  }
}

const TensorView* Checkpoint::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : it->second;
}

const TensorView& Checkpoint::get(const std::string& name) const {
  const TensorView* t = find(name);
  if (!t) fail(dir_, ": missing tensor '", name, "'");
  return *t;
}

}  // namespace kestrel
