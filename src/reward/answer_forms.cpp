// Answer forms rewritten or retried (answer_forms.h).
#include "reward/answer_forms.h"

#include <cctype>
#include <vector>

namespace lorasync::reward {
namespace {

bool digit(char c) { return std::isdigit(static_cast<unsigned char>(c)) != 0; }

std::string trim(std::string_view s) {
  while (!s.empty() && s.front() == ' ') s.remove_prefix(1);
  while (!s.empty() && s.back() == ' ') s.remove_suffix(1);
  return std::string(s);
}

// Splits at `sep` outside brackets and braces.
std::vector<std::string> split_top(std::string_view s, char sep) {
  std::vector<std::string> out;
  int depth = 0;
  std::size_t from = 0;
  for (std::size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (c == '\\' && i + 1 < s.size()) {
      ++i;
      continue;
    }
    if (c == '(' || c == '[' || c == '{') ++depth;
    else if (c == ')' || c == ']' || c == '}') --depth;
    else if (c == sep && depth == 0) {
      out.push_back(trim(s.substr(from, i - from)));
      from = i + 1;
    }
  }
  out.push_back(trim(s.substr(from)));
  return out;
}

// A short variable name: a letter, then letters, digits, '_', braces ("p", "x_1", "y_{2}", "AB").
bool is_name(std::string_view s) {
  if (s.empty() || s.size() > 8 || !std::isalpha(static_cast<unsigned char>(s[0]))) return false;
  for (char c : s)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '{' || c == '}')) return false;
  return true;
}

}  // namespace

bool is_plain_number(std::string_view s) {
  std::size_t i = 0;
  if (i < s.size() && (s[i] == '-' || s[i] == '+')) ++i;
  bool digits = false, dot = false;
  for (; i < s.size(); ++i) {
    if (digit(s[i])) digits = true;
    else if (s[i] == '.' && !dot) dot = true;
    else return false;
  }
  return digits;
}

std::optional<std::string> decimal_comma_reading(std::string_view s) {
  std::size_t i = 0;
  std::string out;
  if (i < s.size() && s[i] == '-') out.push_back(s[i++]);
  // The whole part: digits, optionally grouped by dots in threes ("12.500").
  std::size_t group = 0, groups = 0;
  bool any = false;
  for (; i < s.size() && s[i] != ','; ++i) {
    if (digit(s[i])) {
      out.push_back(s[i]);
      ++group;
      any = true;
    } else if (s[i] == '.' && any && (groups == 0 ? group <= 3 : group == 3)) {
      group = 0;
      ++groups;
    } else {
      return std::nullopt;
    }
  }
  if (!any || i >= s.size() || (groups > 0 && group != 3)) return std::nullopt;
  ++i;  // the comma
  std::size_t frac = 0;
  std::string tail;
  for (; i < s.size(); ++i) {
    if (!digit(s[i])) return std::nullopt;
    tail.push_back(s[i]);
    ++frac;
  }
  if (frac == 0) return std::nullopt;
  return out + "." + tail;
}

void drop_approximation(std::string& s) {
  int depth = 0;
  for (std::size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (c == '(' || c == '[' || c == '{') ++depth;
    else if (c == ')' || c == ']' || c == '}') --depth;
    else if (c == '\\' && depth == 0 && s.compare(i, 7, "\\approx") == 0 &&
             (i + 7 >= s.size() || !std::isalpha(static_cast<unsigned char>(s[i + 7])))) {
      std::string head = trim(std::string_view(s).substr(0, i));
      if (head.empty()) return;
      // "x \approx 11" names the value (x = 11); "x = 1/3 \approx 0.33" comments on it.
      if (is_name(head) && head.find('=') == std::string::npos) s.replace(i, 7, "=");
      else s = head;
      return;
    }
  }
}

void join_assignment_groups(std::string& s) {
  if (s.find(';') == std::string::npos || s.find('=') == std::string::npos) return;
  std::vector<std::string> groups = split_top(s, ';');
  if (groups.size() < 2) return;
  std::vector<std::string> names;
  std::string out;
  for (const std::string& g : groups) {
    std::vector<std::string> parts = split_top(g, ',');
    if (parts.size() < 2) return;
    std::vector<std::string> these;
    std::string tuple = "(";
    for (const std::string& p : parts) {
      std::vector<std::string> sides = split_top(p, '=');
      if (sides.size() != 2 || !is_name(sides[0]) || sides[1].empty()) return;
      these.push_back(sides[0]);
      tuple += (tuple.size() > 1 ? "," : "") + sides[1];
    }
    if (names.empty()) names = these;
    else if (names != these) return;
    out += (out.empty() ? "" : ",") + tuple + ")";
  }
  s = out;
}

void split_glued_words(std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size(); ++i) {
    out.push_back(s[i]);
    if (s[i] != ')' && s[i] != ']') continue;
    for (std::string_view w : {std::string_view("or"), std::string_view("and")}) {
      const std::size_t after = i + 1 + w.size();
      if (s.compare(i + 1, w.size(), w) == 0 && after < s.size() && (s[after] == '(' || s[after] == '[')) {
        out += ", ";
        i = after - 1;
        break;
      }
    }
  }
  s = std::move(out);
}

}  // namespace lorasync::reward
