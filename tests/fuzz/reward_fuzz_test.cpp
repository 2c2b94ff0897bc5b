// Property/fuzz test of the maths verifier (an untrusted-input parser): random byte strings and
// random LaTeX-like strings, fixed seeds, deterministic. Nothing crashes, every call stays within
// the step cap, and grading is a pure function (same input, same verdict).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "reward/grade.h"

#ifndef LORASYNC_FUZZ_ITERS
#define LORASYNC_FUZZ_ITERS 3000
#endif

namespace lorasync::reward {
namespace {

constexpr double kMaxSecondsPerCall = 0.5;  // generous on a shared machine; typical is ~10 us

std::string random_bytes(std::mt19937_64& rng, std::size_t max_len) {
  std::uniform_int_distribution<std::size_t> len(0, max_len);
  std::uniform_int_distribution<int> byte(0, 255);
  std::string s(len(rng), '\0');
  for (char& c : s) c = static_cast<char>(byte(rng));
  return s;
}

std::string random_latex(std::mt19937_64& rng, int depth = 0) {
  static const std::vector<std::string> kAtoms = {
      "1", "2", "12", "0.5", ".5", "x", "y", "e", "i", "\\pi", "\\infty", "n", "1,234", "3\\%",
      "\\theta", "1103_6", "\\text{cm}", "\\emptyset", "k"};
  static const std::vector<std::string> kOps = {"+", "-", "\\cdot", "\\times", "/", "^", "=", "<",
                                                "\\le", ",", "\\cup", "\\pm", " ", "!", "_", "&",
                                                "\\\\", "\\div", "\\ne", " and "};
  static const std::vector<std::string> kWrap = {
      "\\frac{#}{#}", "\\sqrt{#}", "\\sqrt[3]{#}", "(#)", "[#)", "\\{#\\}", "\\left(#\\right)",
      "\\binom{#}{#}", "\\sin #", "\\log_{#}{#}", "|#|", "\\lfloor #\\rfloor", "{#}", "#^{#}",
      "\\begin{pmatrix}# & #\\\\# & #\\end{pmatrix}", "\\boxed{#}", "\\text{#}", "\\frac#",
      "\\sqrt", "(#, #]", "#!", "\\dfrac{#}{#}", "10^{#}"};
  std::uniform_int_distribution<int> pick(0, 9);
  if (depth > 6 || pick(rng) < 3) return kAtoms[rng() % kAtoms.size()];
  if (pick(rng) < 5) {
    return random_latex(rng, depth + 1) + kOps[rng() % kOps.size()] + random_latex(rng, depth + 1);
  }
  std::string w = kWrap[rng() % kWrap.size()];
  std::string out;
  for (char c : w) {
    if (c == '#') out += random_latex(rng, depth + 1);
    else out += c;
  }
  // Occasionally break the brackets.
  if (pick(rng) == 0 && !out.empty()) out.erase(rng() % out.size(), 1);
  return out;
}

void check_call(const std::string& completion, const std::string& reference) {
  auto t0 = std::chrono::steady_clock::now();
  GradeResult r = grade(completion, reference);
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  Limits limits;
  ASSERT_LE(r.steps, limits.max_steps);
  ASSERT_GE(r.steps, 0);
  ASSERT_LT(s, kMaxSecondsPerCall) << "slow input: " << completion << " vs " << reference;
  ASSERT_FALSE(r.reason.empty());
  GradeResult again = grade(completion, reference);
  ASSERT_EQ(r.correct, again.correct);
  ASSERT_EQ(r.reason, again.reason);
}

TEST(RewardFuzz, RandomBytes) {
  std::mt19937_64 rng(20240601);
  for (int k = 0; k < LORASYNC_FUZZ_ITERS; ++k) {
    std::string a = random_bytes(rng, 200);
    std::string b = random_bytes(rng, 40);
    check_call(a, b);
    check_call("\\boxed{" + a + "}", b);
    check_call("\\boxed{" + b + "}", a.substr(0, 60));
  }
}

TEST(RewardFuzz, RandomLatex) {
  std::mt19937_64 rng(7);
  int correct = 0;
  for (int k = 0; k < LORASYNC_FUZZ_ITERS; ++k) {
    std::string a = random_latex(rng);
    std::string b = random_latex(rng);
    check_call("\\boxed{" + a + "}", b);
    check_call("\\boxed{" + a + "}", a);
    // An answer always verifies against itself when it extracts intact.
    GradeResult self = grade("\\boxed{" + a + "}", a);
    if (self.correct) ++correct;
  }
  EXPECT_GT(correct, LORASYNC_FUZZ_ITERS / 2);
}

TEST(RewardFuzz, MutatedRealAnswers) {
  const std::vector<std::string> seeds = {
      "\\frac{1+\\sqrt{13}}{2}", "(-\\infty, 2) \\cup (3, \\infty)",
      "\\begin{pmatrix} -11/15 \\\\ -2/3 \\end{pmatrix}", "y = 10x - 4", "1{,}008{,}016",
      "\\left( 3, \\frac{\\pi}{2} \\right)", "x_{0} \\cos (\\omega t)", "28\\%", "10^{10^{10}}"};
  std::mt19937_64 rng(99);
  const std::string alphabet = "{}()[]\\^_,.=<>+-*/|!&$% 0123456789xyzabc";
  for (int k = 0; k < LORASYNC_FUZZ_ITERS; ++k) {
    std::string s = seeds[rng() % seeds.size()];
    int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits && !s.empty(); ++e) {
      std::size_t at = rng() % s.size();
      switch (rng() % 3) {
        case 0: s.erase(at, 1); break;
        case 1: s.insert(at, 1, alphabet[rng() % alphabet.size()]); break;
        default: s[at] = alphabet[rng() % alphabet.size()]; break;
      }
    }
    check_call("\\boxed{" + s + "}", seeds[rng() % seeds.size()]);
  }
}

}  // namespace
}  // namespace lorasync::reward
