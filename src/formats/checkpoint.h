// The tensors of a Hugging Face model folder: one safetensors file, or shards listed by
// model.safetensors.index.json. Lookups that fail name the folder and the tensor.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "formats/safetensors.h"

namespace kestrel {

class Checkpoint {
 public:
  explicit Checkpoint(const std::string& dir);

  const std::string& dir() const { return dir_; }
  const TensorView* find(const std::string& name) const;
  const TensorView& get(const std::string& name) const;  // throws naming the tensor
  bool has(const std::string& name) const { return find(name) != nullptr; }
  const std::map<std::string, const TensorView*>& tensors() const { return by_name_; }
  size_t file_count() const { return files_.size(); }

 private:
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorView*> by_name_;
};

}  // namespace kestrel
