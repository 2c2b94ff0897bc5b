// The trainer-facing reward interface: math_boxed, truncation, composites, the factory.
#include <gtest/gtest.h>

#include <vector>

#include "reward/extract.h"
#include "reward/normalize.h"
#include "reward/reward_fn.h"
#include "util/error.h"

namespace lorasync::reward {
namespace {

RewardInput input(std::string_view completion, std::vector<std::string> refs,
                  std::string_view finish = "stop") {
  RewardInput in;
  in.prompt = "What is 2+3?";
  in.completion = completion;
  in.finish_reason = finish;
  in.references = std::move(refs);
  return in;
}

TEST(RewardFn, MathBoxedScoresTheVerdict) {
  auto fn = make_reward_function("math_boxed");
  EXPECT_EQ(fn->name(), "math_boxed");
  std::vector<std::int32_t> ids = {1, 2, 3};
  RewardInput in = input("so \\boxed{5}", {"5"});
  in.completion_ids = ids;
  RewardOutput r = fn->score(in);
  EXPECT_EQ(r.reward, 1.0);
  EXPECT_TRUE(r.correct);
  EXPECT_EQ(r.extracted, "5");
  EXPECT_EQ(r.reason, "string_equal");
  EXPECT_EQ(fn->score(input("so \\boxed{6}", {"5"})).reward, 0.0);
  RewardOutput nobox = fn->score(input("so 5", {"5"}));
  EXPECT_EQ(nobox.reward, 0.0);
  EXPECT_EQ(nobox.reason, "no_box");
  EXPECT_EQ(fn->score(input("\\boxed{5}", {"4", "5"})).reward, 1.0);
}

TEST(RewardFn, TruncatedCompletionsGetTheTruncatedReward) {
  auto fn = make_reward_function("math_boxed");
  RewardOutput r = fn->score(input("\\boxed{5}", {"5"}, "length"));
  EXPECT_EQ(r.reward, 0.0);
  EXPECT_TRUE(r.truncated);
  EXPECT_EQ(r.reason, "truncated");
  MathBoxedOptions opt;
  opt.truncated_reward = 0.25;
  MathBoxedReward lenient(opt);
  EXPECT_EQ(lenient.score(input("\\boxed{5}", {"5"}, "length")).reward, 0.25);
}

TEST(RewardFn, CompositeIsAWeightedSumWithComponents) {
  auto comp = make_reward_from_spec("math_boxed:0.8, format_boxed:0.2");
  RewardOutput right = comp->score(input("\\boxed{5}", {"5"}));
  EXPECT_DOUBLE_EQ(right.reward, 1.0);
  ASSERT_EQ(right.components.size(), 2u);
  EXPECT_EQ(right.components[0].name, "math_boxed");
  EXPECT_DOUBLE_EQ(right.components[1].weight, 0.2);
  RewardOutput wrong = comp->score(input("\\boxed{6}", {"5"}));
  EXPECT_DOUBLE_EQ(wrong.reward, 0.2);
  EXPECT_EQ(wrong.components[0].value, 0.0);
  EXPECT_EQ(wrong.components[1].value, 1.0);
  EXPECT_FALSE(wrong.correct);
  RewardOutput none = comp->score(input("6", {"5"}));
  EXPECT_DOUBLE_EQ(none.reward, 0.0);
  // Weights summing above 1 are clamped to [0,1].
  auto heavy = make_reward_from_spec("math_boxed:1,format_boxed:1");
  EXPECT_DOUBLE_EQ(heavy->score(input("\\boxed{5}", {"5"})).reward, 1.0);
  EXPECT_EQ(make_reward_from_spec("math_boxed")->name(), "math_boxed");
}

TEST(RewardFn, FactoryRejectsUnknownNamesAndBadSpecs) {
  try {
    make_reward_function("lengthy_bonus");
    FAIL() << "expected InvalidInput";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput);
    EXPECT_NE(std::string(e.what()).find("lengthy_bonus"), std::string::npos);
  }
  EXPECT_THROW(make_reward_from_spec("math_boxed:abc"), Error);
  EXPECT_THROW(make_reward_from_spec("math_boxed,,format_boxed"), Error);
  EXPECT_THROW(make_reward_from_spec("math_boxed:-1"), Error);
  EXPECT_THROW(CompositeReward({}), Error);
}

TEST(RewardExtract, LastBoxAfterThink) {
  EXPECT_EQ(extract_last_boxed("\\boxed{1} then \\boxed{2}").value(), "2");
  EXPECT_EQ(extract_last_boxed("\\boxed{1}, \\boxed{2}").value(), "1, 2");
  EXPECT_EQ(extract_last_boxed("$\\boxed{1}$ and $\\boxed{2}$").value(), "1, 2");
  EXPECT_EQ(extract_last_boxed("\\boxed{\\frac{1}{2}}").value(), "\\frac{1}{2}");
  EXPECT_EQ(extract_last_boxed("\\boxed {3}").value(), "3");
  EXPECT_EQ(extract_last_boxed("\\boxed 5 apples").value(), "5");
  EXPECT_EQ(extract_last_boxed("\\fbox{x}").value(), "x");
  EXPECT_EQ(extract_last_boxed("\\boxed{\\{1\\}}").value(), "\\{1\\}");
  EXPECT_FALSE(extract_last_boxed("\\boxed{1").has_value());
  EXPECT_FALSE(extract_last_boxed("no box").has_value());
  EXPECT_EQ(after_think("a</think>b</think>c"), "c");
  EXPECT_EQ(after_think("abc"), "abc");
  EXPECT_EQ(strip_math_delimiters(" $$x$$ "), "x");
  EXPECT_EQ(strip_math_delimiters("\\(x\\)"), "x");
  EXPECT_EQ(extract_fallback("The answer is $\\frac{1}{2}$. Done").value(), "\\frac{1}{2}");
  EXPECT_EQ(extract_fallback("we get 3 and then 4.5").value(), "4.5");
}

TEST(RewardNormalize, CanonicalForms) {
  auto canon = [](std::string_view s) { return normalize_answer(s, true).canonical; };
  EXPECT_EQ(canon("\\left( \\dfrac{1}{2}, 3 \\right)"), "(\\frac{1}{2},3)");
  EXPECT_EQ(canon("1,234"), "1234");
  EXPECT_EQ(canon("(1,234)"), "(1,234)");
  EXPECT_EQ(canon("1,2"), "1,2");
  EXPECT_EQ(canon("\\frac12"), "\\frac{1}{2}");
  EXPECT_EQ(canon("\\sqrt3"), "\\sqrt{3}");
  EXPECT_EQ(canon("x = 5"), "5");
  EXPECT_EQ(canon(".5"), "0.5");
  EXPECT_EQ(canon("5.000"), "5");
  EXPECT_EQ(canon("30^\\circ"), "30");
  EXPECT_EQ(canon("5 \\text{ cm}"), "5");
  EXPECT_EQ(canon("\\text{(D)}"), "(D)");
  EXPECT_EQ(canon("3 \\text{ and } 4"), "3,4");
  EXPECT_EQ(canon("x \\leq 3"), "x\\le3");
  EXPECT_EQ(canon("\\begin{bmatrix}1\\\\2\\end{bmatrix}"), "\\begin{pmatrix}1\\\\2\\end{pmatrix}");
  EXPECT_TRUE(normalize_answer("28\\%", true).percent);
  EXPECT_FALSE(normalize_answer("28", true).percent);
  EXPECT_EQ(normalize_answer("x = 5", false).canonical, "x=5");
  EXPECT_TRUE(normalize_answer("x = 5", false).equation);
}

}  // namespace
}  // namespace lorasync::reward
