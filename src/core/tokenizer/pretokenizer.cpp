// core/tokenizer/pretokenizer.cpp: scanners, PCRE2 wrapper, split behaviours.
#define PCRE2_CODE_UNIT_WIDTH 8
#include "core/tokenizer/pretokenizer.h"

#include <pcre2.h>

#include <algorithm>
#include <array>
#include <cstring>

#include "core/tokenizer/unicode.h"
#include "util/error.h"

namespace lorasync::tok {

namespace {

constexpr char kQwen2Pattern[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
// Llama 3's: Qwen2's with digit groups of up to three (\p{N}{1,3}).
constexpr char kLlama3Pattern[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
constexpr char kGpt2Pattern[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

// Class bits of the scanners: L, N, S (White_Space) and 0 for anything else.
constexpr std::uint8_t kL = kPropLetter, kN = kPropNumber, kS = kPropSpace;

struct AsciiClasses {
  std::array<std::uint8_t, 128> v{};
  AsciiClasses() {
    for (std::uint32_t c = 0; c < 128; ++c) v[c] = unicode_props(c) & (kL | kN | kS);
  }
};
const AsciiClasses kAscii;

// One code point at s[i]: its class bits, its value and its byte length.
struct Cp {
  std::uint32_t cp;
  std::uint8_t cls;
  int len;
};

inline Cp at(std::string_view s, std::size_t i) {
  unsigned char c = static_cast<unsigned char>(s[i]);
  if (c < 0x80) return {c, kAscii.v[c], 1};
  Cp r;
  r.len = utf8_decode(s.data(), i, r.cp);
  r.cls = unicode_props(r.cp) & (kL | kN | kS);
  return r;
}

inline bool is_crlf(std::uint32_t cp) { return cp == '\r' || cp == '\n'; }

// End of the run of code points from i whose class satisfies pred.
template <typename Pred>
inline std::size_t run_end(std::string_view s, std::size_t i, Pred pred) {
  const std::size_t n = s.size();
  while (i < n) {
    Cp c = at(s, i);
    if (!pred(c)) break;
    i += static_cast<std::size_t>(c.len);
  }
  return i;
}

// (?i:'s|'t|'re|'ve|'m|'ll|'d) or its case-sensitive GPT-2 form at the apostrophe s[i]: the
// match length, or 0. Case-insensitive matching also accepts U+017F (long s), which Unicode
// case-folds to 's'.
inline std::size_t contraction(std::string_view s, std::size_t i, bool fold) {
  auto lower = [&](std::size_t j, std::uint32_t& cp) -> int {
    if (j >= s.size()) return 0;
    Cp c = at(s, j);
    cp = c.cp;
    if (fold) {
      if (cp >= 'A' && cp <= 'Z') cp += 32;
      if (cp == 0x17F) cp = 's';
    }
    return c.len;
  };
  std::uint32_t a, b;
  int la = lower(i + 1, a);
  if (!la) return 0;
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return 1 + static_cast<std::size_t>(la);
  int lb = lower(i + 1 + static_cast<std::size_t>(la), b);
  if (!lb) return 0;
  if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l'))
    return 1 + static_cast<std::size_t>(la + lb);
  return 0;
}

// \s+(?!\S) then \s+, for a whitespace run [i, e) (e is the end of the maximal run).
inline std::size_t space_run_match(std::string_view s, std::size_t i, std::size_t e) {
  if (e == s.size()) return e;
  // Back off one code point so the look-ahead sees whitespace, if the run has two or more.
  std::size_t last = e - 1;
  while ((static_cast<unsigned char>(s[last]) & 0xC0) == 0x80) --last;
  return last > i ? last : e;
}

// Qwen2's pattern (max_digits 1) and Llama 3's (max_digits 3): they differ only in \p{N}.
void scan_qwen2_like(std::string_view s, std::vector<Span>& out, int max_digits) {
  const std::size_t n = s.size();
  std::size_t i = 0;
  while (i < n) {
    const Cp c = at(s, i);
    std::size_t end = 0;
    const std::size_t next = i + static_cast<std::size_t>(c.len);
    // 1: (?i:'s|'t|'re|'ve|'m|'ll|'d)
    if (c.cp == '\'') {
      std::size_t m = contraction(s, i, /*fold=*/true);
      if (m) end = i + m;
    }
    // 2: [^\r\n\p{L}\p{N}]?\p{L}+
    if (!end) {
      if (c.cls & kL) {
        end = run_end(s, next, [](const Cp& x) { return x.cls & kL; });
      } else if (!(c.cls & kN) && !is_crlf(c.cp) && next < n && (at(s, next).cls & kL)) {
        end = run_end(s, next, [](const Cp& x) { return x.cls & kL; });
      }
    }
    // 3: \p{N}{1,max_digits}, greedy (nothing follows it in its alternative)
    if (!end && (c.cls & kN)) {
      end = next;
      for (int k = 1; k < max_digits && end < n; ++k) {
        const Cp d = at(s, end);
        if (!(d.cls & kN)) break;
        end += static_cast<std::size_t>(d.len);
      }
    }
    // 4: ' ?[^\s\p{L}\p{N}]+[\r\n]*'
    if (!end) {
      std::size_t j = i;
      bool ok = false;
      if (c.cp == ' ' && next < n && !(at(s, next).cls & (kS | kL | kN))) {
        j = next;
        ok = true;
      } else if (!(c.cls & (kS | kL | kN))) {
        ok = true;
      }
      if (ok) {
        std::size_t e = run_end(s, j, [](const Cp& x) { return !(x.cls & (kS | kL | kN)); });
        end = run_end(s, e, [](const Cp& x) { return is_crlf(x.cp); });
      }
    }
    // 5, 6, 7: \s*[\r\n]+ | \s+(?!\S) | \s+
    if (!end) {
      // c is whitespace here: every code point is L, N, S or none of them.
      std::size_t e = i, last_nl = 0;
      bool has_nl = false;
      while (e < n) {
        Cp x = at(s, e);
        if (!(x.cls & kS)) break;
        if (is_crlf(x.cp)) {
          has_nl = true;
          last_nl = e;
        }
        e += static_cast<std::size_t>(x.len);
      }
      end = has_nl ? last_nl + 1 : space_run_match(s, i, e);
    }
    out.push_back({static_cast<std::uint32_t>(i), static_cast<std::uint32_t>(end)});
    i = end;
  }
}

}  // namespace

void scan_qwen2(std::string_view s, std::vector<Span>& out) { scan_qwen2_like(s, out, 1); }
void scan_llama3(std::string_view s, std::vector<Span>& out) { scan_qwen2_like(s, out, 3); }

void scan_gpt2(std::string_view s, std::vector<Span>& out) {
  const std::size_t n = s.size();
  std::size_t i = 0;
  while (i < n) {
    const Cp c = at(s, i);
    std::size_t end = 0;
    const std::size_t next = i + static_cast<std::size_t>(c.len);
    if (c.cp == '\'') {
      std::size_t m = contraction(s, i, /*fold=*/false);
      if (m) end = i + m;
    }
    // ' ?\p{L}+', ' ?\p{N}+', ' ?[^\s\p{L}\p{N}]+': the optional space, then a run of one kind.
    if (!end) {
      std::size_t j = i;
      std::uint8_t cls = c.cls;
      if (c.cp == ' ' && next < n) {
        std::uint8_t nc = at(s, next).cls;
        if (!(nc & kS)) {
          j = next;
          cls = nc;
        }
      }
      if (cls & kL) end = run_end(s, j, [](const Cp& x) { return x.cls & kL; });
      else if (cls & kN) end = run_end(s, j, [](const Cp& x) { return x.cls & kN; });
      else if (!(cls & kS)) end = run_end(s, j, [](const Cp& x) { return !(x.cls & (kS | kL | kN)); });
    }
    if (!end) {
      std::size_t e = run_end(s, i, [](const Cp& x) { return x.cls & kS; });
      end = space_run_match(s, i, e);
    }
    out.push_back({static_cast<std::uint32_t>(i), static_cast<std::uint32_t>(end)});
    i = end;
  }
}

// ---- PCRE2 ----

struct SplitPattern::Compiled {
  pcre2_code* code = nullptr;
  bool jit = false;
  ~Compiled() {
    if (code) pcre2_code_free(code);
  }
};

SplitPattern SplitPattern::literal(std::string text) {
  SplitPattern p;
  p.kind_ = Kind::kLiteral;
  p.literal_ = std::move(text);
  return p;
}

SplitPattern SplitPattern::ascii_digit() {
  SplitPattern p;
  p.kind_ = Kind::kAsciiDigit;
  return p;
}

SplitPattern SplitPattern::regex(const std::string& pattern) {
  SplitPattern p;
  p.literal_ = pattern;
  if (pattern == kQwen2Pattern) {
    p.kind_ = Kind::kQwen2;
    return p;
  }
  if (pattern == kLlama3Pattern) {
    p.kind_ = Kind::kLlama3;
    return p;
  }
  if (pattern == kGpt2Pattern) {
    p.kind_ = Kind::kGpt2;
    return p;
  }
  p.kind_ = Kind::kRegex;
  int err = 0;
  PCRE2_SIZE err_off = 0;
  auto compiled = std::make_shared<Compiled>();
  compiled->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                 PCRE2_UTF | PCRE2_UCP, &err, &err_off, nullptr);
  if (!compiled->code) {
    PCRE2_UCHAR buf[256];
    pcre2_get_error_message(err, buf, sizeof buf);
    throw_invalid("pre_tokenizer pattern {:?} does not compile at offset {}: {}", pattern,
                  static_cast<std::size_t>(err_off), reinterpret_cast<const char*>(buf));
  }
  compiled->jit = pcre2_jit_compile(compiled->code, PCRE2_JIT_COMPLETE) == 0;
  p.compiled_ = std::move(compiled);
  return p;
}

void SplitPattern::find_matches(std::string_view s, std::vector<Span>& out) const {
  switch (kind_) {
    case Kind::kQwen2:
      scan_qwen2(s, out);
      return;
    case Kind::kLlama3:
      scan_llama3(s, out);
      return;
    case Kind::kGpt2:
      scan_gpt2(s, out);
      return;
    case Kind::kAsciiDigit:
      for (std::size_t i = 0; i < s.size(); ++i)
        if (s[i] >= '0' && s[i] <= '9')
          out.push_back({static_cast<std::uint32_t>(i), static_cast<std::uint32_t>(i + 1)});
      return;
    case Kind::kLiteral: {
      if (literal_.empty()) return;
      std::size_t pos = 0;
      while ((pos = s.find(literal_, pos)) != std::string_view::npos) {
        out.push_back({static_cast<std::uint32_t>(pos),
                       static_cast<std::uint32_t>(pos + literal_.size())});
        pos += literal_.size();
      }
      return;
    }
    case Kind::kRegex:
      break;
  }
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(compiled_->code, nullptr);
  if (!md) throw_env("out of memory creating PCRE2 match data");
  std::size_t pos = 0;
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
  while (pos <= s.size()) {
    int rc = compiled_->jit
                 ? pcre2_jit_match(compiled_->code, subject, s.size(), pos, 0, md, nullptr)
                 : pcre2_match(compiled_->code, subject, s.size(), pos, PCRE2_NO_UTF_CHECK, md,
                               nullptr);
    if (rc < 0) {
      if (rc == PCRE2_ERROR_NOMATCH) break;
      pcre2_match_data_free(md);
      throw_invalid("pre_tokenizer pattern {:?} failed to match (PCRE2 error {})", literal_, rc);
    }
    PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    std::size_t b = ov[0], e = ov[1];
    out.push_back({static_cast<std::uint32_t>(b), static_cast<std::uint32_t>(e)});
    if (e == b) {
      // Empty match: step over one code point, as Oniguruma's iterator does.
      if (e >= s.size()) break;
      pos = e + static_cast<std::size_t>(utf8_len(static_cast<unsigned char>(s[e])));
    } else {
      pos = e;
    }
  }
  pcre2_match_data_free(md);
}

void split_pieces(std::string_view s, const SplitPattern& pattern, SplitBehavior behavior,
                  bool invert, std::vector<Span>& scratch, std::vector<std::string_view>& out) {
  if (s.empty()) return;
  scratch.clear();
  pattern.find_matches(s, scratch);
  const auto n = static_cast<std::uint32_t>(s.size());
  auto piece = [&](std::uint32_t b, std::uint32_t e) {
    if (e > b) out.push_back(s.substr(b, e - b));
  };
  if (behavior == SplitBehavior::kIsolated) {  // matches and gaps alike; the common fast path
    std::uint32_t prev = 0;
    for (const Span& m : scratch) {
      piece(prev, m.begin);
      piece(m.begin, m.end);
      prev = m.end;
    }
    piece(prev, n);
    return;
  }
  // (span, is_match) covering s, as tokenizers' Pattern::find_matches.
  struct Seg {
    std::uint32_t b, e;
    bool match;
  };
  std::vector<Seg> segs;
  segs.reserve(scratch.size() * 2 + 1);
  std::uint32_t prev = 0;
  for (const Span& m : scratch) {
    if (prev != m.begin) segs.push_back({prev, m.begin, false});
    segs.push_back({m.begin, m.end, true});
    prev = m.end;
  }
  if (prev != n) segs.push_back({prev, n, false});
  if (invert)
    for (Seg& g : segs) g.match = !g.match;

  std::vector<Seg> res;  // `match` now means "remove"
  res.reserve(segs.size());
  bool previous_match = false;
  switch (behavior) {
    case SplitBehavior::kIsolated:
      break;
    case SplitBehavior::kRemoved:
      res = segs;
      break;
    case SplitBehavior::kContiguous:
      for (const Seg& g : segs) {
        if (g.match == previous_match && !res.empty()) res.back().e = g.e;
        else res.push_back({g.b, g.e, false});
        previous_match = g.match;
      }
      break;
    case SplitBehavior::kMergedWithPrevious:
      for (const Seg& g : segs) {
        if (g.match && !previous_match && !res.empty()) res.back().e = g.e;
        else res.push_back({g.b, g.e, false});
        previous_match = g.match;
      }
      break;
    case SplitBehavior::kMergedWithNext:
      for (auto it = segs.rbegin(); it != segs.rend(); ++it) {
        if (it->match && !previous_match && !res.empty()) res.back().b = it->b;
        else res.push_back({it->b, it->e, false});
        previous_match = it->match;
      }
      std::reverse(res.begin(), res.end());
      break;
  }
  for (const Seg& g : res)
    if (!g.match) piece(g.b, g.e);
}

bool PreTokenizer::has_byte_level() const {
  for (const auto& s : steps_)
    if (s.type == PreTokenizerStep::Type::kByteLevel) return true;
  return false;
}

void PreTokenizer::run(std::string_view text, std::vector<std::string_view>& out,
                       std::deque<std::string>& storage) const {
  out.clear();
  if (text.empty()) return;
  out.push_back(text);
  std::vector<std::string_view> next;
  std::vector<Span> scratch;
  static const SplitPattern kGpt2 = SplitPattern::regex(kGpt2Pattern);
  for (const PreTokenizerStep& step : steps_) {
    next.clear();
    next.reserve(out.size() * 2);
    for (std::string_view piece : out) {
      if (step.type == PreTokenizerStep::Type::kSplit) {
        split_pieces(piece, step.pattern, step.behavior, step.invert, scratch, next);
        continue;
      }
      std::string_view p = piece;
      if (step.add_prefix_space && (p.empty() || p[0] != ' ')) {
        std::string& prefixed = storage.emplace_back();
        prefixed.reserve(p.size() + 1);
        prefixed.push_back(' ');
        prefixed.append(p);
        p = prefixed;
      }
      if (step.use_regex) split_pieces(p, kGpt2, SplitBehavior::kIsolated, false, scratch, next);
      else if (!p.empty()) next.push_back(p);
    }
    out.swap(next);
  }
}

}  // namespace lorasync::tok
