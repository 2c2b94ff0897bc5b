// tests/unit/demo/demo_quality_test.cpp: the demo's quality bar (demo/quality.h) passes a run that
// learned and names, with its numbers, each criterion a run that did not learn misses.
#include <gtest/gtest.h>

#include <cmath>

#include "demo/quality.h"

namespace lorasync::demo {
namespace {

DemoOutcome learned() {
  DemoOutcome o;
  o.accuracy_base = 0.33;
  o.accuracy_trained = 0.79;
  o.reward_first10 = 0.30;
  o.reward_last10 = 0.72;
  o.steps = 160;
  o.adapter_loads_replica0 = o.adapter_loads_replica1 = 81;
  return o;
}

TEST(DemoQuality, ARunThatLearnedMeetsTheBar) { EXPECT_TRUE(quality_failures(learned(), QualityBar{}).empty()); }

TEST(DemoQuality, TheBaseModelAsTheTrainedAdapterFails) {
  // An untrained adapter grades like the base model: no accuracy gain, no reward gain.
  DemoOutcome o = learned();
  o.accuracy_trained = o.accuracy_base;
  o.reward_last10 = o.reward_first10;
  const auto f = quality_failures(o, QualityBar{});
  ASSERT_EQ(f.size(), 2u);
  EXPECT_NE(f[0].find("held-out accuracy rose by +0.000 (0.330 -> 0.330), below the bar of +0.250"), std::string::npos) << f[0];
  EXPECT_NE(f[1].find("rose by +0.000 (0.300 -> 0.300)"), std::string::npos) << f[1];
}

TEST(DemoQuality, EachCriterionIsCheckedAtItsEdge) {
  const QualityBar bar;
  DemoOutcome o = learned();
  o.accuracy_trained = o.accuracy_base + 0.25;  // exactly the bar
  o.reward_last10 = o.reward_first10 + 0.2;
  EXPECT_TRUE(quality_failures(o, bar).empty());
  o.accuracy_trained -= 0.01;
  EXPECT_EQ(quality_failures(o, bar).size(), 1u);
  o = learned();
  o.reward_last10 = o.reward_first10 + 0.19;
  EXPECT_EQ(quality_failures(o, bar).size(), 1u);
  o = learned();
  o.failed_requests = 2;
  ASSERT_EQ(quality_failures(o, bar).size(), 1u);
  EXPECT_EQ(quality_failures(o, bar)[0], "2 rollout requests failed");
  o = learned();
  o.adapter_loads_replica1 = 80;
  EXPECT_EQ(quality_failures(o, bar).size(), 1u);
}

TEST(DemoQuality, AMissingFigureOrTooFewStepsFails) {
  DemoOutcome o = learned();
  o.accuracy_trained = std::nan("");
  EXPECT_EQ(quality_failures(o, QualityBar{}).size(), 1u);
  o = learned();
  o.steps = 12;  // first and last 10 steps overlap: the reward criterion cannot be met
  const auto f = quality_failures(o, QualityBar{});
  ASSERT_EQ(f.size(), 1u);
  EXPECT_NE(f[0].find("at least 20"), std::string::npos);
}

TEST(DemoQuality, ALowerBarIsHonoured) {
  DemoOutcome o = learned();
  o.accuracy_trained = o.accuracy_base + 0.1;
  EXPECT_EQ(quality_failures(o, QualityBar{}).size(), 1u);
  EXPECT_TRUE(quality_failures(o, QualityBar{0.05, 0.2}).empty());
}

}  // namespace
}  // namespace lorasync::demo
