// Canonical string form (rules and order in normalize.h). Each rule is a small pass over the
// string; the caller caps the length, so the passes stay cheap.
#include "reward/normalize.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <vector>

#include "reward/answer_forms.h"
#include "reward/extract.h"

namespace lorasync::reward {
namespace {

bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_alpha(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f'; }
char lower(char c) { return static_cast<char>(std::tolower(static_cast<unsigned char>(c))); }

void replace_all(std::string& s, std::string_view from, std::string_view to) {
  if (from.empty()) return;
  std::string out;
  std::size_t pos = 0;
  bool changed = false;
  while (true) {
    std::size_t p = s.find(from, pos);
    if (p == std::string::npos) break;
    if (!changed) out.reserve(s.size());
    changed = true;
    out.append(s, pos, p - pos);
    out.append(to);
    pos = p + from.size();
  }
  if (!changed) return;
  out.append(s, pos, std::string::npos);
  s = std::move(out);
}

// Replaces the command `name` (with backslash) when not followed by a letter (so "\left" does not
// touch "\leftarrow").
void replace_command(std::string& s, std::string_view name, std::string_view to) {
  std::string out;
  out.reserve(s.size());
  std::size_t i = 0;
  while (i < s.size()) {
    if (s.compare(i, name.size(), name) == 0 &&
        (i + name.size() >= s.size() || !is_alpha(s[i + name.size()]))) {
      out.append(to);
      i += name.size();
    } else {
      out.push_back(s[i++]);
    }
  }
  s = std::move(out);
}

std::string trim_copy(std::string_view s) {
  while (!s.empty() && is_space(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_space(s.back())) s.remove_suffix(1);
  return std::string(s);
}

void collapse_spaces(std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    if (is_space(c)) {
      if (!out.empty() && out.back() != ' ') out.push_back(' ');
    } else {
      out.push_back(c);
    }
  }
  while (!out.empty() && out.back() == ' ') out.pop_back();
  s = std::move(out);
}

void map_unicode(std::string& s) {
  static constexpr std::array<std::pair<std::string_view, std::string_view>, 16> kMap{{
      {"\xE2\x88\x92", "-"},          {"\xC3\x97", "\\times "},    {"\xC3\xB7", "\\div "},
      {"\xCF\x80", "\\pi "},          {"\xE2\x88\x9E", "\\infty "}, {"\xE2\x89\xA4", "\\le "},
      {"\xE2\x89\xA5", "\\ge "},      {"\xE2\x89\xA0", "\\ne "},    {"\xC2\xB0", "^\\circ"},
      {"\xE2\x88\x9A", "\\sqrt "},    {"\xC2\xB7", "\\cdot "},     {"\xE2\x8B\x85", "\\cdot "},
      {"\xE2\x88\xAA", "\\cup "},     {"\xC2\xB2", "^2"},          {"\xC2\xB3", "^3"},
      {"\xC2\xA0", " "},
  }};
  for (const auto& [from, to] : kMap) replace_all(s, from, to);
}

// "1{,}234", "1,\!234", "1\,234", "1, \! 234": separators between a digit and a group of 3 digits.
void remove_thousands_marks(std::string& s) {
  static constexpr std::array<std::string_view, 5> kMarks{"{,}", ",\\!", ", \\!", "\\,", "{,}\\!"};
  std::string out;
  out.reserve(s.size());
  std::size_t i = 0;
  while (i < s.size()) {
    bool done = false;
    std::size_t keep = out.size();
    while (keep > 0 && out[keep - 1] == ' ') --keep;
    if (keep > 0 && is_digit(out[keep - 1])) {
      for (std::string_view m : kMarks) {
        if (s.compare(i, m.size(), m) != 0) continue;
        std::size_t j = i + m.size();
        while (j < s.size() && s[j] == ' ') ++j;
        if (j + 3 <= s.size() && is_digit(s[j]) && is_digit(s[j + 1]) && is_digit(s[j + 2]) &&
            (j + 3 == s.size() || !is_digit(s[j + 3]))) {
          out.resize(keep);
          i = j;
          done = true;
          break;
        }
      }
    }
    if (!done) out.push_back(s[i++]);
  }
  s = std::move(out);
}

// The whole answer is one number written with thousands groups ("1,234,567.5", "1 000").
void remove_whole_thousands(std::string& s, char sep) {
  std::size_t i = 0;
  if (i < s.size() && s[i] == '-') ++i;
  std::size_t lead = 0;
  while (i + lead < s.size() && is_digit(s[i + lead])) ++lead;
  if (lead == 0 || lead > 3 || s[i] == '0') return;  // "0,111" is no thousands grouping
  std::size_t j = i + lead;
  int groups = 0;
  while (j < s.size() && s[j] == sep) {
    if (j + 3 >= s.size() + 0 && j + 3 > s.size() - 0) return;
    if (j + 4 > s.size() || !is_digit(s[j + 1]) || !is_digit(s[j + 2]) || !is_digit(s[j + 3])) return;
    j += 4;
    ++groups;
  }
  if (groups == 0) return;
  if (j < s.size() && s[j] == '.') {
    ++j;
    while (j < s.size() && is_digit(s[j])) ++j;
  }
  if (j != s.size()) return;
  s.erase(std::remove(s.begin(), s.end(), sep), s.end());
}

// \cmd{X} -> X for the given commands.
bool unwrap_commands(std::string& s, std::initializer_list<std::string_view> names) {
  bool any = false;
  for (std::string_view name : names) {
    std::size_t pos = 0;
    while ((pos = s.find(name, pos)) != std::string::npos) {
      std::size_t b = pos + name.size();
      while (b < s.size() && s[b] == ' ') ++b;
      if (b >= s.size() || s[b] != '{' ||
          (pos + name.size() < s.size() && is_alpha(s[pos + name.size()]))) {
        pos += name.size();
        continue;
      }
      std::size_t e = matching_brace(s, b);
      if (e == std::string::npos) {
        pos += name.size();
        continue;
      }
      std::string inner = s.substr(b + 1, e - b - 1);
      s.replace(pos, e + 1 - pos, inner);
      any = true;
    }
  }
  return any;
}

// A trailing \text{..}/\mbox{..}/\mathrm{..} (optionally ^2/^3) after a value is a unit.
void remove_trailing_text_unit(std::string& s) {
  for (int round = 0; round < 3; ++round) {
    std::string t = trim_copy(s);
    std::size_t end = t.size();
    // Optional power on the unit: \text{cm}^2, \mathrm{m}^{3}.
    if (end >= 2 && t[end - 2] == '^' && is_digit(t[end - 1])) end -= 2;
    else if (end >= 4 && t.compare(end - 4, 2, "^{") == 0 && is_digit(t[end - 2]) && t[end - 1] == '}')
      end -= 4;
    if (end == 0 || t[end - 1] != '}') return;
    // Find the opening brace of this final group.
    int depth = 0;
    std::size_t open = std::string::npos;
    for (std::size_t k = end; k-- > 0;) {
      if (t[k] == '}') ++depth;
      else if (t[k] == '{' && --depth == 0) {
        open = k;
        break;
      }
    }
    if (open == std::string::npos) return;
    std::size_t cmd_end = open;
    while (cmd_end > 0 && t[cmd_end - 1] == ' ') --cmd_end;
    std::size_t cmd_start = cmd_end;
    while (cmd_start > 0 && is_alpha(t[cmd_start - 1])) --cmd_start;
    if (cmd_start == 0 || t[cmd_start - 1] != '\\') return;
    std::string_view cmd(t.data() + cmd_start, cmd_end - cmd_start);
    if (cmd != "text" && cmd != "mbox" && cmd != "mathrm" && cmd != "textrm" && cmd != "rm") return;
    std::string inner = t.substr(open + 1, end - open - 2);
    // A unit has letters; "\text{(D)}" alone or "\mathrm{5}" are not units.
    if (std::none_of(inner.begin(), inner.end(), is_alpha)) return;
    std::string prefix = trim_copy(std::string_view(t).substr(0, cmd_start - 1));
    if (prefix.empty()) return;
    char last = prefix.back();
    if (!(is_digit(last) || last == '}' || last == ')' || last == ']' || last == '.' ||
          (is_alpha(last) && prefix.size() <= 24)))
      return;
    // Words that are answers themselves ("\text{ or }...") are not units: only trailing ones here.
    std::string lw;
    for (char c : inner) lw.push_back(lower(c));
    if (lw.find(" and ") != std::string::npos || lw.find(" or ") != std::string::npos) return;
    s = prefix;
  }
}

bool is_unit_word(std::string_view w) {
  static constexpr std::array<std::string_view, 88> kUnits{
      "cm", "mm", "km", "meter", "meters", "metre", "metres", "centimeter", "centimeters",
      "kilometer", "kilometers", "inch", "inches", "ft", "feet", "foot", "yd", "yard", "yards",
      "mile", "miles", "unit", "units", "square", "sq", "cubic", "degree", "degrees", "deg",
      "radian", "radians", "second", "seconds", "sec", "minute", "minutes", "min", "mins", "hour",
      "hours", "hr", "hrs", "day", "days", "week", "weeks", "month", "months", "year", "years",
      "dollar", "dollars", "cent", "cents", "kg", "gram", "grams", "lb", "lbs", "pound", "pounds",
      "ounce", "ounces", "oz", "mph", "kph", "hz", "khz", "mhz", "ghz", "ev", "kev", "mev",
      "joule", "joules", "watt", "watts", "liter", "liters", "ml", "angstrom", "angstroms",
      "people", "students", "ways", "percent", "pct", "percentage"};
  std::string l;
  for (char c : w) l.push_back(lower(c));
  return std::find(kUnits.begin(), kUnits.end(), l) != kUnits.end();
}

void remove_trailing_unit_words(std::string& s, bool& percent) {
  for (int round = 0; round < 3; ++round) {
    std::string t = trim_copy(s);
    std::size_t e = t.size();
    std::size_t b = e;
    while (b > 0 && is_alpha(t[b - 1])) --b;
    if (b == e || e - b < 2) return;
    if (b > 0 && t[b - 1] == '\\') return;  // a command, not a word
    std::string_view word(t.data() + b, e - b);
    if (!is_unit_word(word)) return;
    std::string prefix = trim_copy(std::string_view(t).substr(0, b));
    if (prefix.empty()) return;
    char last = prefix.back();
    if (!(is_digit(last) || last == '}' || last == ')' || is_alpha(last) || last == '.')) return;
    if (is_alpha(last) && !(b > 0 && t[b - 1] == ' ')) return;  // "xcm" is not "x cm"
    std::string lw;
    for (char c : word) lw.push_back(lower(c));
    if (lw == "percent" || lw == "pct" || lw == "percentage") percent = true;
    s = prefix;
  }
}

// " and " / " or " between answers -> ",".
void words_to_commas(std::string& s) {
  for (std::string_view w : {std::string_view(" and "), std::string_view(" or ")}) replace_all(s, w, ",");
  for (std::string_view w : {std::string_view(",and "), std::string_view(",or ")}) replace_all(s, w, ",");
}

// Reads one shorthand argument at s[i] (after spaces): "{...}", one digit, one letter or one
// command. Returns the braced form and advances i, or "" when there is none.
std::string shorthand_arg(const std::string& s, std::size_t& i) {
  std::size_t j = i;
  while (j < s.size() && s[j] == ' ') ++j;
  if (j >= s.size()) return {};
  if (s[j] == '{') {
    std::size_t e = matching_brace(s, j);
    if (e == std::string::npos) return {};
    i = e + 1;
    return s.substr(j, e + 1 - j);
  }
  if (is_digit(s[j]) || is_alpha(s[j])) {
    i = j + 1;
    return std::string("{") + s[j] + "}";
  }
  if (s[j] == '\\') {
    std::size_t k = j + 1;
    while (k < s.size() && is_alpha(s[k])) ++k;
    if (k == j + 1) return {};
    i = k;
    return "{" + s.substr(j, k - j) + "}";
  }
  return {};
}

void repair_shorthand(std::string& s) {
  std::string out;
  out.reserve(s.size() + 16);
  std::size_t i = 0;
  while (i < s.size()) {
    auto at = [&](std::string_view name) {
      return s.compare(i, name.size(), name) == 0 &&
             (i + name.size() >= s.size() || !is_alpha(s[i + name.size()]));
    };
    if (at("\\frac") || at("\\binom")) {
      std::size_t name_len = at("\\frac") ? 5 : 6;
      std::size_t j = i + name_len;
      std::string a = shorthand_arg(s, j);
      std::string b = a.empty() ? std::string() : shorthand_arg(s, j);
      if (!a.empty() && !b.empty()) {
        out.append(s, i, name_len);
        out += a + b;
        i = j;
        continue;
      }
    } else if (at("\\sqrt")) {
      std::size_t j = i + 5;
      while (j < s.size() && s[j] == ' ') ++j;
      std::string index;
      if (j < s.size() && s[j] == '[') {
        std::size_t e = s.find(']', j);
        if (e != std::string::npos) {
          index = s.substr(j, e + 1 - j);
          j = e + 1;
        }
      }
      std::string a = shorthand_arg(s, j);
      if (!a.empty()) {
        out += "\\sqrt" + index + a;
        i = j;
        continue;
      }
    } else if (s.compare(i, 5, "sqrt(") == 0 && (i == 0 || (!is_alpha(s[i - 1]) && s[i - 1] != '\\'))) {
      std::size_t depth = 0, e = i + 4;
      for (; e < s.size(); ++e) {
        if (s[e] == '(') ++depth;
        else if (s[e] == ')' && --depth == 0) break;
      }
      if (e < s.size()) {
        out += "\\sqrt{" + s.substr(i + 5, e - i - 5) + "}";
        i = e + 1;
        continue;
      }
    } else if (s.compare(i, 2, "^(") == 0) {
      std::size_t depth = 0, e = i + 1;
      for (; e < s.size(); ++e) {
        if (s[e] == '(') ++depth;
        else if (s[e] == ')' && --depth == 0) break;
      }
      if (e < s.size()) {
        out += "^{" + s.substr(i + 2, e - i - 2) + "}";
        i = e + 1;
        continue;
      }
    }
    out.push_back(s[i++]);
  }
  s = std::move(out);
}

void normalize_matrices(std::string& s) {
  for (std::string_view env : {"bmatrix", "Bmatrix", "vmatrix", "Vmatrix", "smallmatrix", "matrix"}) {
    replace_all(s, std::string("\\begin{") + std::string(env) + "}", "\\begin{pmatrix}");
    replace_all(s, std::string("\\end{") + std::string(env) + "}", "\\end{pmatrix}");
  }
  std::size_t p;
  while ((p = s.find("\\begin{array}")) != std::string::npos) {
    std::size_t q = p + 13;
    while (q < s.size() && s[q] == ' ') ++q;
    std::size_t e = q;
    if (q < s.size() && s[q] == '{') {
      e = matching_brace(s, q);
      e = e == std::string::npos ? q : e + 1;
    }
    s.replace(p, e - p, "\\begin{pmatrix}");
  }
  replace_all(s, "\\end{array}", "\\end{pmatrix}");
  replace_all(s, "\\hline", "");
}

// ".5" -> "0.5"; "5.000" -> "5"; "2.50" -> "2.5".
void fix_number_literals(std::string& s) {
  std::string out;
  out.reserve(s.size() + 4);
  std::size_t i = 0;
  while (i < s.size()) {
    char c = s[i];
    bool starts_number = is_digit(c) || (c == '.' && i + 1 < s.size() && is_digit(s[i + 1]));
    bool prev_ok = out.empty() || !(is_digit(out.back()) || is_alpha(out.back()) || out.back() == '.' ||
                                    out.back() == '_');
    if (!starts_number || !prev_ok) {
      out.push_back(c);
      ++i;
      continue;
    }
    std::size_t j = i;
    while (j < s.size() && is_digit(s[j])) ++j;
    std::string int_part = s.substr(i, j - i);
    if (j < s.size() && s[j] == '.' && j + 1 < s.size() && is_digit(s[j + 1])) {
      std::size_t k = j + 1;
      while (k < s.size() && is_digit(s[k])) ++k;
      std::string frac = s.substr(j + 1, k - j - 1);
      // A second '.' (a version or a range like 1.2.3) leaves the literal alone.
      if (k < s.size() && s[k] == '.' && k + 1 < s.size() && is_digit(s[k + 1])) {
        out.append(s, i, k - i);
        i = k;
        continue;
      }
      while (!frac.empty() && frac.back() == '0') frac.pop_back();
      out += int_part.empty() ? "0" : int_part;
      if (!frac.empty()) out += "." + frac;
      i = k;
    } else {
      out += int_part;
      i = j;
    }
  }
  s = std::move(out);
}

// A whole answer in exponent notation ("3.61e-10", "1E5") -> "3.61\\times10^{-10}".
void scientific_to_latex(std::string& s) {
  std::size_t i = 0;
  if (i < s.size() && s[i] == '-') ++i;
  std::size_t m = i;
  while (i < s.size() && (is_digit(s[i]) || s[i] == '.')) ++i;
  if (i == m || i >= s.size() || (s[i] != 'e' && s[i] != 'E')) return;
  std::size_t e = i + 1;
  std::size_t j = e;
  if (j < s.size() && (s[j] == '-' || s[j] == '+')) ++j;
  std::size_t d = j;
  while (j < s.size() && is_digit(s[j])) ++j;
  if (j == d || j != s.size()) return;
  std::string mant = s.substr(0, i);
  std::string ex = s.substr(e);
  if (!ex.empty() && ex[0] == '+') ex.erase(0, 1);
  s = mant + "\\times10^{" + ex + "}";
}

// Top-level '=' positions (outside braces/brackets).
std::vector<std::size_t> top_level_equals(const std::string& s) {
  std::vector<std::size_t> eq;
  int depth = 0;
  for (std::size_t i = 0; i < s.size(); ++i) {
    char c = s[i];
    if (c == '{' || c == '(' || c == '[') ++depth;
    else if (c == '}' || c == ')' || c == ']') --depth;
    else if (c == '=' && depth == 0) eq.push_back(i);
  }
  return eq;
}

bool is_short_lhs(std::string_view lhs) {
  std::string t = trim_copy(lhs);
  if (t.empty() || t.size() > 6) {
    // Greek letters and subscripts run a little longer: "\theta", "\alpha_1", "x_{10}".
    if (t.size() > 10 || t.empty() || t[0] != '\\') return false;
  }
  for (char c : t) {
    if (!(is_alpha(c) || is_digit(c) || c == '_' || c == '{' || c == '}' || c == '\\' || c == '(' ||
          c == ')' || c == '\'' || c == ' '))
      return false;
  }
  return is_alpha(t[0]) || t[0] == '\\';
}

std::string make_canonical(const std::string& clean) {
  std::string out;
  out.reserve(clean.size());
  for (char c : clean)
    if (!is_space(c)) out.push_back(c);
  // One-token scripts: "^{2}" -> "^2", "_{12}" -> "_12" (digits only, or one letter).
  std::string r;
  r.reserve(out.size());
  for (std::size_t i = 0; i < out.size(); ++i) {
    if ((out[i] == '^' || out[i] == '_') && i + 2 < out.size() && out[i + 1] == '{') {
      std::size_t e = out.find('}', i + 2);
      if (e != std::string::npos && e > i + 2) {
        std::string_view in(out.data() + i + 2, e - i - 2);
        bool digits = std::all_of(in.begin(), in.end(), is_digit);
        if (digits || (in.size() == 1 && is_alpha(in[0]))) {
          r.push_back(out[i]);
          r.append(in);
          i = e;
          continue;
        }
      }
    }
    r.push_back(out[i]);
  }
  return r;
}

}  // namespace

std::size_t matching_brace(std::string_view s, std::size_t open) {
  int depth = 0;
  for (std::size_t j = open; j < s.size(); ++j) {
    char c = s[j];
    if (c == '\\' && j + 1 < s.size()) {
      ++j;
      continue;
    }
    if (c == '{') ++depth;
    else if (c == '}' && --depth == 0) return j;
  }
  return std::string_view::npos;
}

NormalizedAnswer normalize_answer(std::string_view answer, bool strip_short_lhs) {
  NormalizedAnswer r;
  std::string s(answer);
  for (char& c : s)
    if (is_space(c)) c = ' ';
  map_unicode(s);
  s = strip_math_delimiters(s);
  replace_all(s, "\\$", "");
  replace_all(s, "$", "");
  // Doubled backslashes before a command ("\\\\frac" from an over-escaped string) outside a matrix.
  if (s.find("\\begin") == std::string::npos && s.find("\\\\") != std::string::npos) {
    std::string t;
    for (std::size_t i = 0; i < s.size(); ++i) {
      if (s[i] == '\\' && i + 2 < s.size() && s[i + 1] == '\\' && is_alpha(s[i + 2])) continue;
      t.push_back(s[i]);
    }
    s = std::move(t);
  }
  // A sentence's final period goes first, so "5 \text{ cm}." and "62.5%." still end in a unit.
  s = trim_copy(s);
  while (!s.empty() && s.back() == '.' && !(s.size() >= 2 && s[s.size() - 2] == '\\')) s = trim_copy(s.substr(0, s.size() - 1));
  replace_all(s, "{, }", "{,}");

  remove_thousands_marks(s);
  for (std::string_view cmd : {"\\displaystyle", "\\left", "\\right", "\\bigl", "\\bigr", "\\Bigl",
                               "\\Bigr", "\\biggl", "\\biggr", "\\big", "\\Big", "\\bigg", "\\Bigg",
                               "\\limits", "\\nolimits"})
    replace_command(s, cmd, "");
  // "\\" (a matrix row break) must survive the spacing rules below: park it first.
  replace_all(s, "\\\\", "\x01");
  replace_all(s, "\\!", "");
  for (std::string_view sp : {"\\,", "\\;", "\\:", "\\ ", "~", "\\quad", "\\qquad"}) replace_all(s, sp, " ");
  replace_all(s, "\x01", "\\\\ ");
  replace_command(s, "\\dfrac", "\\frac");
  replace_command(s, "\\tfrac", "\\frac");
  replace_command(s, "\\cfrac", "\\frac");
  replace_command(s, "\\dbinom", "\\binom");
  replace_command(s, "\\tbinom", "\\binom");
  // `\left.` / `\right.` leave a lone "." that is not a decimal point: drop ". " before a
  // closing delimiter is not worth the risk; only the whole-answer trailing dot is removed below.

  for (std::string_view deg : {"^{\\circ}", "^\\circ", "^{ \\circ }", "^{\\circ }", "^{ \\circ}",
                               "\\circ", "\\degree"})
    replace_all(s, deg, "");

  {
    std::string t = trim_copy(s);
    for (std::string_view pct : {"\\%", "%"}) {
      if (t.size() >= pct.size() && t.compare(t.size() - pct.size(), pct.size(), pct) == 0) {
        r.percent = true;
        t.resize(t.size() - pct.size());
        t = trim_copy(t);
      }
    }
    s = t;
    replace_all(s, "\\%", "");  // percent signs inside (a list of percentages)
  }

  remove_trailing_text_unit(s);
  {
    std::string before = s;
    if (unwrap_commands(s, {"\\text", "\\textbf", "\\textrm", "\\textit", "\\texttt", "\\mathrm",
                            "\\mathbf", "\\mathit", "\\mathsf", "\\mbox", "\\boldsymbol",
                            "\\operatorname", "\\textnormal", "\\emph", "\\bf", "\\rm"})) {
      // Text content with letters makes the answer case-insensitive.
      for (std::size_t i = 0; i + 1 < s.size(); ++i)
        if (is_alpha(s[i]) && (i == 0 || s[i - 1] != '\\')) r.text = true;
    }
  }
  {
    // Plain words (three letters or more, not commands) also make an answer text.
    std::size_t run = 0;
    for (std::size_t i = 0; i < s.size(); ++i) {
      if (is_alpha(s[i])) {
        if (run == 0 && i > 0 && s[i - 1] == '\\') {
          while (i < s.size() && is_alpha(s[i])) ++i;  // skip the command name
          run = 0;
          if (i >= s.size()) break;
          continue;
        }
        if (++run >= 3) r.text = true;
      } else {
        run = 0;
      }
    }
  }
  split_glued_words(s);
  words_to_commas(s);
  remove_trailing_unit_words(s, r.percent);

  replace_command(s, "\\neq", "\\ne");
  replace_command(s, "\\leqslant", "\\le");
  replace_command(s, "\\geqslant", "\\ge");
  replace_command(s, "\\leq", "\\le");
  replace_command(s, "\\geq", "\\ge");
  replace_command(s, "\\lt", "<");
  replace_command(s, "\\gt", ">");
  replace_all(s, "<=", "\\le ");
  replace_all(s, ">=", "\\ge ");
  replace_all(s, "!=", "\\ne ");
  drop_approximation(s);

  repair_shorthand(s);
  normalize_matrices(s);
  collapse_spaces(s);
  while (!s.empty() && (s.back() == '.' || s.back() == ' ')) s.pop_back();
  while (!s.empty() && s.front() == ' ') s.erase(s.begin());
  remove_whole_thousands(s, ',');
  remove_whole_thousands(s, ' ');
  fix_number_literals(s);
  scientific_to_latex(s);

  // "x \in [a, b]": membership of a short name is the set itself.
  if (std::size_t in = s.find("\\in"); in != std::string::npos &&
      (in + 3 >= s.size() || !is_alpha(s[in + 3])) && is_short_lhs(std::string_view(s).substr(0, in)))
    s = trim_copy(std::string_view(s).substr(in + 3));
  join_assignment_groups(s);
  auto eqs = top_level_equals(s);
  r.equation = !eqs.empty();
  const bool inequality = s.find('<') != std::string::npos || s.find('>') != std::string::npos ||
                          s.find("\\le") != std::string::npos || s.find("\\ge") != std::string::npos;
  if (!strip_short_lhs && eqs.size() >= 2 && !inequality &&
      is_short_lhs(std::string_view(s).substr(0, eqs.front()))) {
    // "x = 5 + 5 + 1 = 1/3" against an equation: the chain's first left and last right sides.
    std::string lhs = trim_copy(std::string_view(s).substr(0, eqs.front()));
    std::string rhs = trim_copy(std::string_view(s).substr(eqs.back() + 1));
    if (!rhs.empty() && s.find(',') == std::string::npos) {
      s = lhs + " = " + rhs;
      eqs = top_level_equals(s);
    }
  }
  if (strip_short_lhs && !eqs.empty() && is_short_lhs(std::string_view(s).substr(0, eqs.front())) &&
      s.find('<') == std::string::npos && s.find('>') == std::string::npos &&
      s.find("\\le") == std::string::npos && s.find("\\ge") == std::string::npos) {
    // "x = y = 5" keeps the last right side; a comma list ("x=1, y=2") is left alone.
    std::string rhs = trim_copy(std::string_view(s).substr(eqs.back() + 1));
    std::string lhs_all = s.substr(0, eqs.back());
    if (!rhs.empty() && lhs_all.find(',') == std::string::npos) {
      s = rhs;
      remove_whole_thousands(s, ',');
      scientific_to_latex(s);
    }
  }
  r.clean = s;
  r.canonical = make_canonical(s);
  return r;
}

std::vector<std::size_t> top_level_equal_signs(std::string_view s) {
  return top_level_equals(std::string(s));
}

bool canonical_equal(const NormalizedAnswer& a, const NormalizedAnswer& b) {
  if (a.canonical == b.canonical) return true;
  if (!(a.text || b.text) || a.canonical.size() != b.canonical.size()) return false;
  for (std::size_t i = 0; i < a.canonical.size(); ++i)
    if (lower(a.canonical[i]) != lower(b.canonical[i])) return false;
  return true;
}

}  // namespace lorasync::reward
