// demo/task.h: the demo's synthetic maths task, generated deterministically from a seed.
//
// Four kinds of problems with exact answers, small enough for a ~0.35M-parameter model to learn
// in a minute or two of CPU SFT:
//   expr      "Compute 13 + 8 × 4."            2-3 operands of +, -, × (× binds tighter)
//   word      "Mia has 12 apples. ..."        one or two operations in a short story
//   equation  "Solve for x: 3x + 5 = 20."     x + b = c, ax = c, ax + b = c
//   fraction  "Compute 2/9 + 5/9." / "What is 2/3 of 27?"
// Every problem comes with worked steps ("23 + 58 = 81. 81 - 17 = 64.") and a final line whose
// style varies: `\boxed{64}` (what the verifier rewards) or one of several unboxed statements
// ("Answer: 64", ...). The style is drawn per problem with probability `p_boxed` for the box and
// the rest split evenly over the unboxed styles, so a model fine-tuned on these solutions boxes
// its answer only part of the time when sampled, yet boxes it greedily (the box is the most
// likely single style): the format failure that RL learns to fix, as real R1-Zero runs do.
//
// Splits: every problem has a signature (its kind and numbers); a seeded hash of the signature
// puts it in the train or the held-out split, so the two splits never share a problem whatever
// the counts. Problems within a split are distinct.
// Determinism: a portable SplitMix64 generator (no std distributions), so the same seed gives
// the same problems on every platform.
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace lorasync::demo {

enum class Split { kTrain, kHeldout };
const char* split_name(Split s);

// How a worked solution states its final answer.
enum class FinalStyle { kBoxed, kAnswerColon, kTheAnswerIs, kSoResult };
constexpr int kNumFinalStyles = 4;

struct TaskOptions {
  double p_boxed = 0.40;  // share of solutions ending in \boxed{}; the rest split evenly
};

struct TaskRow {
  std::string kind;         // "expr", "word", "equation", "fraction"
  std::string problem;      // the question (JSONL "problem")
  std::string answer;       // reference answer (JSONL "answer"): "64", "\frac{5}{7}"
  std::string final_value;  // how the solution writes the result: "64", "7/9"
  std::string steps;        // worked steps, one line, without the final statement
  FinalStyle style = FinalStyle::kBoxed;

  // steps + "\n" + the final statement in `style`.
  std::string solution() const;
  // steps + "\n\boxed{final_value}": the rewarded form (always graded correct).
  std::string boxed_solution() const;
};

// The final statement of `value` in `style` ("\boxed{64}", "Answer: 64", ...).
std::string final_line(FinalStyle style, const std::string& value);

// `count` distinct problems of `split`. InvalidInput when count is not positive or the split
// cannot hold that many distinct problems.
std::vector<TaskRow> make_problems(std::uint64_t seed, std::int64_t count, Split split,
                                   const TaskOptions& options = {});

// {"problem": ..., "answer": ...} per line, the schema of shared/data/*.jsonl.
std::string to_jsonl(const std::vector<TaskRow>& rows);

}  // namespace lorasync::demo
