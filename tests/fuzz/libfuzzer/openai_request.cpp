// libFuzzer: serve's request parsing (server/openai.h: parse_completion, and parse_chat in each chat
// format, ChatML, Qwen3's and Llama 3's, with the real Qwen2 tokenizer). Only lorasync::Error (a 400/404 with a message) may come out;
// anything else (a crash, another exception, a sanitizer report) is a finding.
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string_view>

#include "core/tokenizer/tokenizer.h"
#include "server/openai.h"
#include "util/error.h"
#include "util/log.h"

namespace {
std::unique_ptr<lorasync::tok::Tokenizer> tk;
}

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  lorasync::log::set_level("error");
  tk = std::make_unique<lorasync::tok::Tokenizer>(
      lorasync::tok::Tokenizer::load(std::string(LORASYNC_SHARED_DIR) + "/data/qwen2-tokenizer"));
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  using lorasync::tok::ChatFormat;
  for (int mode = 0; mode < 4; ++mode) {
    try {
      auto pc = mode == 0 ? lorasync::server::parse_completion(body, *tk)
                          : lorasync::server::parse_chat(body, *tk,
                                                         mode == 1   ? ChatFormat::kChatml
                                                         : mode == 2 ? ChatFormat::kQwen3
                                                                     : ChatFormat::kLlama3);
      if (pc.prompts.empty()) std::abort();  // accepted with nothing to generate from
    } catch (const lorasync::Error& e) {
      if (std::string_view(e.what()).empty()) std::abort();
    }
  }
  return 0;
}
