// The scanner is a hand-written recursive-descent validator (bounded depth, so bounded recursion)
// that remembers three top-level spans. Decoding of strings resolves escapes to UTF-8 bytes, so an
// escaped and a literal prompt hash alike; lone surrogates are encoded as 3-byte sequences
// (WTF-8), which is what a permissive decoder does.
#include "proxy/prompt_scan.h"

#include <bit>
#include <cstring>
#include <memory>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <fmt/format.h>
#include <limits>

namespace lorasync::proxy {
namespace {

enum class VType { kNone, kString, kNumber, kObject, kArray, kTrue, kFalse, kNull };

struct Span {
  const char* begin = nullptr;
  const char* end = nullptr;
  VType type = VType::kNone;
  bool present() const { return type != VType::kNone; }
};

inline bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

int hex_val(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

void append_utf8(std::uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// The value of the n (1-8) ASCII digits in the low bytes of x (little-endian: the first digit in
// the lowest byte): the digits moved to the top bytes (zero bytes, i.e. leading zeros, below
// them), then pairs, quads and the eight combined by multiplies.
inline std::uint64_t swar_digits(std::uint64_t x, int n) {
  std::uint64_t t = n == 8 ? x : x << (8 * (8 - n));
  t = ((t & 0x0F0F0F0F0F0F0F0FULL) * 2561) >> 8;
  t = ((t & 0x00FF00FF00FF00FFULL) * 6553601) >> 16;
  return ((t & 0x0000FFFF0000FFFFULL) * 42949672960001ULL) >> 32;
}

// Parses one validated JSON integer token at p (no fraction/exponent). False if it is not an
// integer within int64.
bool parse_int64(const char*& p, const char* e, std::int64_t& v) {
  const char* s = p;
  bool neg = false;
  if (p < e && *p == '-') {
    neg = true;
    ++p;
  }
  const std::uint64_t limit = neg ? std::uint64_t{1} << 63 : (std::uint64_t{1} << 63) - 1;
  std::uint64_t acc = 0;
  bool overflow = false;
  const char* ds = p;
  // Eight bytes at once where there are eight: the run of leading digits (a token id has 1-6) is
  // found and converted without a loop per digit (this function was the proxy's largest user-space
  // symbol). The bytes read are all within [p, e).
  if (e - p >= 8) {
    std::uint64_t x;
    std::memcpy(&x, p, 8);
    if constexpr (std::endian::native == std::endian::big) x = __builtin_bswap64(x);
    constexpr std::uint64_t k30 = 0x3030303030303030ULL, kF0 = 0xF0F0F0F0F0F0F0F0ULL;
    // A byte is a digit iff its high nibble is 3 and so is that of byte + 6 (0x30-0x39); a carry
    // out of a byte >= 0xFA only reaches the bytes after it, which follow a non-digit anyway.
    const std::uint64_t bad = ((x & kF0) ^ k30) | (((x + 0x0606060606060606ULL) & kF0) ^ k30);
    const int n = bad == 0 ? 8 : std::countr_zero(bad) / 8;
    if (n > 0) {
      acc = swar_digits(x, n);
      p += n;
    }
  }
  // Up to 18 digits cannot overflow (10^18 < 2^63): no check per digit there (a division per
  // digit was the scan's largest cost on token-id prompts).
  while (p < e && p - ds < 18 && *p >= '0' && *p <= '9') acc = acc * 10 + static_cast<std::uint64_t>(*p++ - '0');
  while (p < e && *p >= '0' && *p <= '9') {
    auto d = static_cast<std::uint64_t>(*p - '0');
    if (acc > (limit - d) / 10) overflow = true;
    else acc = acc * 10 + d;
    ++p;
  }
  if (p == ds) {
    p = s;
    return false;
  }
  if (p < e && (*p == '.' || *p == 'e' || *p == 'E')) return false;
  if (overflow) return false;
  v = neg ? static_cast<std::int64_t>(~acc + 1) : static_cast<std::int64_t>(acc);
  return true;
}

// Validating pass.
class Validator {
 public:
  Validator(const char* b, const char* e) : p_(b), end_(e) {}

  void ws() {
    while (p_ < end_ && is_ws(*p_)) ++p_;
  }
  bool at_end() {
    ws();
    return p_ == end_;
  }
  const char* pos() const { return p_; }

  // After an element of an array or object: skips whitespace, then consumes a ',' (1: another
  // element follows) or `close` (0: the end); anything else is left in place (-1).
  int after_element(char close) {
    ws();
    if (p_ < end_ && *p_ == ',') {
      ++p_;
      return 1;
    }
    if (p_ < end_ && *p_ == close) {
      ++p_;
      return 0;
    }
    return -1;
  }

  // One value; fills `span` with its extent and type.
  bool value(int depth, Span* span) {
    ws();
    if (p_ >= end_) return fail("unexpected end of JSON");
    const char* start = p_;
    VType t;
    switch (*p_) {
      case '"': t = VType::kString; if (!string()) return false; break;
      case '{': t = VType::kObject; if (!object(depth + 1)) return false; break;
      case '[': t = VType::kArray; if (!array(depth + 1)) return false; break;
      case 't': t = VType::kTrue; if (!literal("true")) return false; break;
      case 'f': t = VType::kFalse; if (!literal("false")) return false; break;
      case 'n': t = VType::kNull; if (!literal("null")) return false; break;
      default: t = VType::kNumber; if (!number()) return false; break;
    }
    if (span) *span = {start, p_, t};
    return true;
  }

  // An array of JSON integers, each within int64, validated and parsed into `out` in one pass
  // (parse_int64, as the prompt's hashing would). Anything else (empty, a fraction or an exponent,
  // out of range, a leading zero, another type, a syntax error) returns false with the position
  // restored: the generic validation then runs (and reports what is wrong) and the hashing parses
  // the span itself.
  bool int_array(std::vector<std::int64_t>& out) {
    const char* const start = p_;
    out.clear();
    ++p_;  // '['
    for (;;) {
      ws();
      if (fast_tokens(out) == 0) {  // one token the slow way: a sign, a long one, a refusal, the tail
        const char* const digits = p_ < end_ && *p_ == '-' ? p_ + 1 : p_;
        const bool leading_zero = digits + 1 < end_ && digits[0] == '0' && digits[1] >= '0' && digits[1] <= '9';
        std::int64_t v = 0;
        if (leading_zero || !parse_int64(p_, end_, v)) {
          p_ = start;
          return false;
        }
        out.push_back(v);
      }
      const int next = after_element(']');
      if (next > 0) continue;
      if (next == 0) return true;
      p_ = start;
      return false;
    }
  }

  // The common run of a token-id prompt, 64 bytes at a time: non-negative ids of 1-8 digits
  // separated by "," or ", " (what JSON encoders write). Bit masks of the window's digits, commas
  // and spaces give every token's start and end at once, so the tokens convert independently of
  // one another (token by token, each next start waited on the previous one's length). Starts at
  // a token; consumes whole tokens and the separators between them and stops after a token (the
  // caller's after_element() then takes what follows). Anything unusual stops it before the
  // window: a sign, a leading zero, a longer id, other whitespace, ",," or a window that is not
  // all digits, commas and spaces before its first other byte. Returns the tokens appended.
  std::size_t fast_tokens(std::vector<std::int64_t>& out) {
#if defined(__SSE2__)
    std::size_t total = 0;
    const char* after_last = p_;  // just after the last token appended
    // Stops: back to just after the last token appended (none: p_ is where it was).
    const auto stop = [&] {
      if (total > 0) p_ = after_last;
      return total;
    };
    // 64 bytes of window and 8 beyond, so that every 8-byte load of a token in it is in bounds.
    while (end_ - p_ >= 72) {
      const char* const q = p_;  // at a token's first byte
      std::uint64_t dig = 0, com = 0, spc = 0, zer = 0;
      for (int k = 0; k < 4; ++k) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * k));
        // '0'-'9' as signed bytes: greater than '0' - 1 and less than '9' + 1.
        const __m128i d = _mm_and_si128(_mm_cmpgt_epi8(v, _mm_set1_epi8('0' - 1)), _mm_cmplt_epi8(v, _mm_set1_epi8('9' + 1)));
        const auto bits = [](__m128i m) { return static_cast<std::uint64_t>(static_cast<std::uint16_t>(_mm_movemask_epi8(m))); };
        dig |= bits(d) << (16 * k);
        com |= bits(_mm_cmpeq_epi8(v, _mm_set1_epi8(','))) << (16 * k);
        spc |= bits(_mm_cmpeq_epi8(v, _mm_set1_epi8(' '))) << (16 * k);
        zer |= bits(_mm_cmpeq_epi8(v, _mm_set1_epi8('0'))) << (16 * k);
      }
      if ((dig & 1) == 0) return stop();  // not an id here (a sign, say)
      const std::uint64_t other = ~(dig | com | spc);
      const int limit = other ? std::countr_zero(other) : 64;  // bytes [0, limit): digits, commas, spaces
      const std::uint64_t in = limit == 64 ? ~std::uint64_t{0} : (std::uint64_t{1} << limit) - 1;
      // A token ends where the next byte is no digit; at bit 63 the next byte is beyond the window.
      std::uint64_t ends = dig & in & ~(dig >> 1);
      if (limit == 64) ends &= ~(std::uint64_t{1} << 63);
      if (ends == 0) return stop();
      const int last = 63 - std::countl_zero(ends);
      const std::uint64_t upto = last == 63 ? ~std::uint64_t{0} : (std::uint64_t{2} << last) - 1;
      const std::uint64_t starts = dig & ~(dig << 1) & upto;
      // Separators "," or ", " only: a comma follows a digit, a space follows a comma, and a token
      // (past the first) follows a comma or a space. So a separator holds exactly one comma.
      if (((com & upto) & ~(dig << 1)) != 0 || ((spc & upto) & ~(com << 1)) != 0 ||
          ((starts & ~std::uint64_t{1}) & ~((com | spc) << 1)) != 0)
        return stop();
      if ((starts & zer & (dig >> 1)) != 0) return stop();  // a leading zero: the slow path refuses it
      // At most 32 tokens fit in 64 bytes ("1,1,..."). (No popcount: without -mpopcnt it is a
      // library call.)
      const std::size_t base = out.size();
      out.resize(base + 32);
      std::int64_t* const dst = out.data() + base;
      std::size_t got = 0;
      for (std::uint64_t st = starts; st != 0; st &= st - 1) {
        const int b = std::countr_zero(st);
        const int len = std::countr_zero(ends >> b) + 1;
        if (len > 8) {  // a longer id: stop before it (the slow path parses it)
          out.resize(base + got);
          total += got;
          return stop();
        }
        std::uint64_t x;
        std::memcpy(&x, q + b, 8);
        dst[got++] = static_cast<std::int64_t>(swar_digits(x, len));
        after_last = q + b + len;
      }
      out.resize(base + got);
      total += got;
      // On to the next window if the separator after its last token is plain; else the caller
      // takes it from after that token.
      const char* t = q + last + 1;
      if (t < end_ && *t == ',') ++t;
      else return stop();
      if (t < end_ && *t == ' ') ++t;
      if (!(t < end_ && *t >= '0' && *t <= '9')) return stop();
      p_ = t;
    }
    return stop();
#else
    (void)out;
    return 0;
#endif
  }

  // The top-level object, recording values of interesting keys (last wins). With `ids`, the
  // values of keys[i] that are arrays of integers are also parsed into ids[i] (`captured[i]`
  // says whether the recorded value was), so the prompt's integers are read once.
  bool top_object(const char* const* keys, Span* spans, int n_keys, std::vector<std::int64_t>* ids = nullptr,
                  bool* captured = nullptr) {
    ws();
    if (p_ >= end_ || *p_ != '{') return fail("the request body must be a JSON object");
    ++p_;
    ws();
    if (p_ < end_ && *p_ == '}') {
      ++p_;
      return true;
    }
    std::string key;
    while (true) {
      ws();
      const char* ks = p_;
      if (p_ >= end_ || *p_ != '"') return fail("expected a string key");
      if (!string()) return false;
      key.clear();
      decode_string(ks, p_, key);
      ws();
      if (p_ >= end_ || *p_ != ':') return fail("expected ':'");
      ++p_;
      Span s;
      int which = -1;
      for (int i = 0; i < n_keys; ++i)
        if (key == keys[i]) which = i;
      ws();
      const char* const vs = p_;
      if (ids && which >= 0 && p_ < end_ && *p_ == '[' && int_array(ids[which])) {
        s = {vs, p_, VType::kArray};
        captured[which] = true;
      } else {
        if (!value(1, &s)) return false;
        if (captured && which >= 0) captured[which] = false;
      }
      if (which >= 0) spans[which] = s;
      const int next = after_element('}');
      if (next > 0) continue;
      if (next == 0) return true;
      return fail("expected ',' or '}' in object");
    }
  }

  const std::string& error() const { return error_; }

  // Decodes a validated string token [b, e) (with quotes) into UTF-8 bytes.
  static void decode_string(const char* b, const char* e, std::string& out) { decode_escapes(b + 1, e - 1, out); }

  // Decodes the inside [p, q) of a validated string.
  static void decode_escapes(const char* p, const char* q, std::string& out) {
    while (p < q) {
      const char* bs = static_cast<const char*>(std::memchr(p, '\\', static_cast<std::size_t>(q - p)));
      if (!bs) {
        out.append(p, q);
        return;
      }
      out.append(p, bs);
      p = bs + 1;
      char c = *p++;
      switch (c) {
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          std::uint32_t cp = read_hex4(p);
          p += 4;
          if (cp >= 0xD800 && cp < 0xDC00 && q - p >= 6 && p[0] == '\\' && p[1] == 'u') {
            std::uint32_t lo = read_hex4(p + 2);
            if (lo >= 0xDC00 && lo < 0xE000) {
              cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
              p += 6;
            }
          }
          append_utf8(cp, out);
          break;
        }
        default: out += c; break;  // \" \\ \/
      }
    }
  }

 private:
  static std::uint32_t read_hex4(const char* p) {
    std::uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v = v * 16 + static_cast<std::uint32_t>(hex_val(p[i]));
    return v;
  }

  bool fail(const char* what) {
    if (error_.empty()) error_ = what;
    return false;
  }

  bool literal(const char* lit) {
    std::size_t n = std::strlen(lit);
    if (static_cast<std::size_t>(end_ - p_) < n || std::memcmp(p_, lit, n) != 0)
      return fail("invalid literal");
    p_ += n;
    return true;
  }

  bool string() {
    ++p_;  // opening quote
    while (true) {
      while (p_ < end_ && *p_ != '"' && *p_ != '\\' && static_cast<unsigned char>(*p_) >= 0x20 &&
             static_cast<unsigned char>(*p_) < 0x80)
        ++p_;
      if (p_ >= end_) return fail("unterminated string");
      char c = *p_;
      if (static_cast<unsigned char>(c) >= 0x80) {
        if (!utf8_sequence()) return fail("invalid UTF-8 in string");
        continue;
      }
      if (c == '"') {
        ++p_;
        return true;
      }
      if (c != '\\') return fail("control character in string");
      ++p_;
      if (p_ >= end_) return fail("unterminated string");
      c = *p_++;
      if (c == 'u') {
        if (end_ - p_ < 4) return fail("bad \\u escape");
        for (int i = 0; i < 4; ++i)
          if (hex_val(p_[i]) < 0) return fail("bad \\u escape");
        p_ += 4;
      } else if (!std::strchr("\"\\/bfnrt", c) || c == 0) {
        return fail("bad escape in string");
      }
    }
  }

  // One multi-byte UTF-8 sequence at p_ (RFC 3629: no overlongs, no surrogates, <= U+10FFFF).
  bool utf8_sequence() {
    auto b = [&](std::ptrdiff_t i) { return static_cast<unsigned char>(p_[i]); };
    unsigned char c0 = b(0);
    std::ptrdiff_t left = end_ - p_;
    auto cont = [&](std::ptrdiff_t i) { return i < left && (b(i) & 0xC0) == 0x80; };
    if (c0 >= 0xC2 && c0 <= 0xDF) {
      if (!cont(1)) return false;
      p_ += 2;
    } else if (c0 >= 0xE0 && c0 <= 0xEF) {
      if (!cont(1) || !cont(2)) return false;
      if (c0 == 0xE0 && b(1) < 0xA0) return false;
      if (c0 == 0xED && b(1) >= 0xA0) return false;
      p_ += 3;
    } else if (c0 >= 0xF0 && c0 <= 0xF4) {
      if (!cont(1) || !cont(2) || !cont(3)) return false;
      if (c0 == 0xF0 && b(1) < 0x90) return false;
      if (c0 == 0xF4 && b(1) >= 0x90) return false;
      p_ += 4;
    } else {
      return false;
    }
    return true;
  }

  bool digits() {
    const char* s = p_;
    while (p_ < end_ && *p_ >= '0' && *p_ <= '9') ++p_;
    return p_ > s;
  }

  bool number() {
    if (p_ < end_ && *p_ == '-') ++p_;
    if (p_ >= end_) return fail("invalid number");
    if (*p_ == '0') {
      ++p_;
    } else if (*p_ >= '1' && *p_ <= '9') {
      digits();
    } else {
      return fail("invalid JSON value");
    }
    if (p_ < end_ && *p_ == '.') {
      ++p_;
      if (!digits()) return fail("invalid number");
    }
    if (p_ < end_ && (*p_ == 'e' || *p_ == 'E')) {
      ++p_;
      if (p_ < end_ && (*p_ == '+' || *p_ == '-')) ++p_;
      if (!digits()) return fail("invalid number");
    }
    return true;
  }

  bool object(int depth) {
    if (depth > kMaxJsonDepth) return fail("JSON nesting deeper than 64");
    ++p_;
    ws();
    if (p_ < end_ && *p_ == '}') {
      ++p_;
      return true;
    }
    while (true) {
      ws();
      if (p_ >= end_ || *p_ != '"') return fail("expected a string key");
      if (!string()) return false;
      ws();
      if (p_ >= end_ || *p_ != ':') return fail("expected ':'");
      ++p_;
      if (!value(depth, nullptr)) return false;
      const int next = after_element('}');
      if (next > 0) continue;
      if (next == 0) return true;
      return fail("expected ',' or '}' in object");
    }
  }

  bool array(int depth) {
    if (depth > kMaxJsonDepth) return fail("JSON nesting deeper than 64");
    ++p_;
    ws();
    if (p_ < end_ && *p_ == ']') {
      ++p_;
      return true;
    }
    while (true) {
      if (!value(depth, nullptr)) return false;
      const int next = after_element(']');
      if (next > 0) continue;
      if (next == 0) return true;
      return fail("expected ',' or ']' in array");
    }
  }

  const char* p_;
  const char* end_;
  std::string error_;
};

// Chained block hasher: h_i = H(h_{i-1} || kind || payload).
class BlockHasher {
 public:
  BlockHasher(const BlockHasher&) = delete;
  BlockHasher& operator=(const BlockHasher&) = delete;
  // `max_bytes`: an upper bound of the bytes the prompt can feed (the blocks are reserved for it).
  BlockHasher(Hash128 seed, std::uint8_t kind, std::size_t group_bytes, std::size_t max_bytes,
              std::vector<Hash128>& out)
      : group_(group_bytes), out_(out) {
    if (17 + group_bytes > sizeof inline_) {
      heap_ = std::make_unique_for_overwrite<char[]>(17 + group_bytes);
      buf_ = heap_.get();
    }
    std::memcpy(buf_, &seed, 16);
    buf_[16] = static_cast<char>(kind);
    out_.reserve(out_.size() + max_bytes / group_bytes);
  }
  void feed(const char* p, std::size_t n) {
    while (n > 0) {
      std::size_t take = std::min(n, group_ - fill_);
      std::memcpy(buf_ + 17 + fill_, p, take);
      fill_ += take;
      p += take;
      n -= take;
      if (fill_ == group_) {
        Hash128 h = hash128(buf_, 17 + group_);
        out_.push_back(h);
        std::memcpy(buf_, &h, 16);
        fill_ = 0;
      }
    }
  }

 private:
  // Blocks of up to 64 token ids (or 128 text bytes) are hashed from the stack.
  char inline_[17 + 8 * 64];
  std::unique_ptr<char[]> heap_;
  char* buf_ = inline_;
  std::size_t group_;
  std::size_t fill_ = 0;
  std::vector<Hash128>& out_;
};

ScanError field_error(std::string_view param, const char* what) {
  ScanError e;
  e.message = fmt::format("'{}' {}", param, what);
  e.param = std::string(param);
  return e;
}

const char* skip_ws(const char* p, const char* e) {
  while (p < e && is_ws(*p)) ++p;
  return p;
}

// Skips one validated value starting at p (used to step over array elements).
const char* skip_value(const char* p, const char* e) {
  Validator v(p, e);
  v.value(0, nullptr);
  return v.pos();
}

std::optional<ScanError> hash_prompt(Span s, std::string_view param, std::size_t block_size,
                                     Hash128 seed, PromptScan& out, const std::vector<std::int64_t>* ids = nullptr) {
  if (ids) {  // an array of integers, already validated and parsed: token ids
    out.kind = PromptKind::kTokenIds;
    BlockHasher h(seed, 0x01, 8 * block_size, 8 * ids->size(), out.blocks);
    static_assert(std::endian::native == std::endian::little, "token ids are hashed as little-endian int64");
    h.feed(reinterpret_cast<const char*>(ids->data()), 8 * ids->size());
    out.n_units += ids->size();
    return std::nullopt;
  }
  switch (s.type) {
    case VType::kNone:
    case VType::kNull:
      return std::nullopt;
    case VType::kNumber:
    case VType::kTrue:
    case VType::kFalse:
    case VType::kObject:
      return field_error(param, "must be a string or an array");
    case VType::kString: {
      out.kind = PromptKind::kText;
      // A text prompt feeds at most as many bytes as its JSON string holds.
      BlockHasher h(seed, 0x02, 4 * block_size, static_cast<std::size_t>(s.end - s.begin), out.blocks);
      // Decode in pieces: raw runs are fed directly; escapes are decoded one by one.
      const char* p = s.begin + 1;
      const char* q = s.end - 1;
      std::string dec;
      while (p < q) {
        const char* bs = static_cast<const char*>(std::memchr(p, '\\', static_cast<std::size_t>(q - p)));
        const char* run_end = bs ? bs : q;
        h.feed(p, static_cast<std::size_t>(run_end - p));
        out.n_units += static_cast<std::uint64_t>(run_end - p);
        if (!bs) break;
        // One escape (a surrogate pair counts as one).
        const char* esc_end = bs + 2;
        if (bs[1] == 'u') {
          esc_end = bs + 6;
          if (esc_end + 6 <= q && esc_end[0] == '\\' && esc_end[1] == 'u') esc_end += 6;
        }
        dec.clear();
        Validator::decode_escapes(bs, esc_end, dec);
        h.feed(dec.data(), dec.size());
        out.n_units += dec.size();
        p = esc_end;
      }
      return std::nullopt;
    }
    case VType::kArray: {
      const char* p = skip_ws(s.begin + 1, s.end);
      if (*p == ']') return std::nullopt;  // empty
      if (*p == '[') {                       // batch: route on the first element
        const char* e = skip_value(p, s.end);
        return hash_prompt(Span{p, e, VType::kArray}, param, block_size, seed, out);
      }
      bool first_int = (*p == '-' || (*p >= '0' && *p <= '9'));
      if (first_int) {
        const char* t = p;
        std::int64_t v;
        first_int = parse_int64(t, s.end, v);
        // A first element with a fraction or exponent is a float: not token ids.
        if (!first_int) {
          const char* t2 = p;
          if (*t2 == '-') ++t2;
          while (t2 < s.end && *t2 >= '0' && *t2 <= '9') ++t2;
          if (!(t2 < s.end && (*t2 == '.' || *t2 == 'e' || *t2 == 'E')))
            return field_error(param, "token id out of int64 range");
        }
      }
      if (!first_int) return std::nullopt;  // strings, messages, floats: zero blocks
      out.kind = PromptKind::kTokenIds;
      // Each id takes at least two characters of the array ("1,"): at most len/2 ids of 8 bytes.
      BlockHasher h(seed, 0x01, 8 * block_size, 8 * (static_cast<std::size_t>(s.end - s.begin) / 2 + 1), out.blocks);
      while (true) {
        p = skip_ws(p, s.end);
        std::int64_t v;
        const char* t = p;
        if (!parse_int64(t, s.end, v))
          return field_error(param, "must be a list of integer token ids");
        p = t;
        h.feed(reinterpret_cast<const char*>(&v), 8);  // little-endian hosts
        ++out.n_units;
        p = skip_ws(p, s.end);
        if (*p == ',') {
          ++p;
          continue;
        }
        break;  // ']'
      }
      return std::nullopt;
    }
  }
  return std::nullopt;
}

}  // namespace

std::optional<ScanError> scan_routed_request(std::string_view body, std::size_t block_size,
                                             PromptScan& out) {
  out = PromptScan{};
  static const char* const kKeys[] = {"model", "prompt", "messages", "stream"};
  Span spans[4];
  // The integers of `prompt` and `messages` when they are token ids (reused from call to call).
  thread_local std::vector<std::int64_t> ids[4];
  bool captured[4] = {false, false, false, false};
  Validator v(body.data(), body.data() + body.size());
  if (!v.top_object(kKeys, spans, 4, ids, captured) || !v.at_end())
    return ScanError{"invalid JSON body: " + (v.error().empty() ? std::string("trailing data") : v.error()), ""};
  out.stream = spans[3].type == VType::kTrue;
  if (spans[0].present()) {
    if (spans[0].type != VType::kString) return ScanError{"'model' must be a string", "model"};
    Validator::decode_string(spans[0].begin, spans[0].end, out.model);
  }
  Hash128 seed = hash128(out.model);
  if (spans[1].present()) return hash_prompt(spans[1], "prompt", block_size, seed, out, captured[1] ? &ids[1] : nullptr);
  if (spans[2].present()) return hash_prompt(spans[2], "messages", block_size, seed, out, captured[2] ? &ids[2] : nullptr);
  return std::nullopt;
}

std::optional<ScanError> scan_lora_name(std::string_view body, std::string& name) {
  static const char* const kKeys[] = {"lora_name"};
  Span span;
  Validator v(body.data(), body.data() + body.size());
  if (!v.top_object(kKeys, &span, 1) || !v.at_end())
    return ScanError{"invalid JSON body: " + (v.error().empty() ? std::string("trailing data") : v.error()), ""};
  if (span.type != VType::kString) return ScanError{"'lora_name' must be a string", "lora_name"};
  name.clear();
  Validator::decode_string(span.begin, span.end, name);
  return std::nullopt;
}

bool json_is_valid(std::string_view body) {
  Validator v(body.data(), body.data() + body.size());
  return v.value(0, nullptr) && v.at_end();
}

void CachedTokensScanner::scan(std::string_view s) {
  // One pass for the underscore of the keys' common stem `"cached_` (memchr), then which key it
  // is: JSON answers are full of quotes, so searching each whole key from every quote cost several
  // times more. A GRPO answer is kilobytes of token ids and logprobs per choice with few
  // underscores, so memchr skips most of it (not timed against memmem separately).
  static constexpr std::string_view kStem = "\"cached_";
  const char* p = s.data();
  const char* const end = s.data() + s.size();
  if (s.size() < kStem.size()) return;
  p += kStem.size() - 1;  // the stem's underscore cannot come earlier
  while (p < end) {
    const void* hit = std::memchr(p, '_', static_cast<std::size_t>(end - p));
    if (hit == nullptr) break;
    const char* q = static_cast<const char*>(hit) + 1;
    p = q;
    if (std::memcmp(q - kStem.size(), kStem.data(), kStem.size()) != 0) continue;
    const std::string_view rest(q, static_cast<std::size_t>(end - q));
    if (rest.starts_with("prompt_tokens\"")) q += 14;
    else if (rest.starts_with("tokens\"")) q += 7;
    else continue;
    // At most 8 spaces and colons: the key, its separator and the longest count then fit in the
    // carried tail, so a split body reads the same as the whole one.
    for (int n = 0; n < 8 && q < end && (*q == ' ' || *q == ':'); ++n) ++q;
    std::uint64_t v = 0;
    const char* d = q;
    while (d < end && *d >= '0' && *d <= '9' && d - q < 19) v = v * 10 + static_cast<std::uint64_t>(*d++ - '0');
    // A complete count: a delimiter follows within this text (a longer run of digits is no count).
    if (d > q && d < end && (*d < '0' || *d > '9')) value_ = v;
    p = q;
  }
}

void CachedTokensScanner::feed(std::string_view piece) {
  if (piece.empty()) return;
  // A key or count cut by a piece boundary is found in the carried tail joined to what follows.
  // Everything found twice (in the join, then in the piece) is found in order, so the last one
  // found is still the last one in the body.
  if (carry_n_ + piece.size() <= sizeof carry_) {
    std::memcpy(carry_ + carry_n_, piece.data(), piece.size());
    carry_n_ += piece.size();
    scan({carry_, carry_n_});
  } else {  // here carry_n_ <= kCarry < piece.size()
    char join[2 * kCarry];
    std::memcpy(join, carry_, carry_n_);
    std::memcpy(join + carry_n_, piece.data(), kCarry);
    scan({join, carry_n_ + kCarry});
    scan(piece);
    std::memcpy(carry_, piece.data() + piece.size() - kCarry, kCarry);
    carry_n_ = kCarry;
    return;
  }
  if (carry_n_ > kCarry) {  // keep the last kCarry bytes
    std::memmove(carry_, carry_ + carry_n_ - kCarry, kCarry);
    carry_n_ = kCarry;
  }
}

}  // namespace lorasync::proxy
