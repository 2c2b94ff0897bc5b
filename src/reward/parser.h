// reward/parser.h: LaTeX answers -> a small expression tree.
//
// Input: the `clean` string of normalize.h. Grammar, from loosest to tightest binding:
//   list      := union (',' union)*                        top-level comma list  -> kList
//   union     := relation (('\cup'|'\cap') relation)*     -> kUnion (\cap is kept as not-equal)
//   relation  := sum (relop sum)*                          = < > \le \ge \ne \approx -> kRelation
//   sum       := ['-'|'+'] term (('+'|'-'|'\pm'|'\mp') term)*
//   term      := power (('*'|'\cdot'|'\times'|'/'|'\div') power | power)*   (juxtaposition = *)
//   power     := postfix ('^' script)?                     right-associative
//   postfix   := primary ('!' | '\'' | '_' script)*        factorial, prime, subscript/base-n
//   primary   := number | letter | word | \greek | \pi | \infty | \frac{a}{b} | \sqrt[n]{x}
//              | \binom{n}{k} | \sin x, \log_b x, ... | (..) [..] tuples/intervals | \{..\} set
//              | {..} group | |x| | \lfloor x \rfloor | \lceil x \rceil | \begin{pmatrix}..
// Brackets: "(a)" is a group; "(a,b,..)" a tuple; "[a,b]", "[a,b)", "(a,b]" intervals (kTuple
// with the bracket characters kept); "(a,b)" stays a tuple marked open-open and compares as a
// tuple or an open interval. "1103_6" (digits with a numeric subscript) is a base-n literal.
// Letters: single letters are symbols, except e (Euler's number) and i (imaginary unit); runs of
// four or more letters that are not function names are one word symbol ("wednesday").
// Bounds: nesting depth and node count are capped (Limits); exceeding them fails the parse with
// `too_complex` set. The parser never recurses deeper than max_depth frames.
// Thread-safety: pure functions, thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace lorasync::reward {

enum class NodeKind : std::uint8_t {
  kNumber,     // text: decimal literal "12", "0.5"
  kSymbol,     // text: variable name ("x", "x_1", "\theta", "wednesday")
  kConst,      // text: "pi", "e", "i", "inf"
  kAdd,        // children: terms
  kMul,        // children: factors
  kDiv,        // children: [numerator, denominator]
  kPow,        // children: [base, exponent]
  kNeg,        // children: [x]
  kFunc,       // text: name; children: args (log: [x, base]; root: [x, index]; binom: [n, k])
  kFactorial,  // children: [x]
  kTuple,      // children: elements; open/close: bracket characters
  kSet,        // children: elements of \{..\}
  kMatrix,     // rows x cols; children: row-major elements
  kRelation,   // children: operands; ops: relation names ("=", "<", "le", ...) between them
  kList,       // children: top-level comma-separated answers
  kUnion,      // children: sets/intervals joined by \cup
  kBaseLit,    // text: "1103_6", compared as a string
  kEmptySet,   // \emptyset, \varnothing, \{\}
  kPlusMinus,  // children: [a, b] meaning a ± b (or [b] for ±b)
};

struct Node {
  NodeKind kind = NodeKind::kNumber;
  std::string text;
  std::vector<int> children;
  std::vector<std::string> ops;  // kRelation only
  char open = 0, close = 0;      // kTuple only
  int rows = 0, cols = 0;        // kMatrix only
};

// An answer's tree; nodes live in one arena, children are indices into it.
struct Expr {
  std::vector<Node> nodes;
  int root = -1;
  bool has_decimal = false;  // a decimal literal with a fractional part appears
  const Node& at(int i) const { return nodes[static_cast<std::size_t>(i)]; }
};

struct ParseResult {
  bool ok = false;
  bool too_complex = false;  // a cap was hit (depth, nodes)
  std::string error;         // why the parse failed, for the verdict's details
  Expr expr;
};

ParseResult parse_answer(std::string_view clean, int max_depth, int max_nodes);

// Debug form of a tree ("(+ 1 (* 2 x))"), for tests and error messages.
std::string to_debug_string(const Expr& e, int node);

}  // namespace lorasync::reward
