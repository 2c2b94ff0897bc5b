// reward/expr.h: evaluation of expression trees (parser.h), exact and numeric.
//
//   eval_exact    the value as an exact rational when every step stays rational: numbers, + - * /,
//                 integer powers, roots of perfect powers (\sqrt{9/4} = 3/2), factorials up to 33!,
//                 binomials, |x|, floor, ceil. Constants (pi, e, i), symbols, non-perfect roots and
//                 overflow of the 128-bit rationals give nullopt (the caller goes numeric).
//   eval_numeric  the value as a complex double with symbols bound to given values; principal
//                 branches (sqrt, log, non-integer powers); \log is base 10, \ln base e, \log_b base
//                 b; infinities propagate; an undefined value is NaN.
// Both charge a Budget, one step per node visited plus the iterations of loops (powers,
// factorials, binomials); once the budget is spent they return "no value" and set `exhausted`.
// Thread-safety: pure functions; the Budget is per call and not shared.
#pragma once

#include <complex>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "reward/parser.h"
#include "reward/rational.h"

namespace lorasync::reward {

struct Budget {
  std::int64_t steps_left = 0;
  bool exhausted = false;
  // Spends n steps; false (and exhausted) when the budget runs out.
  bool spend(std::int64_t n = 1) {
    if (steps_left < n) {
      steps_left = 0;
      exhausted = true;
      return false;
    }
    steps_left -= n;
    return true;
  }
};

using Complex = std::complex<double>;
using Bindings = std::vector<std::pair<std::string, double>>;

std::optional<Rational> eval_exact(const Expr& e, int node, Budget& budget);
Complex eval_numeric(const Expr& e, int node, const Bindings& bindings, Budget& budget);

// True when the subtree is a plain scalar expression (no tuple, set, matrix, relation, list,
// union, base-n literal or ±).
bool is_scalar(const Expr& e, int node);

// Adds the subtree's free symbol names to `out` (deduplicated).
void collect_symbols(const Expr& e, int node, std::vector<std::string>& out);

}  // namespace lorasync::reward
