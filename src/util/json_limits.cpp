#include "util/json_limits.h"

#include "util/error.h"

namespace lorasync {

std::size_t json_nesting_depth(std::string_view text, std::size_t limit) {
  std::size_t depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
      continue;
    }
    switch (c) {
      case '"': in_string = true; break;
      case '[':
      case '{':
        if (++depth > deepest) {
          deepest = depth;
          if (deepest > limit) return limit + 1;
        }
        break;
      case ']':
      case '}':
        if (depth > 0) --depth;
        break;
      default: break;
    }
  }
  return deepest;
}

void check_json_depth(std::string_view text, std::string_view what) {
  // A raw NUL is never valid JSON, but nlohmann::json stops reading at one and would accept
  // `{"model": "m"}\0<anything>` (found by the prompt-scanner fuzzer against serve's parser).
  if (auto nul = text.find('\0'); nul != std::string_view::npos)
    throw_invalid("{} holds a NUL byte at offset {} (not valid JSON)", what, nul);
  if (json_nesting_depth(text, kMaxJsonDepth) > kMaxJsonDepth)
    throw_invalid("{} nests objects or arrays deeper than {} levels", what, kMaxJsonDepth);
}

}  // namespace lorasync
