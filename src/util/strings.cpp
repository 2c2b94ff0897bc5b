#include "util/strings.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>

#include "util/error.h"

namespace lorasync {

std::vector<std::string> split(std::string_view s, char sep) {
  std::vector<std::string> out;
  std::size_t start = 0;
  for (;;) {
    std::size_t pos = s.find(sep, start);
    if (pos == std::string_view::npos) {
      out.emplace_back(s.substr(start));
      return out;
    }
    out.emplace_back(s.substr(start, pos - start));
    start = pos + 1;
  }
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

bool starts_with(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }
bool ends_with(std::string_view s, std::string_view x) {
  return s.size() >= x.size() && s.substr(s.size() - x.size()) == x;
}

std::vector<std::int64_t> parse_int_list(std::string_view s, std::string_view what) {
  std::vector<std::int64_t> out;
  if (trim(s).empty()) return out;
  for (const auto& part : split(s, ',')) {
    auto t = trim(part);
    std::int64_t v = 0;
    auto [p, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
    if (t.empty() || ec != std::errc() || p != t.data() + t.size())
      throw_invalid("{}: '{}' is not an integer (in '{}')", what, t, s);
    out.push_back(v);
  }
  return out;
}

std::uint64_t parse_bytes(std::string_view s, std::string_view what) {
  auto t = trim(s);
  std::size_t i = 0;
  while (i < t.size() && (std::isdigit(static_cast<unsigned char>(t[i])) || t[i] == '.')) ++i;
  std::string num(t.substr(0, i));
  std::string unit(trim(t.substr(i)));
  char* end = nullptr;
  double v = num.empty() ? NAN : std::strtod(num.c_str(), &end);
  if (num.empty() || end != num.c_str() + num.size() || !std::isfinite(v) || v < 0)
    throw_invalid("{}: '{}' is not a size (examples: 4GiB, 512MiB, 1073741824)", what, s);
  for (auto& c : unit) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  double mul = 1;
  if (unit.empty() || unit == "b") mul = 1;
  else if (unit == "k" || unit == "kb") mul = 1e3;
  else if (unit == "kib") mul = 1024.0;
  else if (unit == "m" || unit == "mb") mul = 1e6;
  else if (unit == "mib") mul = 1024.0 * 1024;
  else if (unit == "g" || unit == "gb") mul = 1e9;
  else if (unit == "gib") mul = 1024.0 * 1024 * 1024;
  else throw_invalid("{}: unknown size unit '{}' in '{}' (use B, KiB, MiB, GiB, KB, MB, GB)", what, unit, s);
  return static_cast<std::uint64_t>(v * mul);
}

}  // namespace lorasync
