// Any byte string given to the safetensors reader either parses into tensors whose bytes lie
// inside the input, or raises kestrel::Error. Nothing else: no crash, no read out of bounds.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "common/error.h"
#include "formats/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    kestrel::SafetensorsIndex idx({data, size}, "fuzz.safetensors");
    for (const auto& [name, t] : idx.tensors()) {
      if (t.data < data || t.data + t.nbytes > data + size) std::abort();
      volatile uint8_t sink = 0;
      for (size_t i = 0; i < t.nbytes; i += 4096) sink = uint8_t(sink ^ t.data[i]);
      (void)sink;
    }
  } catch (const kestrel::Error&) {
  }
  return 0;
}
