// libFuzzer: serve's request parsing (server/openai.h: parse_completion, parse_chat with the real
// Qwen2 tokenizer and chat template). Only lorasync::Error (a 400/404 with a message) may come out;
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
  for (bool chat : {false, true}) {
    try {
      auto pc = chat ? lorasync::server::parse_chat(body, *tk) : lorasync::server::parse_completion(body, *tk);
      if (pc.prompts.empty()) std::abort();  // accepted with nothing to generate from
    } catch (const lorasync::Error& e) {
      if (std::string_view(e.what()).empty()) std::abort();
    }
  }
  return 0;
}
