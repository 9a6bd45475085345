// Writes a safetensors file tensor by tensor: the header (names, dtypes, shapes, offsets) first,
// then each tensor's bytes in the order declared, so a writer never holds more than one tensor.
#pragma once
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "formats/dtype.h"

namespace kestrel {

struct TensorSpec {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  size_t nbytes() const;
};

class SafetensorsWriter {
 public:
  // Creates `path` and writes the header for `tensors`, whose data follow in this order.
  SafetensorsWriter(const std::string& path, std::vector<TensorSpec> tensors,
                    const std::map<std::string, std::string>& metadata = {{"format", "pt"}});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // The bytes of the next tensor, which must be `name` and hold exactly its size (in one call or
  // several consecutive calls).
  void write(const std::string& name, const void* data, size_t n);
  // Checks that every tensor was written in full and closes the file.
  void finish();

 private:
  std::string path_;
  std::vector<TensorSpec> tensors_;
  size_t next_ = 0, written_ = 0;  // tensor being written, bytes of it so far
  std::FILE* f_ = nullptr;
};

}  // namespace kestrel
