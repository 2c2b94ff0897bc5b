// Slow: the real Qwen2.5-Math-1.5B shape (random weights, bf16 on disk, sharded) is written,
// loaded in fp32 and runs a forward on a 24 GiB CPU machine.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>

#include "util/files.h"
#include "util/run_command.h"

namespace lorasync {
namespace {

TEST(Model1p5B, Bf16ShardedLoadsAndRuns) {
  TempDir d("lorasync-1p5b");
  auto dir = testing::shell_quote((d.path() / "m").string());
  auto r = testing::run_lorasync("init-model --preset qwen2.5-1.5b-shape --output " + dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto info = nlohmann::json::parse(r.out);
  EXPECT_EQ(info["dtype"], "bfloat16");
  EXPECT_GE(info["files"].get<int>(), 2);
  EXPECT_NEAR(info["params"].get<double>(), 1.5437e9, 0.001e9);
  EXPECT_TRUE(fs::exists(d.path() / "m" / "model.safetensors.index.json"));
  r = testing::run_lorasync("logprobs --model " + dir + " --dtype float32 --prompt-ids 151644,8948,198,1,2,3 --completion-ids 4,5,6");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto lp = nlohmann::json::parse(r.out)["logprobs"];
  ASSERT_EQ(lp.size(), 3u);
  for (const auto& v : lp) {
    EXPECT_TRUE(std::isfinite(v.get<double>()));
    EXPECT_LT(v.get<double>(), 0.0);
  }
}

}  // namespace
}  // namespace lorasync
