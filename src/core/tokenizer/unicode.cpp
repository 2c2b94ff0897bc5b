// core/tokenizer/unicode.cpp: property lookup, UTF-8 helpers, NFC.
#include "core/tokenizer/unicode.h"

#include <algorithm>
#include <vector>

namespace lorasync::tok {

namespace unicode_data {
extern const char kUnicodeVersion[];
extern const std::uint16_t kPropStage1[];
extern const std::uint8_t kPropStage2[];
extern const std::uint32_t kCccCp[];
extern const std::uint8_t kCccVal[];
extern const unsigned kCccCp_size;
extern const std::uint32_t kDecompCp[];
extern const std::uint32_t kDecompOff[];
extern const std::uint32_t kDecompData[];
extern const unsigned kDecompCp_size;
extern const std::uint64_t kCompPair[];
extern const std::uint32_t kCompCp[];
extern const unsigned kCompPair_size;
}  // namespace unicode_data

namespace ud = unicode_data;

namespace {
constexpr std::uint32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr std::uint32_t kLCount = 19, kVCount = 21, kTCount = 28, kNCount = kVCount * kTCount,
                        kSCount = kLCount * kNCount;
}  // namespace

std::uint8_t unicode_props(std::uint32_t cp) {
  if (cp >= 0x110000) return 0;
  return ud::kPropStage2[static_cast<std::size_t>(ud::kPropStage1[cp >> 8]) * 256 + (cp & 0xFF)];
}

const char* unicode_version() { return ud::kUnicodeVersion; }

std::uint8_t combining_class(std::uint32_t cp) {
  if (cp < 0x300) return 0;
  const std::uint32_t* end = ud::kCccCp + ud::kCccCp_size;
  const std::uint32_t* it = std::lower_bound(ud::kCccCp, end, cp);
  return (it != end && *it == cp) ? ud::kCccVal[it - ud::kCccCp] : 0;
}

void utf8_append(std::string& out, std::uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

std::size_t utf8_step(std::string_view s, std::size_t i, bool& valid) {
  const auto* u = reinterpret_cast<const unsigned char*>(s.data());
  const std::size_t n = s.size();
  unsigned char c = u[i];
  valid = false;
  if (c < 0x80) { valid = true; return 1; }
  int need;
  unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (c >= 0xC2 && c <= 0xDF) {
    need = 1;
  } else if (c >= 0xE0 && c <= 0xEF) {
    need = 2;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    need = 3;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 1;  // continuation byte or invalid lead: a maximal subpart of length 1
  }
  std::size_t j = i + 1;
  for (int k = 0; k < need; ++k, ++j) {
    if (j >= n) return 0;  // valid so far, truncated
    unsigned char b = u[j];
    unsigned char l = k == 0 ? lo : 0x80, h = k == 0 ? hi : 0xBF;
    if (b < l || b > h) return j - i;  // maximal subpart ends before b
  }
  valid = true;
  return j - i;
}

std::size_t validate_utf8(std::string_view s) {
  const auto* u = reinterpret_cast<const unsigned char*>(s.data());
  std::size_t i = 0;
  const std::size_t n = s.size();
  while (i < n) {
    // ASCII fast path, 8 bytes at a time.
    while (i + 8 <= n) {
      std::uint64_t w;
      __builtin_memcpy(&w, u + i, 8);
      if (w & 0x8080808080808080ULL) break;
      i += 8;
    }
    if (i >= n) break;
    if (u[i] < 0x80) { ++i; continue; }
    bool valid;
    std::size_t len = utf8_step(s, i, valid);
    if (!valid) return i;
    i += len;
  }
  return std::string_view::npos;
}

std::string utf8_lossy(std::string_view bytes) {
  if (validate_utf8(bytes) == std::string_view::npos) return std::string(bytes);
  std::string out;
  out.reserve(bytes.size() + 8);
  std::size_t i = 0;
  while (i < bytes.size()) {
    bool valid;
    std::size_t len = utf8_step(bytes, i, valid);
    if (len == 0) {  // truncated at the end: one replacement for the rest
      out += "\xEF\xBF\xBD";
      break;
    }
    if (valid) out.append(bytes.substr(i, len));
    else out += "\xEF\xBF\xBD";
    i += len;
  }
  return out;
}

bool nfc_quick_check(std::string_view s) {
  const auto* u = reinterpret_cast<const unsigned char*>(s.data());
  std::size_t i = 0;
  const std::size_t n = s.size();
  while (i < n) {
    if (u[i] < 0x80) { ++i; continue; }  // ASCII is never NFC-unsafe
    std::uint32_t cp;
    i += utf8_decode(s.data(), i, cp);
    if (unicode_props(cp) & kPropNfcUnsafe) return false;
  }
  return true;
}

namespace {

void decompose(std::uint32_t cp, std::vector<std::uint32_t>& out) {
  if (cp >= kSBase && cp < kSBase + kSCount) {
    std::uint32_t s = cp - kSBase;
    out.push_back(kLBase + s / kNCount);
    out.push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount) out.push_back(kTBase + s % kTCount);
    return;
  }
  const std::uint32_t* end = ud::kDecompCp + ud::kDecompCp_size;
  const std::uint32_t* it = std::lower_bound(ud::kDecompCp, end, cp);
  if (it == end || *it != cp) {
    out.push_back(cp);
    return;
  }
  std::size_t k = static_cast<std::size_t>(it - ud::kDecompCp);
  for (std::uint32_t j = ud::kDecompOff[k]; j < ud::kDecompOff[k + 1]; ++j)
    out.push_back(ud::kDecompData[j]);
}

// The primary composite of (a, b), or 0.
std::uint32_t compose_pair(std::uint32_t a, std::uint32_t b) {
  if (a >= kLBase && a < kLBase + kLCount && b >= kVBase && b < kVBase + kVCount)
    return kSBase + ((a - kLBase) * kVCount + (b - kVBase)) * kTCount;
  if (a >= kSBase && a < kSBase + kSCount && (a - kSBase) % kTCount == 0 && b > kTBase &&
      b < kTBase + kTCount)
    return a + (b - kTBase);
  const std::uint64_t key = (static_cast<std::uint64_t>(a) << 32) | b;
  const std::uint64_t* end = ud::kCompPair + ud::kCompPair_size;
  const std::uint64_t* it = std::lower_bound(ud::kCompPair, end, key);
  return (it != end && *it == key) ? ud::kCompCp[it - ud::kCompPair] : 0;
}

}  // namespace

std::string nfc(std::string_view s) {
  if (nfc_quick_check(s)) return std::string(s);
  std::vector<std::uint32_t> cps;
  cps.reserve(s.size());
  for (std::size_t i = 0; i < s.size();) {
    std::uint32_t cp;
    i += utf8_decode(s.data(), i, cp);
    decompose(cp, cps);
  }
  // Canonical ordering: stable sort of each run of non-starters by combining class.
  std::vector<std::uint8_t> cc(cps.size());
  for (std::size_t i = 0; i < cps.size(); ++i) cc[i] = combining_class(cps[i]);
  for (std::size_t i = 0; i < cps.size();) {
    if (cc[i] == 0) { ++i; continue; }
    std::size_t j = i;
    while (j < cps.size() && cc[j] != 0) ++j;
    if (j - i > 1) {
      // insertion sort keeps it stable and runs are short
      for (std::size_t a = i + 1; a < j; ++a) {
        std::uint32_t v = cps[a];
        std::uint8_t c = cc[a];
        std::size_t b = a;
        while (b > i && cc[b - 1] > c) {
          cps[b] = cps[b - 1];
          cc[b] = cc[b - 1];
          --b;
        }
        cps[b] = v;
        cc[b] = c;
      }
    }
    i = j;
  }
  // Canonical composition.
  std::size_t starter = static_cast<std::size_t>(-1);
  std::size_t out_n = 0;
  int last_cc = -1;  // combining class of the last character kept after the starter
  for (std::size_t i = 0; i < cps.size(); ++i) {
    std::uint32_t cp = cps[i];
    int c = cc[i];
    if (starter != static_cast<std::size_t>(-1)) {
      bool blocked = last_cc != -1 && (last_cc == 0 || last_cc >= c);
      if (!blocked) {
        std::uint32_t comp = compose_pair(cps[starter], cp);
        if (comp) {
          cps[starter] = comp;
          continue;
        }
      }
    }
    if (c == 0) {
      starter = out_n;
      last_cc = -1;
    } else {
      last_cc = c;
    }
    cps[out_n] = cp;
    cc[out_n] = static_cast<std::uint8_t>(c);
    ++out_n;
  }
  std::string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < out_n; ++i) utf8_append(out, cps[i]);
  return out;
}

}  // namespace lorasync::tok
