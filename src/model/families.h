// One adapter per Hugging Face architecture: maps the family's config.json keys onto
// ModelConfig. Tensor names follow from the fields (moe_prefix, expert_* names).
#pragma once
#include <functional>
#include <map>
#include <string>

#include "formats/json_file.h"
#include "model/model_config.h"

namespace kestrel {

using FamilyAdapter = std::function<void(const JsonFields& cfg, ModelConfig& m)>;

// Architecture name -> adapter. The adapter runs after the fields every family shares are read.
const std::map<std::string, FamilyAdapter>& family_adapters();

}  // namespace kestrel
