// reward/grade.h: the maths answer verifier, the function every training reward comes from.
//
//   grade(completion, reference) -> {correct, extracted, reason}
//
// Pipeline (each stage is its own file pair; the rules live in the headers named):
//   1. extract    (extract.h)   the last \boxed{...}/\fbox{...} of the completion, after </think>;
//                               no box -> incorrect, reason "no_box" (unless fallback is enabled).
//   2. normalize  (normalize.h) both sides to a canonical string; equal strings -> "string_equal".
//   3. parse      (parser.h)    both sides into a small expression tree (numbers, symbols, + - * /
//                               ^, functions, tuples, intervals, sets, matrices, relations, lists).
//   4. compare    (compare.h)   structural comparison; scalars by exact rational evaluation, then
//                               numeric evaluation (tolerances documented there), free variables at
//                               fixed pseudo-random points.
//
// Main design choice: no computer algebra. Equality of expressions is decided by evaluation: exact
// rationals where the value is rational (bounded 128-bit integers; overflow falls back to doubles),
// complex doubles otherwise, and, with free variables, agreement at several deterministic random
// points. That is a probabilistic identity test with a fixed seed: same inputs, same verdict.
//
// Bounded work: every call carries a Budget (input bytes, answer bytes, tree nodes, nesting depth,
// evaluation steps). Exceeding any cap ends the call with correct=false, reason "too_complex".
// No signals, no threads, no timeouts.
//
// Thread model: all functions are thread-safe and reentrant; there is no mutable global state (the
// random points come from a per-call generator with a fixed seed).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace lorasync::reward {

// Caps on the work one grade() call may do. Defaults suit completions of up to ~250k tokens.
struct Limits {
  std::size_t max_completion_bytes = 1u << 20;  // longer completions: "too_complex"
  std::size_t max_answer_bytes = 4096;          // extracted/reference answer, before parsing
  int max_depth = 64;                           // nesting of brackets/braces in the parser
  int max_nodes = 4000;                         // expression tree nodes per answer
  std::int64_t max_steps = 400000;              // evaluation steps for the whole call
};

struct GradeOptions {
  // Evaluation-only fallback when the completion has no box: "the answer is ...", the last math
  // span ($...$, \(...\), \[...\]), then the last number. Never used for training rewards.
  bool fallback = false;
  Limits limits;
};

struct GradeResult {
  bool correct = false;
  std::string extracted;  // the predicted answer as extracted (before normalisation)
  // The rule that decided: "string_equal", "numeric_equal", "symbolic_equal" (random points),
  // "structure_equal", "relation_equal", "interval_equal", "set_equal", "percent_equal",
  // "not_equal", "no_box", "empty_answer", "parse_error", "too_complex".
  std::string reason;
  std::int64_t steps = 0;  // evaluation steps spent (never above Limits::max_steps)
};

// Grades a full completion: the answer must be boxed (see extract.h).
GradeResult grade(std::string_view completion, std::string_view reference,
                  const GradeOptions& options = {});
// Any of several acceptable references (Minerva, OlympiadBench rows): correct if one matches; the
// reason is the deciding rule of the first match, or of the last reference when none matches.
GradeResult grade(std::string_view completion, const std::vector<std::string>& references,
                  const GradeOptions& options = {});

// Grades a bare predicted answer (already extracted, as in Math-Verify's (gold, pred) pairs): a
// \boxed{} inside it is still preferred, $...$ delimiters are stripped, and prose falls back to the
// evaluation extraction rules.
GradeResult grade_answer(std::string_view prediction, std::string_view reference,
                         const GradeOptions& options = {});
GradeResult grade_answer(std::string_view prediction, const std::vector<std::string>& references,
                         const GradeOptions& options = {});

// Compares two answers that are already extracted. Exposed for benchmarks and tests.
GradeResult compare_answers(std::string_view predicted, std::string_view reference,
                            const Limits& limits = {});

// The baseline check alone: canonical strings equal (normalize.h). Used by `bench grade`.
bool canonical_string_equal(std::string_view predicted, std::string_view reference);

}  // namespace lorasync::reward
