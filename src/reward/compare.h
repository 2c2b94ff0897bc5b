// reward/compare.h: mathematical equality of two parsed answers (grader spec, "Mathematical
// equality"). The gold answer's shape leads.
//
// Scalars:
//   - no free symbols: exact rationals when both sides evaluate exactly (equal iff equal; so a gold
//     integer never matches a non-integer prediction, "12" != "1.2", 1/2 != 1/3); otherwise
//     complex doubles agreeing to a relative 1e-9 (absolute 1e-12 near zero). When either side
//     holds a decimal literal (an approximation: "0.333333" for 1/3) the tolerance is a relative
//     1e-6, or equal when rounded to 6 decimals (Math-Verify's rule) for values above 1e-4;
//     a gold integer still rejects an exact non-integer prediction.
//   - free symbols (at most 6 in all): both sides evaluated at 6 points drawn from a splitmix64
//     generator with a fixed seed (4 points in [0.3, 2.7], 2 in [-2.7, 2.7]); equal when every
//     point agrees to a relative 1e-8 and at least 3 points were defined on both sides.
//   - percentages: the caller passes scales (a prediction "28%" against "0.28" is compared at 1/100).
// Structures:
//   - tuples/points element-wise in order, same bracket kinds ("[0,1)" != "[0,1]"); "(a,b)" also
//     acts as an open interval;
//   - intervals by bracket kinds and endpoints (closedness at an infinite end ignored); unions
//     (\cup) order-free;
//   - sets \{..\} order-free, same size; top-level comma lists order-free when both sides have
//     several elements; a list against a set order-free; a list against a tuple in order;
//   - matrices by shape then element-wise;
//   - a±b equals the list/set {a+b, a-b};
//   - base-n literals ("1103_6") only by their text.
// Relations:
//   - a prediction equation against a non-relation gold: its last right side is compared
//     ("x = 5" vs "5"); a gold assignment (a lone symbol on the left) against a non-relation
//     prediction: the gold's right side;
//   - equations: lhs - rhs equal up to a factor +-1 ("y = 2x+3" vs "2x+3 = y");
//   - inequalities: > and >= flipped to < and <=, then lhs - rhs equal; chains operand-wise;
//   - an inequality in one variable (or an "or"-list of them) against an interval/union: the
//     inequality becomes the interval(s) it defines ("x > 2" = "(2, \infty)").
// Work: every evaluation charges the Budget; when it runs out the result is too_complex.
// Thread-safety: pure functions.
#pragma once

#include <string>

#include "reward/expr.h"
#include "reward/parser.h"
#include "reward/rational.h"

namespace lorasync::reward {

struct CompareOptions {
  Rational pred_scale{1};  // the prediction's scalar values are multiplied by this (percentages)
};

struct CompareOutcome {
  bool equal = false;
  bool too_complex = false;  // the budget ran out or a value overflowed
  std::string reason;        // the deciding rule (grade.h lists the names)
};

CompareOutcome compare_exprs(const Expr& gold, const Expr& pred, const CompareOptions& options,
                             Budget& budget);

}  // namespace lorasync::reward
