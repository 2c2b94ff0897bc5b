// libFuzzer: the proxy's request scanner (proxy/prompt_scan.h) on arbitrary bodies. Checks: no
// crash, no exception, agreement with serve's JSON parser (below), a scanned routed request has a
// well-formed result, and the answer's cached-token scan gives the same value split or whole.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "proxy/prompt_scan.h"
#include "util/json_limits.h"

using namespace lorasync::proxy;


extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  const bool valid = json_is_valid(body);
  // The proxy never refuses JSON that serve accepts: what nlohmann::json (serve's parser) accepts
  // within serve's depth limit, the scanner accepts. (The converse does not hold on purpose: the
  // scanner checks the grammar, as Python's json in vLLM does, so it also passes lone surrogate
  // escapes and numbers past double range, which nlohmann refuses.)
  // (Serve refuses a raw NUL before parsing: nlohmann stops reading at one.)
  if (!valid && body.find('\0') == std::string_view::npos && nlohmann::json::accept(body) &&
      lorasync::json_nesting_depth(body) <= lorasync::kMaxJsonDepth)
    std::abort();
  for (std::size_t bs : {1u, 16u}) {
    PromptScan scan;
    auto err = scan_routed_request(body, bs, scan);
    if (!err) {
      if (!valid) std::abort();  // routed a body that is not JSON
      // Whole blocks only: block_size ids, or 4 x block_size text bytes (proxy.md §3.2).
      const std::uint64_t per = scan.kind == PromptKind::kText ? 4 * bs : bs;
      if (scan.kind != PromptKind::kNone && scan.n_units / per != scan.blocks.size()) std::abort();
    } else if (err->message.empty()) {
      std::abort();  // every refusal says why
    }
  }
  std::string name;
  auto e = scan_lora_name(body, name);
  if (!e && !valid) std::abort();
  // The cached-token count of an upstream answer: split into pieces anywhere (sizes from the
  // input), the same value as the whole body.
  CachedTokensScanner whole, split;
  whole.feed(body);
  for (std::size_t at = 0, i = 0; at < size; ++i) {
    const std::size_t n = std::min<std::size_t>(size - at, 1 + data[i % size] % 97);
    split.feed(body.substr(at, n));
    at += n;
  }
  if (whole.value() != split.value()) std::abort();
  return 0;
}
