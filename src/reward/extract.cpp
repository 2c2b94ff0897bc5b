// Extraction of the answer from a completion (rules in extract.h). Single forward scans only, so a
// megabyte of text costs a few milliseconds at most.
#include "reward/extract.h"

#include <algorithm>

#include <cctype>
#include <vector>

namespace lorasync::reward {
namespace {

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f'; }

std::string_view trim_view(std::string_view s) {
  while (!s.empty() && is_space(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_space(s.back())) s.remove_suffix(1);
  return s;
}

// Given the index just after "\boxed"/"\fbox", returns the box content and sets `end` to the index
// after it, or nullopt when the box is not complete.
std::optional<std::string> read_box_argument(std::string_view t, std::size_t pos, std::size_t& end) {
  std::size_t i = pos;
  while (i < t.size() && is_space(t[i])) ++i;
  if (i >= t.size()) return std::nullopt;
  if (t[i] == '{') {
    int depth = 0;
    for (std::size_t j = i; j < t.size(); ++j) {
      char c = t[j];
      if (c == '\\' && j + 1 < t.size()) {  // an escaped brace \{ \} does not count
        ++j;
        continue;
      }
      if (c == '{') ++depth;
      else if (c == '}' && --depth == 0) {
        end = j + 1;
        return std::string(t.substr(i + 1, j - i - 1));
      }
    }
    return std::nullopt;
  }
  if (i == pos) return std::nullopt;  // "\boxedx" is another command, not a box
  // "\boxed 5": one token up to whitespace or '$'.
  std::size_t j = i;
  while (j < t.size() && !is_space(t[j]) && t[j] != '$') ++j;
  if (j == i) return std::nullopt;
  end = j;
  return std::string(t.substr(i, j - i));
}

}  // namespace

std::string_view after_think(std::string_view text) {
  constexpr std::string_view kThink = "</think>";
  std::size_t p = text.rfind(kThink);
  if (p == std::string_view::npos) return text;
  return text.substr(p + kThink.size());
}

namespace {

struct Box {
  std::size_t start = 0, end = 0;  // [start, end) of "\boxed{...}"
  std::string content;
};

// The last complete box that ends at or before `limit`.
std::optional<Box> last_box_before(std::string_view t, std::size_t limit) {
  std::size_t search_end = limit;
  while (search_end > 0) {
    std::size_t best = std::string_view::npos;
    std::size_t name_len = 0;
    for (std::string_view name : {std::string_view("\\boxed"), std::string_view("\\fbox")}) {
      std::size_t p = t.rfind(name, search_end - 1);
      if (p != std::string_view::npos && (best == std::string_view::npos || p > best)) {
        best = p;
        name_len = name.size();
      }
    }
    if (best == std::string_view::npos) return std::nullopt;
    std::size_t end = 0;
    auto content = read_box_argument(t, best + name_len, end);
    if (content && end <= limit) return Box{best, end, std::move(*content)};
    if (best == 0) return std::nullopt;
    search_end = best;
  }
  return std::nullopt;
}

// Text between two boxes that only separates them ("$, $", " and ", "\quad \text{and} \quad").
bool only_separators(std::string_view gap) {
  std::string g(gap);
  for (std::string_view tok : {"\\text{ and }", "\\text{and}", "\\text{ or }", "\\text{or}",
                               "\\qquad", "\\quad", "\\(", "\\)", "\\[", "\\]", "\\,", "\\;",
                               "and", "or"}) {
    std::size_t p;
    while ((p = g.find(tok)) != std::string::npos) g.replace(p, tok.size(), " ");
  }
  for (char c : g)
    if (!(is_space(c) || c == ',' || c == ';' || c == '$')) return false;
  return true;
}

}  // namespace

std::optional<std::string> extract_last_boxed(std::string_view t) {
  auto last = last_box_before(t, t.size());
  if (!last) return std::nullopt;
  // Boxes written side by side ("\boxed{1}, \boxed{2}") are one list answer.
  std::vector<std::string> parts{last->content};
  std::size_t start = last->start;
  for (int k = 0; k < 32 && start > 0; ++k) {
    auto prev = last_box_before(t, start);
    if (!prev || !only_separators(t.substr(prev->end, start - prev->end))) break;
    parts.push_back(prev->content);
    start = prev->start;
  }
  if (parts.size() == 1) return parts[0];
  std::string joined;
  for (std::size_t k = parts.size(); k-- > 0;) {
    joined += parts[k];
    if (k > 0) joined += ", ";
  }
  return joined;
}

std::vector<std::string> extract_last_boxes(std::string_view t, std::size_t count, std::size_t* first_start) {
  std::vector<std::string> out;
  std::size_t end = t.size();
  while (out.size() < count && end > 0) {
    auto b = last_box_before(t, end);
    if (!b) break;
    out.push_back(b->content);
    end = b->start;
  }
  std::reverse(out.begin(), out.end());
  if (first_start != nullptr) *first_start = end;
  return out;
}

std::vector<BoxSpan> last_box_spans(std::string_view t, std::size_t count) {
  std::vector<BoxSpan> out;
  std::size_t end = t.size();
  while (out.size() < count && end > 0) {
    auto b = last_box_before(t, end);
    if (!b) break;
    out.push_back(BoxSpan{b->start, b->end, std::move(b->content)});
    end = b->start;
  }
  std::reverse(out.begin(), out.end());
  return out;
}

std::string strip_math_delimiters(std::string_view s) {
  s = trim_view(s);
  for (int round = 0; round < 2; ++round) {
    if (s.size() >= 4 && s.substr(0, 2) == "$$" && s.substr(s.size() - 2) == "$$")
      s = trim_view(s.substr(2, s.size() - 4));
    else if (s.size() >= 2 && s.front() == '$' && s.back() == '$' && s.substr(s.size() - 2) != "\\$")
      s = trim_view(s.substr(1, s.size() - 2));
    else if (s.size() >= 4 && (s.substr(0, 2) == "\\(" || s.substr(0, 2) == "\\[") &&
             (s.substr(s.size() - 2) == "\\)" || s.substr(s.size() - 2) == "\\]"))
      s = trim_view(s.substr(2, s.size() - 4));
  }
  return std::string(s);
}

namespace {

// The text after the last "answer is" (case-insensitive), up to the end of the sentence.
std::optional<std::string> answer_is(std::string_view t) {
  std::string lower(t);
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  std::size_t p = lower.rfind("answer is");
  std::size_t skip = 9;
  if (std::size_t q = lower.rfind("answer:"); q != std::string::npos && (p == std::string::npos || q > p)) {
    p = q;
    skip = 7;
  }
  if (p == std::string::npos) return std::nullopt;
  std::size_t i = p + skip;
  while (i < t.size() && (is_space(t[i]) || t[i] == ':')) ++i;
  // A math span right here is the answer.
  std::size_t j = i;
  bool in_math = false;
  for (; j < t.size(); ++j) {
    char c = t[j];
    if (c == '$') in_math = !in_math;
    if (in_math) continue;
    if (c == '\n') break;
    if (c == '.' && (j + 1 >= t.size() || is_space(t[j + 1]))) break;
  }
  std::string_view quoted = trim_view(t.substr(i, j - i));
  for (std::string_view q : {std::string_view("\\\""), std::string_view("\"")})  // "\"$12$\"", "\"12\""
    if (quoted.size() >= 2 * q.size() && quoted.substr(0, q.size()) == q &&
        quoted.substr(quoted.size() - q.size()) == q)
      quoted = quoted.substr(q.size(), quoted.size() - 2 * q.size());
  std::string ans = strip_math_delimiters(quoted);
  if (ans.empty()) return std::nullopt;
  // "Final Answer: The volume of $ABCD$ is 120": a sentence, whose answer is the math or the
  // number it ends with.
  if (is_sentence(ans))
    if (auto last = last_math_or_number(ans)) return last;
  return ans;
}

std::optional<std::string> last_math_span(std::string_view t, std::size_t* end_out = nullptr) {
  // Pairs of $...$ (or $$...$$), \(...\) and \[...\]; returns the one that ends last.
  std::optional<std::string> best;
  std::size_t best_end = 0;
  std::size_t open = std::string_view::npos;
  for (std::size_t i = 0; i < t.size(); ++i) {
    if (t[i] == '\\' && i + 1 < t.size()) {
      if (t[i + 1] == '$') { ++i; continue; }
      if (t[i + 1] == '(' || t[i + 1] == '[') {
        char close = t[i + 1] == '(' ? ')' : ']';
        std::string closer = std::string("\\") + close;
        std::size_t e = t.find(closer, i + 2);
        if (e != std::string_view::npos && e + 2 > best_end) {
          best = std::string(trim_view(t.substr(i + 2, e - i - 2)));
          best_end = e + 2;
        }
        if (e != std::string_view::npos) i = e + 1;
        continue;
      }
      ++i;
      continue;
    }
    if (t[i] != '$') continue;
    bool dbl = i + 1 < t.size() && t[i + 1] == '$';
    if (open == std::string_view::npos) {
      open = i;
      if (dbl) ++i;
    } else {
      std::size_t start = open + ((open + 1 < t.size() && t[open + 1] == '$') ? 2 : 1);
      if (i > start && i + 1 > best_end) {
        best = std::string(trim_view(t.substr(start, i - start)));
        best_end = i + 1;
      }
      open = std::string_view::npos;
      if (dbl) ++i;
    }
  }
  if (best && best->empty()) return std::nullopt;
  if (end_out != nullptr) *end_out = best_end;
  return best;
}

std::optional<std::string> last_number(std::string_view t, std::size_t* end_out = nullptr) {
  std::size_t i = t.size();
  while (i > 0) {
    --i;
    if (!std::isdigit(static_cast<unsigned char>(t[i]))) continue;
    std::size_t end = i + 1;
    std::size_t start = i;
    while (start > 0 && (std::isdigit(static_cast<unsigned char>(t[start - 1])) ||
                         ((t[start - 1] == '.' || t[start - 1] == ',' || t[start - 1] == '/') &&
                          start >= 2 && std::isdigit(static_cast<unsigned char>(t[start - 2])))))
      --start;
    if (start > 0 && t[start - 1] == '-') --start;
    if (end_out != nullptr) *end_out = end;
    return std::string(t.substr(start, end - start));
  }
  return std::nullopt;
}

}  // namespace

std::optional<std::string> last_math_or_number(std::string_view t) {
  std::size_t math_end = 0, number_end = 0;
  auto m = last_math_span(t, &math_end);
  auto n = last_number(t, &number_end);
  if (m && (!n || math_end >= number_end)) return m;
  return n;
}

bool is_sentence(std::string_view t) { return prose_words(t, 2) >= 3 && prose_words(t, 3) >= 2; }

std::size_t prose_words(std::string_view t, std::size_t min_letters) {
  std::size_t words = 0;
  int depth = 0;
  bool in_math = false;
  for (std::size_t i = 0; i < t.size(); ++i) {
    const char c = t[i];
    if (c == '\\' && i + 1 < t.size()) {  // a command name or an escaped character
      ++i;
      while (i + 1 < t.size() && std::isalpha(static_cast<unsigned char>(t[i + 1]))) ++i;
      continue;
    }
    if (c == '$') in_math = !in_math;
    else if (c == '{') ++depth;
    else if (c == '}') --depth;
    if (in_math || depth > 0 || !std::isalpha(static_cast<unsigned char>(c))) continue;
    std::size_t j = i;
    while (j < t.size() && std::isalpha(static_cast<unsigned char>(t[j]))) ++j;
    if (j - i >= min_letters) ++words;
    i = j - 1;
  }
  return words;
}

std::optional<std::string> answer_after_last_box(std::string_view t) {
  auto last = last_box_before(t, t.size());
  if (!last) return std::nullopt;
  std::string_view rest = t.substr(last->end);
  std::string lower(rest);
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (lower.find("final answer") == std::string::npos) return std::nullopt;
  return answer_is(rest);
}

std::optional<std::string> answer_statement(std::string_view text) { return answer_is(text); }

std::optional<std::string> extract_fallback(std::string_view text) {
  if (auto a = answer_is(text)) return a;
  return last_math_or_number(text);
}

}  // namespace lorasync::reward
