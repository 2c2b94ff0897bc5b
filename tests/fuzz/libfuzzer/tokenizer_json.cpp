// libFuzzer: tokenizer.json as a user or a bucket hands it to us. Either lorasync::Error or a
// tokenizer that encodes and decodes a fixed text without crashing.
#include <cstdint>
#include <string_view>

#include "core/tokenizer/tokenizer.h"
#include "util/error.h"
#include "util/log.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  lorasync::log::set_level("error");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    auto tk = lorasync::tok::Tokenizer::from_json(text);
    auto ids = tk.encode("Let x = 3^{2}; then \\boxed{9}. <|im_end|> \xE2\x88\x9A" "2");
    (void)tk.decode(ids);
  } catch (const lorasync::Error&) {
  }
  return 0;
}
