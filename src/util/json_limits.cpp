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
  if (json_nesting_depth(text, kMaxJsonDepth) > kMaxJsonDepth)
    throw_invalid("{} nests objects or arrays deeper than {} levels", what, kMaxJsonDepth);
}

}  // namespace lorasync
