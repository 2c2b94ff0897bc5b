// proxy/prompt_scan.h: the request scanner of routed requests (proxy.md §3.1, §3.2, §5).
//
// No DOM: one validating pass over the body records the spans of the top-level `model`, `prompt`
// and `messages` values (last duplicate wins) and enforces JSON syntax and nesting <= 64; a second
// pass over the prompt span hashes whole blocks as token ids or decoded text bytes go by, building
// no token vector. Also parses `lora_name` for the adapter routes.
// Thread-safety: pure functions, thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "proxy/hash128.h"

namespace lorasync::proxy {

inline constexpr int kMaxJsonDepth = 64;

// Why a body was refused (a 400): message names the field and what was wrong.
struct ScanError {
  std::string message;
  std::string param;  // "model", "prompt", ... or empty for syntax errors
};

enum class PromptKind { kNone, kTokenIds, kText };

struct PromptScan {
  std::string model;            // decoded `model` ("" when absent)
  PromptKind kind = PromptKind::kNone;
  std::vector<Hash128> blocks;  // h1..hn, chained from h0 = H(model)
  std::uint64_t n_units = 0;    // ids or text bytes seen (whole and partial groups)
  bool stream = false;          // top-level `stream` is true (the last one, if repeated)
};

// Scans a routed request (/v1/completions, /v1/chat/completions). block_size >= 1.
// Returns the error on a body that must be answered 400.
std::optional<ScanError> scan_routed_request(std::string_view body, std::size_t block_size,
                                             PromptScan& out);

// `lora_name` of an adapter route: the body must be a JSON object with a string `lora_name`.
std::optional<ScanError> scan_lora_name(std::string_view body, std::string& name);

// The prompt tokens a replica's prefix cache served, read from its answer without a DOM: the last
// complete count under "cached_prompt_tokens" (lorasync serve) or "cached_tokens" (vLLM's
// usage.prompt_tokens_details) in a body fed in any number of pieces (a JSON answer or an SSE
// stream). Split anywhere, the pieces give the same value as the whole body.
class CachedTokensScanner {
 public:
  void feed(std::string_view piece);
  std::optional<std::uint64_t> value() const { return value_; }

 private:
  void scan(std::string_view s);
  static constexpr std::size_t kCarry = 64;  // longer than a key, its colon, spaces and count
  char carry_[2 * kCarry];
  std::size_t carry_n_ = 0;
  std::optional<std::uint64_t> value_;
};

// Validates that `body` is one well-formed JSON value (nesting <= 64). Used by fuzz tests.
bool json_is_valid(std::string_view body);

}  // namespace lorasync::proxy
