// libFuzzer: safetensors images (headers and data offsets) from adapters and checkpoints. A
// malformed image throws lorasync::Error; an accepted one has every tensor inside the buffer.
#include <cstdint>
#include <cstdlib>
#include <span>

#include "core/io/safetensors.h"
#include "util/error.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    auto f = lorasync::io::SafetensorsFile::from_bytes(std::span<const std::uint8_t>(data, size), "fuzz");
    for (const auto& t : f->tensors()) {
      if (t.data < data || t.data + t.nbytes > data + size) std::abort();
      volatile std::uint8_t sink = 0;
      for (std::size_t i = 0; i < t.nbytes; i += 4096) sink = static_cast<std::uint8_t>(sink ^ t.data[i]);  // ASan checks the span
      (void)sink;
    }
  } catch (const lorasync::Error&) {
  }
  return 0;
}
