// util/strings.h: small string helpers shared by the command-line tools and parsers.
// Thread-safety: all functions are thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace lorasync {

std::vector<std::string> split(std::string_view s, char sep);
std::string_view trim(std::string_view s);
bool starts_with(std::string_view s, std::string_view prefix);
bool ends_with(std::string_view s, std::string_view suffix);

// "1,2, 3" -> {1,2,3}. InvalidInput naming `what` and the bad element otherwise. Empty -> {}.
std::vector<std::int64_t> parse_int_list(std::string_view s, std::string_view what);

// "4GiB", "512MiB", "1.5GB", "1073741824" -> bytes. InvalidInput naming `what` otherwise.
std::uint64_t parse_bytes(std::string_view s, std::string_view what);

}  // namespace lorasync
