// core/tokenizer/byte_level.h: GPT-2's byte <-> printable-character mapping (ByteLevel).
//
// Every byte maps to one code point: printable Latin-1 bytes ('!'..'~', 0xA1..0xAC, 0xAE..0xFF)
// to themselves, the other 68 bytes to U+0100.. in byte order. Vocabulary entries of byte-level
// BPE files are strings of these characters; the encoder works on raw bytes and converts the
// vocabulary once at load time instead of mapping every input byte.
// Thread-safety: pure functions on immutable tables.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace lorasync::tok {

// The code point byte b maps to.
std::uint32_t byte_to_char(std::uint8_t b);
// The byte a mapped code point stands for, or -1 when cp is not in the alphabet.
int char_to_byte(std::uint32_t cp);
// Raw bytes -> byte-level string (UTF-8 of the mapped characters).
std::string bytes_to_byte_level(std::string_view bytes);
// Byte-level string -> raw bytes; nullopt when some character is not in the alphabet.
std::optional<std::string> byte_level_to_bytes(std::string_view s);

}  // namespace lorasync::tok
