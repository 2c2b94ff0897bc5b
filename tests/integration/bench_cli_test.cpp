// Black-box smoke tests of `lorasync bench forward` through the real binary: the rows it reports
// and their same-run baselines (the figures themselves are not checked: performance lives in the
// bench, never in a timed test).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <string>

#include "util/jsonl.h"
#include "util/run_command.h"

namespace lorasync {
namespace {

using testing::parse_jsonl;
using testing::run_lorasync;

TEST(BenchCli, ForwardReportsTheMixedAdapterDecodeAgainstTheBaseModel) {
  auto r = run_lorasync(
      "bench forward --presets tiny --threads 2 --prompt-tokens 16 --prefill-batch 2 --decode-batches 3,7 "
      "--context 8 --decode-steps 2 --repeats 1 --paths fast --adapters 2");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  int mixed_decode = 0, mixed_prefill = 0;
  for (const auto& rec : parse_jsonl(r.out)) {
    EXPECT_EQ(rec["bench"], "forward");
    EXPECT_GT(rec["value"].get<double>(), 0) << rec.dump();
    const bool decode = rec["metric"] == "decode_tokens_per_s_adapters";
    if (!decode && rec["metric"] != "prefill_tokens_per_s_adapters") continue;
    (decode ? mixed_decode : mixed_prefill)++;
    EXPECT_EQ(rec["config"]["adapters"], 2);
    EXPECT_EQ(rec["config"]["rank"], 8);
    EXPECT_GT(rec["baseline"].get<double>(), 0);
    EXPECT_GT(rec["ratio"].get<double>(), 0);
    EXPECT_EQ(rec["config"]["pairs"], 5);  // at least 5 pairs, whatever --repeats
    EXPECT_GT(rec["config"]["pair_ratio_median"].get<double>(), 0);
  }
  EXPECT_EQ(mixed_decode, 2);  // one per decode batch
  EXPECT_EQ(mixed_prefill, 1);
  // --adapters 0: no mixed rows.
  auto none = run_lorasync("bench forward --presets tiny --threads 1 --decode-batches 2 --context 4 --decode-steps 1 "
                           "--repeats 1 --paths fast --adapters 0 --prompt-tokens 8 --prefill-batch 1");
  ASSERT_EQ(none.exit_code, 0) << none.err;
  for (const auto& rec : parse_jsonl(none.out)) EXPECT_NE(rec["metric"], "decode_tokens_per_s_adapters");
}

// --paths fast-avx2,fast: our kernels without their AVX-512 tiles are timed first, and the fast
// path's rows carry them as the baseline (whatever the CPU: without AVX-512 both run the same
// kernels); an unknown path is refused by name.
TEST(BenchCli, ForwardTimesTheAvx2KernelsAsTheBaselineOfTheFastPath) {
  auto r = run_lorasync(
      "bench forward --presets tiny --threads 2 --prompt-tokens 16 --prefill-batch 1 --decode-batches 2,13 "
      "--context 8 --decode-steps 2 --repeats 1 --paths fast,fast-avx2 --adapters 0");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  int avx2 = 0, vs = 0;
  for (const auto& rec : parse_jsonl(r.out)) {
    const std::string m = rec["metric"];
    if (m == "prefill_tokens_per_s_avx2" || m == "decode_tokens_per_s_avx2") {
      ++avx2;
      EXPECT_EQ(rec["config"]["path"], "fast-avx2");
      EXPECT_GT(rec["value"].get<double>(), 0);
    }
    if (m == "prefill_tokens_per_s_vs_avx2" || m == "decode_tokens_per_s_vs_avx2") {
      ++vs;
      EXPECT_EQ(rec["config"]["path"], "fast");
      EXPECT_GT(rec["baseline"].get<double>(), 0) << rec.dump();
    }
  }
  EXPECT_EQ(avx2, 3);  // prefill + two decode batches
  EXPECT_EQ(vs, 3);
  auto bad = run_lorasync("bench forward --presets tiny --paths fast,avx1024");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("unknown path 'avx1024'"), std::string::npos) << bad.err;
}

}  // namespace
}  // namespace lorasync
