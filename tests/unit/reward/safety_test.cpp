// Bounded work, pathological inputs, determinism and thread safety of the verifier.
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "reward/grade.h"

namespace lorasync::reward {
namespace {

double seconds_of(const std::function<void()>& f) {
  auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Generous wall-clock bound (shared, noisy machines); the real guarantee is the step cap.
constexpr double kQuick = 2.0;

TEST(RewardSafety, HugeExponentIsTooComplex) {
  GradeResult r;
  double s = seconds_of([&] { r = grade("\\boxed{10^{10^{10}}}", "7"); });
  EXPECT_FALSE(r.correct);
  EXPECT_EQ(r.reason, "too_complex");
  EXPECT_LT(s, kQuick);
  // The same text on both sides is still recognised by its string.
  EXPECT_TRUE(grade("\\boxed{10^{10^{10}}}", "10^{10^{10}}").correct);
}

TEST(RewardSafety, TenThousandNestedBraces) {
  std::string deep = "\\boxed{" + std::string(10000, '{') + "1" + std::string(10000, '}') + "}";
  GradeResult r;
  double s = seconds_of([&] { r = grade(deep, "1"); });
  EXPECT_FALSE(r.correct);
  EXPECT_EQ(r.reason, "too_complex");
  EXPECT_LT(s, kQuick);
  // Nesting below the answer cap but above the depth cap.
  std::string mid = "\\boxed{" + std::string(500, '(') + "1" + std::string(500, ')') + "}";
  r = grade(mid, "2");
  EXPECT_FALSE(r.correct);
  EXPECT_EQ(r.reason, "too_complex");
}

TEST(RewardSafety, FiveMegabytesOfText) {
  std::string big;
  while (big.size() < 5u * 1024 * 1024) big += "so we have 1+1=2 and \\frac{1}{2} ";
  big += "\\boxed{2}";
  GradeResult r;
  double s = seconds_of([&] { r = grade(big, "2"); });
  EXPECT_FALSE(r.correct);
  EXPECT_EQ(r.reason, "too_complex");
  EXPECT_LT(s, kQuick);
  // Under the cap, a long completion is fine.
  std::string ok(200000, 'a');
  ok += " \\boxed{2}";
  EXPECT_TRUE(grade(ok, "2").correct);
}

TEST(RewardSafety, LongAnswersAndManySymbols) {
  std::string sum;
  for (int k = 0; k < 3000; ++k) sum += "1+";
  sum += "1";
  GradeResult r = grade("\\boxed{" + sum + "}", "3001");
  EXPECT_FALSE(r.correct);
  EXPECT_EQ(r.reason, "too_complex");
  EXPECT_EQ(grade("\\boxed{a+b+c+d+f+g+h+j}", "a+b+c+d+f+g+h+k").reason, "too_complex");
  std::string fact = "\\boxed{((((((((((3!)!)!)!)!)!)!)!)!)!)}";
  double s = seconds_of([&] { r = grade(fact, "5"); });
  EXPECT_FALSE(r.correct);
  EXPECT_LT(s, kQuick);
}

TEST(RewardSafety, StepCapIsHonoured) {
  GradeOptions tight;
  tight.limits.max_steps = 10;
  GradeResult r = grade("\\boxed{(x+1)^2}", "x^2+2x+1", tight);
  EXPECT_FALSE(r.correct);
  EXPECT_EQ(r.reason, "too_complex");
  EXPECT_TRUE(grade("\\boxed{(x+1)^2}", "x^2+2x+1").correct);
}

TEST(RewardSafety, DeterministicVerdicts) {
  for (int k = 0; k < 5; ++k) {
    GradeResult a = grade("\\boxed{\\frac{x^2-1}{x-1}}", "x+1");
    EXPECT_TRUE(a.correct);
    EXPECT_EQ(a.reason, "symbolic_equal");
  }
}

TEST(RewardSafety, ThreadsSeeIdenticalVerdicts) {
  const std::vector<std::pair<std::string, std::string>> inputs = {
      {"\\boxed{\\frac{1}{2}}", "0.5"},          {"\\boxed{(1,2)}", "(2,1)"},
      {"\\boxed{(x+1)^2}", "x^2+2x+1"},         {"\\boxed{x>2}", "(2,\\infty)"},
      {"\\boxed{10^{10^{10}}}", "3"},           {"\\boxed{\\{3,1,2\\}}", "\\{1,2,3\\}"},
      {"no box", "1"},                          {"\\boxed{\\sin^2 x+\\cos^2 x}", "1"},
      {"\\boxed{28\\%}", "0.28"},               {"\\boxed{y=2x+3}", "2x+3=y"},
      {"\\boxed{\\sqrt{2}}", "2"},              {"\\boxed{1103_6}", "1103_6"},
  };
  std::vector<GradeResult> expected;
  for (const auto& [c, a] : inputs) expected.push_back(grade(c, a));
  constexpr int kThreads = 8;
  std::vector<std::vector<GradeResult>> got(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 50; ++round)
        for (std::size_t k = 0; k < inputs.size(); ++k) {
          std::size_t i = (k + static_cast<std::size_t>(t)) % inputs.size();
          GradeResult r = grade(inputs[i].first, inputs[i].second);
          if (round == 49) got[static_cast<std::size_t>(t)].push_back(r);
          if (r.correct != expected[i].correct || r.reason != expected[i].reason ||
              r.extracted != expected[i].extracted)
            got[static_cast<std::size_t>(t)].push_back(GradeResult{!r.correct, "MISMATCH", "MISMATCH"});
        }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) {
    ASSERT_EQ(got[static_cast<std::size_t>(t)].size(), inputs.size()) << "thread " << t << " saw a different verdict";
    for (const GradeResult& r : got[static_cast<std::size_t>(t)]) EXPECT_NE(r.reason, "MISMATCH");
  }
}

}  // namespace
}  // namespace lorasync::reward
