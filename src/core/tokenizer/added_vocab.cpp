// core/tokenizer/added_vocab.cpp
#include "core/tokenizer/added_vocab.h"

#include "core/tokenizer/unicode.h"

namespace lorasync::tok {

namespace {

// The code point that ends s (valid UTF-8, non-empty).
std::uint32_t last_cp(std::string_view s, std::size_t& start) {
  std::size_t i = s.size() - 1;
  while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
  std::uint32_t cp;
  utf8_decode(s.data(), i, cp);
  start = i;
  return cp;
}

bool ends_with_word(std::string_view s) {
  if (s.empty()) return false;
  std::size_t st;
  return unicode_props(last_cp(s, st)) & kPropWord;
}

bool starts_with_word(std::string_view s) {
  if (s.empty()) return false;
  std::uint32_t cp;
  utf8_decode(s.data(), 0, cp);
  return unicode_props(cp) & kPropWord;
}

// Start of the whitespace run that ends s (s.size() when s does not end with whitespace).
std::size_t trailing_space_start(std::string_view s) {
  std::size_t i = s.size();
  while (i > 0) {
    std::size_t st;
    if (!is_space(last_cp(s.substr(0, i), st))) break;
    i = st;
  }
  return i;
}

// Length of the whitespace run that starts s.
std::size_t leading_space_len(std::string_view s) {
  std::size_t i = 0;
  while (i < s.size()) {
    std::uint32_t cp;
    int len = utf8_decode(s.data(), i, cp);
    if (!is_space(cp)) break;
    i += static_cast<std::size_t>(len);
  }
  return i;
}

}  // namespace

TokenMatcher::TokenMatcher(const std::vector<AddedToken>& tokens,
                           const std::vector<std::string>& patterns)
    : tokens_(tokens) {
  nodes_.emplace_back();
  for (std::size_t t = 0; t < tokens.size(); ++t) {
    const std::string& p = patterns[t];
    if (p.empty()) continue;
    std::int32_t node = 0;
    for (unsigned char c : p) {
      std::int32_t nx = child(node, c);
      if (nx < 0) {
        nx = static_cast<std::int32_t>(nodes_.size());
        nodes_[static_cast<std::size_t>(node)].children.emplace_back(c, nx);
        nodes_.emplace_back();
      }
      node = nx;
    }
    // A duplicate pattern keeps its first token.
    if (nodes_[static_cast<std::size_t>(node)].token < 0)
      nodes_[static_cast<std::size_t>(node)].token = static_cast<std::int32_t>(t);
    first_byte_[static_cast<unsigned char>(p[0])] = true;
  }
}

std::int32_t TokenMatcher::child(std::int32_t node, unsigned char c) const {
  for (const auto& [k, v] : nodes_[static_cast<std::size_t>(node)].children)
    if (k == c) return v;
  return -1;
}

void TokenMatcher::split(std::string_view s, bool parse_special,
                         std::vector<TextSegment>& out) const {
  const auto n = s.size();
  if (n == 0) {
    out.push_back({0, 0, -1});
    return;
  }
  if (empty()) {
    out.push_back({0, static_cast<std::uint32_t>(n), -1});
    return;
  }
  std::size_t start_offset = 0;
  std::size_t pos = 0;  // where the leftmost-longest search resumes
  while (pos < n) {
    // Leftmost start with a match, then the longest match there.
    std::size_t mstart = pos, mend = 0;
    std::int32_t tok = -1;
    for (; mstart < n; ++mstart) {
      if (!first_byte_[static_cast<unsigned char>(s[mstart])]) continue;
      std::int32_t node = 0;
      for (std::size_t j = mstart; j < n; ++j) {
        node = child(node, static_cast<unsigned char>(s[j]));
        if (node < 0) break;
        if (nodes_[static_cast<std::size_t>(node)].token >= 0) {
          tok = nodes_[static_cast<std::size_t>(node)].token;
          mend = j + 1;
        }
      }
      if (tok >= 0) break;
    }
    if (tok < 0) break;
    pos = mend;
    const AddedToken& t = tokens_[static_cast<std::size_t>(tok)];
    std::size_t start = mstart, stop = mend;
    if (t.special && !parse_special) continue;
    if (t.single_word) {
      bool start_space = start == 0 || !ends_with_word(s.substr(0, start));
      bool stop_space = stop == n || !starts_with_word(s.substr(stop));
      if (!start_space || !stop_space) continue;
    }
    if (t.lstrip) start = std::max(trailing_space_start(s.substr(0, start)), start_offset);
    if (t.rstrip) stop += leading_space_len(s.substr(stop));
    if (start_offset < start)
      out.push_back({static_cast<std::uint32_t>(start_offset), static_cast<std::uint32_t>(start), -1});
    out.push_back({static_cast<std::uint32_t>(start), static_cast<std::uint32_t>(stop), t.id});
    start_offset = stop;
  }
  if (start_offset < n)
    out.push_back({static_cast<std::uint32_t>(start_offset), static_cast<std::uint32_t>(n), -1});
}

}  // namespace lorasync::tok
