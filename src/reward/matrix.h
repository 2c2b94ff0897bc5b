// reward/matrix.h: matrix arithmetic written in an answer (issue 51: "The sum is $A + B$" for a
// gold matrix). A sum, difference, negation or product of pmatrix literals and scalar factors is
// folded into one matrix literal whose elements are the sums and products of the operands'
// elements (so they are compared by the usual scalar rules). Shapes must agree (r x k times k x c);
// anything else is left as written. Bounded: stops (and leaves the tree alone) past `max_nodes`.
// Thread-safety: pure function of its arguments.
#pragma once

#include "reward/parser.h"

namespace lorasync::reward {

// Replaces e.root by the folded matrix when the root is matrix arithmetic; true when it did.
bool fold_matrix_arithmetic(Expr& e, int max_nodes);

}  // namespace lorasync::reward
