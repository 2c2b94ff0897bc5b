// core/tokenizer/byte_level.cpp
#include "core/tokenizer/byte_level.h"

#include <array>

#include "core/tokenizer/unicode.h"

namespace lorasync::tok {

namespace {

struct Tables {
  std::array<std::uint32_t, 256> b2c{};
  std::array<std::int16_t, 324> c2b{};  // mapped code points are all < 0x144
  Tables() {
    c2b.fill(-1);
    std::uint32_t n = 0;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      b2c[b] = printable ? static_cast<std::uint32_t>(b) : 256 + n++;
      c2b[b2c[b]] = static_cast<std::int16_t>(b);
    }
  }
};

const Tables& tables() {
  static const Tables t;
  return t;
}

}  // namespace

std::uint32_t byte_to_char(std::uint8_t b) { return tables().b2c[b]; }

int char_to_byte(std::uint32_t cp) {
  const auto& t = tables();
  return cp < t.c2b.size() ? t.c2b[cp] : -1;
}

std::string bytes_to_byte_level(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char b : bytes) utf8_append(out, byte_to_char(b));
  return out;
}

std::optional<std::string> byte_level_to_bytes(std::string_view s) {
  if (validate_utf8(s) != std::string_view::npos) return std::nullopt;
  std::string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size();) {
    std::uint32_t cp;
    i += utf8_decode(s.data(), i, cp);
    int b = char_to_byte(cp);
    if (b < 0) return std::nullopt;
    out.push_back(static_cast<char>(b));
  }
  return out;
}

}  // namespace lorasync::tok
