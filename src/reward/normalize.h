// reward/normalize.h: the canonical string form of an answer (grader spec, "Canonical string form").
//
// Applied to both sides, in this order:
//   1. math delimiters ($, $$, \(, \[) and "\$" removed; Unicode − × ÷ π ∞ ≤ ≥ ≠ ° mapped to LaTeX.
//   2. thousands separators inside numbers: "1{,}234", "1,\!234", "1\,234" -> "1234"; a whole answer
//      of the form "1,234,567(.89)" or "1 234 567" also loses its separators. A comma between
//      digits that is not a thousands group ("1,2", "(1,234)" inside a tuple of two) is kept, so
//      tuples and lists survive.
//   3. \left, \right, \big.., \displaystyle removed; spacing commands \, \! \; \: \  ~ \quad
//      become spaces.
//   4. \dfrac \tfrac \cfrac -> \frac; \dbinom \tbinom -> \binom.
//   5. degree marks ^\circ ^{\circ} \circ \degree removed.
//   6. percentages: a trailing \% or % or the word "percent" is removed and noted (`percent`).
//   7. a trailing \text{..}/\mbox{..}/\mathrm{..} after a value is a unit and is removed.
//   8. \text{X} \textbf{X} \textrm{X} \mathrm{X} \mathbf{X} \mbox{X} \mathit{X} \operatorname{X} -> X;
//      text content makes the answer case-insensitive (`text`).
//   9. the words "and"/"or" between answers -> "," (also glued between brackets: "(1,2)or(2,1)");
//      trailing unit words ("cm", "square units", "degrees", "dollars", ...) after a value removed.
//  10. \neq \leq \geq \leqslant \geqslant -> \ne \le \ge; \lt \gt -> < >; a trailing "\approx v"
//      dropped (answer_forms.h).
//  11. shorthand repaired: \frac12 -> \frac{1}{2}, \frac1b, \frac{a}b, \sqrt3 -> \sqrt{3},
//      sqrt(x) -> \sqrt{x}, ^(x) -> ^{x}.
//  12. bmatrix, vmatrix, Bmatrix, smallmatrix, array (column spec dropped) -> pmatrix.
//  13. whitespace collapsed; a trailing "." removed.
//  14. number literals: ".5" -> "0.5", "5.000" -> "5", "2.50" -> "2.5".
//  15. assignment groups "p=5,q=2;p=7,q=2" -> "(5,2),(7,2)"; "x = v" with a short left side (a
//      symbol, x_1, f(x), at most 6 characters) -> "v", when `strip_short_lhs` (the caller passes
//      false when the reference is itself an equation; then a chain "x = a = v" -> "x = v").
// The canonical string is the result without any whitespace, with "^{2}" -> "^2" and "_{12}" ->
// "_12" for one-token scripts. Two answers whose canonical strings are equal (case-insensitively
// when either is text) are correct.
// Work is linear-ish in the answer (each rule is one or a few passes); callers cap the length.
// Thread-safety: pure functions, thread-safe.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace lorasync::reward {

struct NormalizedAnswer {
  std::string clean;      // normalised, single spaces kept: the parser's input
  std::string canonical;  // clean without whitespace: the string-equality key
  bool percent = false;   // a trailing percent sign or word was removed
  bool text = false;      // the answer holds text: compare case-insensitively
  bool equation = false;  // a top-level "=" was present (before any left side was stripped)
};

NormalizedAnswer normalize_answer(std::string_view answer, bool strip_short_lhs);

// Equal canonical strings (case-insensitive when either side is text).
bool canonical_equal(const NormalizedAnswer& a, const NormalizedAnswer& b);

// Offsets of the '=' signs outside brackets and braces.
std::vector<std::size_t> top_level_equal_signs(std::string_view s);

// Index of the brace matching s[open] ('{'), or npos. Escaped braces (\{ \}) are skipped.
std::size_t matching_brace(std::string_view s, std::size_t open);

}  // namespace lorasync::reward
