// util/json_limits.h: limits checked on untrusted JSON text before any DOM is built.
//
// nlohmann::json parses iteratively, but serialising (dump) and several helpers recurse, so a body
// nested a million levels deep (`{"model": [[[[...]]]]}`) would overflow a thread's stack on the
// first error message that shows the value. Every request body is scanned first: one linear pass,
// no allocation, strings and escapes skipped.
// Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <string_view>

namespace lorasync {

// Nesting depth accepted in request bodies (objects and arrays); OpenAI/vLLM bodies need < 10.
inline constexpr std::size_t kMaxJsonDepth = 64;

// The deepest nesting of objects/arrays in `text`, counting only brackets outside strings; stops
// counting once `limit` is exceeded (returns limit + 1). Malformed JSON is left to the parser.
std::size_t json_nesting_depth(std::string_view text, std::size_t limit = kMaxJsonDepth);

// InvalidInput ("<what> nests deeper than 64 levels") when `text` exceeds kMaxJsonDepth, or
// ("<what> holds a NUL byte at offset N") when it holds a raw NUL (never valid JSON; nlohmann
// would stop reading there and accept the prefix).
void check_json_depth(std::string_view text, std::string_view what = "request body");

}  // namespace lorasync
