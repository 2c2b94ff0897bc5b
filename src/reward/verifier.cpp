// grade(): extraction, canonical strings, parsing and comparison glued together (grade.h).
#include <algorithm>
#include <cctype>
#include <vector>

#include "reward/answer_forms.h"
#include "reward/compare.h"
#include "reward/expr.h"
#include "reward/extract.h"
#include "reward/grade.h"
#include "reward/matrix.h"
#include "reward/normalize.h"
#include "reward/parser.h"

namespace lorasync::reward {
namespace {

GradeResult verdict(bool correct, std::string extracted, std::string reason) {
  GradeResult r;
  r.correct = correct;
  r.extracted = std::move(extracted);
  r.reason = std::move(reason);
  return r;
}

std::string replace_once(const std::string& s, std::size_t at, std::size_t len, std::string_view with) {
  std::string out = s.substr(0, at);
  out += with;
  out += s.substr(at + len);
  return out;
}

// Parses, expanding a single "\pm"/"\mp" into the list of its two values.
ParseResult parse_expanded(const std::string& clean, const Limits& limits) {
  std::size_t at = clean.find("\\pm");
  if (at == std::string::npos) at = clean.find("\\mp");
  if (at == std::string::npos || clean.find("\\pm", at + 3) != std::string::npos ||
      clean.find("\\mp", at + 3) != std::string::npos)
    return parse_answer(clean, limits.max_depth, limits.max_nodes);
  bool leading = clean.find_first_not_of(' ') == at;
  ParseResult a = parse_answer(replace_once(clean, at, 3, leading ? " " : "+"), limits.max_depth,
                               limits.max_nodes);
  ParseResult b = parse_answer(replace_once(clean, at, 3, "-"), limits.max_depth, limits.max_nodes);
  if (!a.ok || !b.ok) return a.ok ? b : a;
  ParseResult r;
  r.ok = true;
  Expr& e = r.expr;
  e.nodes = a.expr.nodes;
  int off = static_cast<int>(e.nodes.size());
  for (Node n : b.expr.nodes) {
    for (int& c : n.children) c += off;
    e.nodes.push_back(std::move(n));
  }
  Node list;
  list.kind = NodeKind::kList;
  list.children = {a.expr.root, b.expr.root + off};
  e.nodes.push_back(std::move(list));
  e.root = static_cast<int>(e.nodes.size()) - 1;
  e.has_decimal = a.expr.has_decimal || b.expr.has_decimal;
  return r;
}

std::string trim_copy(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\n' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\n' || s.back() == '\t')) s.remove_suffix(1);
  return std::string(s);
}

// The boxes of a reference that form its answer: the last box, and the boxes before it while only
// a short label separates them ("\boxed{1} papers and \boxed{2} bins": at most 3 words, no
// retraction); a box repeated ("\boxed{004} ... \boxed{004}") counts once.
std::vector<std::string> reference_boxes(std::string_view reference) {
  std::vector<BoxSpan> spans = last_box_spans(reference, 16);
  std::vector<std::string> out;
  for (std::size_t k = spans.size(); k-- > 0;) {
    if (!out.empty() && prose_words(reference.substr(spans[k].end, spans[k + 1].start - spans[k].end)) > 3)
      break;
    if (std::find(out.begin(), out.end(), spans[k].content) == out.end()) out.push_back(spans[k].content);
  }
  std::reverse(out.begin(), out.end());
  return out;
}

// A reference may itself carry a box (a whole solution as the reference); several boxes apart
// ("\boxed{1} papers and \boxed{2} bins") are the list of its parts. A reference in prose (eight
// words or more) that states its answer ("... The final answer is $28\%$. I hope it is
// correct.") is that answer; other prose references are kept whole.
std::string reference_answer(std::string_view reference) {
  if (reference.find("\\boxed") != std::string_view::npos || reference.find("\\fbox") != std::string_view::npos) {
    std::vector<std::string> boxes = reference_boxes(reference);
    if (boxes.size() >= 2) {
      std::string joined;
      for (const auto& b : boxes) joined += (joined.empty() ? "" : ", ") + b;
      return joined;
    }
    if (!boxes.empty()) return boxes[0];
  }
  if (reference.find("nswer") != std::string_view::npos && prose_words(reference, 3) >= 8)
    if (auto a = answer_statement(reference)) return *a;
  return std::string(reference);
}

// True when the text outside $...$ spans is only separators ("$8$, $4$", "$1$ and $2$").
bool only_math_spans(std::string_view s) {
  bool in_math = false;
  std::string outside;
  for (std::size_t k = 0; k < s.size(); ++k) {
    char c = s[k];
    if (c == '\\' && k + 1 < s.size()) {
      if (in_math) {
        ++k;
        continue;
      }
      return false;
    }
    if (c == '$') {
      in_math = !in_math;
      continue;
    }
    if (!in_math) outside.push_back(c);
  }
  if (in_math) return false;
  for (char c : outside)
    if (!(c == ',' || c == ';' || c == ' ' || c == '\n' || c == 'a' || c == 'n' || c == 'd' ||
          c == 'o' || c == 'r'))
      return false;
  return true;
}

// A bare predicted answer (grade_answer): a box inside it is preferred (unless a "final answer"
// statement follows the last box); "$...$" is stripped; a list written span by span ("$8$, $4$")
// is kept whole; prose ("the number is 1,000.99", "Final Answer: ... is 34") falls back to the
// evaluation extraction.
std::string bare_answer(std::string_view tail) {
  if (auto after = answer_after_last_box(tail)) return *after;
  if (auto boxed = extract_last_boxed(tail)) return *boxed;
  std::string s = strip_math_delimiters(tail);
  bool dollar = false;
  for (std::size_t k = 0; k < s.size(); ++k)
    if (s[k] == '$' && (k == 0 || s[k - 1] != '\\')) dollar = true;
  bool prose = dollar || s.find("\\(") != std::string::npos || s.find("\\[") != std::string::npos ||
               s.find("answer") != std::string::npos || s.find("Answer") != std::string::npos ||
               is_sentence(s);
  std::string whole = trim_copy(tail);
  if (prose && only_math_spans(whole)) return whole;  // "$8$, $4$": a list, span by span
  if (prose)
    if (auto f = extract_fallback(s)) return *f;
  return s;
}

}  // namespace

namespace {

bool is_relation_text(std::string_view s) {
  for (std::string_view op : {"<", ">", "\\le", "\\ge", "\\ne"})
    if (s.find(op) != std::string_view::npos) return true;
  return false;
}

}  // namespace

bool canonical_string_equal(std::string_view predicted, std::string_view reference) {
  NormalizedAnswer g = normalize_answer(reference, false);
  NormalizedAnswer p = normalize_answer(predicted, !g.equation);
  return !p.canonical.empty() && canonical_equal(g, p);
}

namespace {

// Words of prose in a normalised answer: a run of 3+ letters that is not a command or a function
// name. A box holding a sentence ("the smallest k is 7") is compared as a string, never evaluated
// as a product of symbols.
bool has_prose(std::string_view s) {
  static constexpr std::string_view kNames[] = {"sin", "cos", "tan", "cot", "sec", "csc", "log", "exp", "max",
                                                "min", "gcd", "lcm", "det", "mod", "sinh", "cosh", "tanh",
                                                "arcsin", "arccos", "arctan", "sqrt", "frac", "binom", "pmatrix",
                                                "begin", "end", "infty", "cup", "cap", "pi"};
  std::size_t i = 0;
  while (i < s.size()) {
    if (!std::isalpha(static_cast<unsigned char>(s[i]))) {
      ++i;
      continue;
    }
    std::size_t j = i;
    while (j < s.size() && std::isalpha(static_cast<unsigned char>(s[j]))) ++j;
    const bool command = i > 0 && s[i - 1] == '\\';
    std::string_view w = s.substr(i, j - i);
    if (!command && w.size() >= 3 &&
        std::find(std::begin(kNames), std::end(kNames), w) == std::end(kNames))
      return true;
    i = j;
  }
  return false;
}

// Top-level parts of a reference list ("5, 9" -> 2; "(1, 2)" and "\{1, 2\}" -> 1).
std::size_t list_parts(std::string_view s) {
  int depth = 0;
  std::size_t parts = 1;
  for (std::size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (c == '(' || c == '[' || c == '{') ++depth;
    else if (c == ')' || c == ']' || c == '}') --depth;
    else if (c == ',' && depth == 0 && !(i > 0 && s[i - 1] == '{')) ++parts;
  }
  return parts;
}

// True when the text from the first of the last k boxes on takes one of them back ("\boxed{3} is
// wrong, \boxed{5}", "wait, actually"): such boxes are a self-correction, not one answer per part.
bool retracts(std::string_view boxes_text) {
  std::string lower(boxes_text);
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (std::string_view w : {"wrong", "incorrect", "not ", "mistake", "actually", "instead", "wait", "correction",
                             "rather", "no,", "oops"})
    if (lower.find(w) != std::string::npos) return true;
  return false;
}

}  // namespace

GradeResult compare_answers(std::string_view predicted, std::string_view reference_raw,
                            const Limits& limits) {
  std::string extracted(predicted);
  std::string reference = reference_answer(reference_raw);
  if (trim_copy(predicted).empty()) return verdict(false, extracted, "empty_answer");
  const std::string pred_trim = trim_copy(predicted);
  if (pred_trim == trim_copy(reference) ||
      (reference.size() != reference_raw.size() && pred_trim == trim_copy(reference_raw)))
    return verdict(true, extracted, "string_equal");
  if (predicted.size() > limits.max_answer_bytes || reference.size() > limits.max_answer_bytes)
    return verdict(false, extracted, "too_complex");

  NormalizedAnswer g = normalize_answer(reference, false);
  NormalizedAnswer p = normalize_answer(predicted, !g.equation);
  if (p.canonical.empty()) return verdict(false, extracted, "empty_answer");
  if (canonical_equal(g, p)) return verdict(true, extracted, "string_equal");

  if (has_prose(p.clean) && !has_prose(g.clean)) return verdict(false, extracted, "not_equal");

  // A reference chain of equalities ("1 = a = x = 0") against a prediction that is no relation:
  // the chain's last right side.
  if (!p.equation && top_level_equal_signs(g.clean).size() >= 2 && !is_relation_text(p.clean) &&
      g.clean.find(',') == std::string::npos) {
    const std::string& c = g.clean;
    g = normalize_answer(c.substr(top_level_equal_signs(c).back() + 1), false);
    if (canonical_equal(g, p)) return verdict(true, extracted, "string_equal");
  }
  // A decimal comma ("1000,99", "0,111") against one number written with a point.
  // Read from the answer as written: the canonical form drops "12.500"'s zeros.
  auto comma_reading = [](std::string_view raw, const std::string& clean) {
    auto d = decimal_comma_reading(strip_math_delimiters(raw));
    return d ? d : decimal_comma_reading(clean);
  };
  if (is_plain_number(g.clean) || is_plain_number(p.clean)) {
    if (auto d = comma_reading(predicted, p.clean); d && is_plain_number(g.clean)) p = normalize_answer(*d, false);
    else if (auto e = comma_reading(reference, g.clean); e && is_plain_number(p.clean)) g = normalize_answer(*e, false);
  }

  ParseResult gp = parse_expanded(g.clean, limits);
  ParseResult pp = parse_expanded(p.clean, limits);
  if (!gp.ok || !pp.ok) {
    bool complex = (!gp.ok && gp.too_complex) || (!pp.ok && pp.too_complex);
    return verdict(false, extracted, complex ? "too_complex" : "parse_error");
  }
  // "A + B" of matrices: the matrix it makes (matrix.h).
  fold_matrix_arithmetic(gp.expr, limits.max_nodes);
  fold_matrix_arithmetic(pp.expr, limits.max_nodes);
  Budget budget;
  budget.steps_left = limits.max_steps;
  CompareOptions opt;
  auto finish = [&](bool ok, std::string reason) {
    GradeResult r = verdict(ok, extracted, std::move(reason));
    r.steps = limits.max_steps - budget.steps_left;
    return r;
  };
  CompareOutcome c = compare_exprs(gp.expr, pp.expr, opt, budget);
  if (c.equal) return finish(true, c.reason);
  if (c.too_complex) return finish(false, "too_complex");
  if (g.percent != p.percent) {
    // "28\%" against "0.28": the percentage is compared as a fraction (and 0.28 against "28\%").
    opt.pred_scale = p.percent ? *Rational::make(1, 100) : Rational(100);
    CompareOutcome s = compare_exprs(gp.expr, pp.expr, opt, budget);
    if (s.equal) return finish(true, "percent_equal");
    if (s.too_complex) return finish(false, "too_complex");
  }
  return finish(false, "not_equal");
}

namespace {

// A reference listing k parts against one box per part ("(a) \boxed{5} ... (b) \boxed{9}"):
// the last k boxes as that list, unless the prose among them takes one back.
std::optional<GradeResult> one_box_per_part(std::string_view tail, std::string_view reference,
                                            const Limits& limits) {
  const std::size_t k = list_parts(reference_answer(reference));
  if (k < 2 || k > 16) return std::nullopt;
  std::size_t first = 0;
  std::vector<std::string> boxes = extract_last_boxes(tail, k, &first);
  if (boxes.size() != k || retracts(tail.substr(first))) return std::nullopt;
  std::string joined;
  for (const auto& b : boxes) joined += (joined.empty() ? "" : ", ") + b;
  GradeResult j = compare_answers(joined, reference, limits);
  if (!j.correct) return std::nullopt;
  return j;
}

}  // namespace

GradeResult grade(std::string_view completion, std::string_view reference, const GradeOptions& options) {
  if (completion.size() > options.limits.max_completion_bytes) return verdict(false, "", "too_complex");
  std::string_view tail = after_think(completion);
  std::optional<std::string> answer = extract_last_boxed(tail);
  if (!answer && options.fallback) answer = extract_fallback(tail);
  if (!answer) return verdict(false, "", "no_box");
  GradeResult r = compare_answers(*answer, reference, options.limits);
  if (r.correct || r.reason == "too_complex") return r;
  if (auto j = one_box_per_part(tail, reference, options.limits)) return *j;
  return r;
}

GradeResult grade(std::string_view completion, const std::vector<std::string>& references,
                  const GradeOptions& options) {
  if (references.empty()) return verdict(false, "", "no_reference");
  GradeResult last;
  for (const std::string& ref : references) {
    last = grade(completion, ref, options);
    if (last.correct || last.reason == "no_box") return last;
  }
  return last;
}

GradeResult grade_answer(std::string_view prediction, std::string_view reference,
                         const GradeOptions& options) {
  if (prediction.size() > options.limits.max_completion_bytes) return verdict(false, "", "too_complex");
  std::string_view tail = after_think(prediction);
  GradeResult r = compare_answers(bare_answer(tail), reference, options.limits);
  if (r.correct || r.reason == "too_complex") return r;
  if (auto j = one_box_per_part(tail, reference, options.limits)) return *j;
  return r;
}

GradeResult grade_answer(std::string_view prediction, const std::vector<std::string>& references,
                         const GradeOptions& options) {
  if (references.empty()) return verdict(false, "", "no_reference");
  GradeResult last;
  for (const std::string& ref : references) {
    last = grade_answer(prediction, ref, options);
    if (last.correct) return last;
  }
  return last;
}

}  // namespace lorasync::reward
