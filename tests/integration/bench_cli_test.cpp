// Black-box smoke tests of `lorasync bench forward`, `bench proxy` and `bench grade` through the real
// binary: the rows they report and their same-run baselines (the speeds themselves are not checked:
// performance lives in the bench, never in a timed test).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "util/files.h"
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

// A stand-in for the HF Python proxy that `bench proxy --reference` runs (the real one is never
// committed): the same environment (UPSTREAM_URLS, PROXY_PORT) and /proxy/stats counters, but it
// sends requests round robin, with no prefix affinity at all. Its router classes (Config, Upstream,
// PrefixRouter with a `blocks` table filled by choose()) are what bench/proxy/reference_block_bytes.py
// loads to measure the reference's bytes per tracked block; here a dict of chained block hashes.
constexpr const char* kRoundRobinProxy = R"PY(
import itertools, os
from aiohttp import ClientSession, web


class Config:
    def __init__(self, env=os.environ):
        self.upstreams = [u for u in env["UPSTREAM_URLS"].split(",") if u]
        self.block_size = 16


class Upstream:
    def __init__(self, index, url):
        self.index, self.url = index, url


class PrefixRouter:
    def __init__(self, cfg, n):
        self.cfg, self.n, self.blocks, self.turn = cfg, n, {}, itertools.count()

    def choose(self, upstreams, model, prompt):
        pick, prev = next(self.turn) % self.n, hash(model)
        for i in range(0, len(prompt) - self.cfg.block_size + 1, self.cfg.block_size):
            prev = hash((prev, tuple(prompt[i:i + self.cfg.block_size])))
            self.blocks.setdefault(prev, []).append(pick)
        return upstreams[pick]


ups = [u for u in os.environ.get("UPSTREAM_URLS", "").split(",") if u]
turn = itertools.count()
stats = {"routed": 0, "affinity": 0, "spilled": 0, "unmatched": 0}

async def handle(request):
    if request.path == "/proxy/stats":
        return web.json_response({"router": stats})
    body = await request.read()
    if request.path == "/v1/completions":
        stats["routed"] += 1
        stats["unmatched"] += 1
    pick = next(turn) % len(ups)
    url = ups[pick] + request.path_qs
    async with request.app["session"].request(request.method, url, data=body or None,
                                               headers={"Content-Type": "application/json"}) as r:
        return web.Response(status=r.status, body=await r.read(), content_type="application/json",
                            headers={"X-Proxy-Upstream": str(pick)})

async def session(app):
    app["session"] = ClientSession()
    yield
    await app["session"].close()

app = web.Application()
app.router.add_route("*", "/{tail:.*}", handle)
app.cleanup_ctx.append(session)
if __name__ == "__main__":  # loaded as a module (the table's measurement): the classes only
    web.run_app(app, host="127.0.0.1", port=int(os.environ["PROXY_PORT"]), print=None)
)PY";

// --reference: the rows against the reference, among them the CPU split into user and system time
// and the stubs' prefill reuse. At 4 concurrent (never more than the imbalance bound of 8 in
// flight) our proxy keeps every prompt's rollouts on one replica, so the stubs find more of the
// prompt tokens cached than behind a round robin, which prefills most prompts on both. The order
// of the two proxies swaps every round; the direct baseline runs every round too; the reference's
// bytes per tracked block are measured on its own table in the same run.
TEST(BenchCli, ProxyAgainstAReferenceSplitsItsCpuAndComparesTheStubsPrefillReuse) {
  TempDir tmp("bench-proxy-ref");
  const auto script = tmp.path() / "round_robin_proxy.py";
  { std::ofstream(script) << kRoundRobinProxy; }
  auto r = run_lorasync("bench proxy --concurrency 4 --prompts 12 --rounds 2 --tracked-blocks 20000 --reference " +
                        testing::shell_quote(script.string()) + " --python " + testing::shell_quote(LORASYNC_PYTHON));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  int reuse = 0, block_bytes = 0, vs_direct = 0;
  nlohmann::json total, user, sys;  // the CPU rows' configs
  for (const auto& rec : parse_jsonl(r.out)) {
    const std::string m = rec["metric"];
    const auto& c = rec["config"];
    if (m == "bytes_per_tracked_block") {
      ++block_bytes;
      EXPECT_EQ(c["entries"], 20000) << rec.dump();
      EXPECT_EQ(c["reference_entries"], 20000) << rec.dump();
      EXPECT_GT(rec["baseline"].get<double>(), 0) << rec.dump();
      EXPECT_GT(rec["ratio"].get<double>(), 0) << rec.dump();
    }
    if (m == "cpu_ms_per_request_vs_reference") {
      EXPECT_EQ(c["first_per_round"], nlohmann::json({"ours", "reference"})) << rec.dump();
    }
    if (m == "requests_per_s") {
      ++vs_direct;
      ASSERT_EQ(c["direct_per_round"].size(), 2u) << rec.dump();
      ASSERT_EQ(c["ours_per_round"].size(), 2u) << rec.dump();
      EXPECT_GT(rec["baseline"].get<double>(), 0) << rec.dump();
    }
    if (m == "cpu_ms_per_request_vs_reference") total = c;
    if (m == "cpu_user_ms_per_request_vs_reference") user = c;
    if (m == "cpu_sys_ms_per_request_vs_reference") sys = c;
    if (m == "stub_prefill_reuse_vs_reference") {
      ++reuse;
      EXPECT_EQ(c["errors"], 0);
      const auto& ours = c["ours_per_round"];
      const auto& ref = c["reference_per_round"];
      ASSERT_EQ(ours.size(), 2u);
      ASSERT_EQ(ref.size(), 2u);
      for (int i = 0; i < 2; ++i) {
        EXPECT_GT(ours[i].get<double>(), ref[i].get<double>()) << rec.dump();
        EXPECT_LE(ours[i].get<double>(), 1.0);
        EXPECT_GE(ref[i].get<double>(), 0.0);
        EXPECT_NEAR(c["pts_over_reference_per_round"][i].get<double>(),
                    (ours[i].get<double>() - ref[i].get<double>()) * 100, 1e-9);
      }
    }
  }
  EXPECT_EQ(reuse, 1);
  EXPECT_EQ(block_bytes, 1);
  EXPECT_EQ(vs_direct, 1);
  // Per round and per proxy, user + system = the total (the tick ratio only splits it).
  ASSERT_FALSE(total.is_null());
  ASSERT_FALSE(user.is_null());
  ASSERT_FALSE(sys.is_null());
  for (const char* who : {"ours_per_round", "reference_per_round"}) {
    ASSERT_EQ(total[who].size(), 2u) << total.dump();
    ASSERT_EQ(user[who].size(), 2u) << user.dump();
    ASSERT_EQ(sys[who].size(), 2u) << sys.dump();
    for (int i = 0; i < 2; ++i) {
      EXPECT_GT(total[who][i].get<double>(), 0) << who;
      EXPECT_GE(user[who][i].get<double>(), 0) << who;
      EXPECT_GE(sys[who][i].get<double>(), 0) << who;
      EXPECT_NEAR(user[who][i].get<double>() + sys[who][i].get<double>(), total[who][i].get<double>(), 1e-9) << who;
    }
  }
}

// LORASYNC_BENCH_PROXY_PICKS: one file per run through a proxy (ours, then the reference, in the
// first round; the second round would run the reference first), a line
// per request with the order it was sent and answered in and the replica picked. At 4 concurrent
// ours keeps each prompt's 8 rollouts on one replica; the round robin stand-in splits prompts.
// The stubs' service-time spread, nice value and threads (one shared by default, or one per
// replica) are taken and recorded with every proxy row; a spread outside [0, 1] and an unknown
// threads mode are refused with the option named.
TEST(BenchCli, ProxyStubSpreadAndNiceAreTakenAndRecorded) {
  for (const std::string threads : {"", "per-replica"}) {
    auto r = run_lorasync("bench proxy --concurrency 4 --prompts 4 --stub-latency 0.02 --stub-latency-spread 0.5 "
                          "--stub-nice 5 --tracked-blocks 20000" + (threads.empty() ? std::string() : " --stub-threads " + threads));
    ASSERT_EQ(r.exit_code, 0) << r.err;
    int rows = 0;
    for (const auto& rec : parse_jsonl(r.out)) {
      if (rec["metric"] == "bytes_per_tracked_block") {  // no reference: no baseline (never a constant)
        EXPECT_TRUE(rec["baseline"].is_null()) << rec.dump();
        EXPECT_TRUE(rec["ratio"].is_null()) << rec.dump();
      }
      if (rec["metric"] == "unmatched_fraction") {  // 1/G is a floor, in the config, not a baseline
        EXPECT_TRUE(rec["baseline"].is_null()) << rec.dump();
        EXPECT_EQ(rec["config"]["floor"], 0.125) << rec.dump();
      }
      if (rec["metric"] != "unmatched_fraction" && rec["metric"] != "added_latency_p99_ms") continue;
      ++rows;
      EXPECT_EQ(rec["config"]["stub_latency_spread"], 0.5) << rec.dump();
      EXPECT_EQ(rec["config"]["stub_nice"], 5) << rec.dump();
      EXPECT_EQ(rec["config"]["stub_threads"], threads.empty() ? "shared" : threads) << rec.dump();
      EXPECT_EQ(rec["config"]["errors"], 0) << rec.dump();
    }
    EXPECT_EQ(rows, 2) << r.out;
  }
  auto bad = run_lorasync("bench proxy --concurrency 4 --prompts 4 --stub-latency-spread 1.5");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("--stub-latency-spread"), std::string::npos) << bad.err;
  bad = run_lorasync("bench proxy --concurrency 4 --prompts 4 --stub-threads two");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("--stub-threads"), std::string::npos) << bad.err;
}

TEST(BenchCli, ProxyPicksAreRecordedPerRequestForOursAndTheReference) {
  TempDir tmp("bench-proxy-picks");
  const auto script = tmp.path() / "round_robin_proxy.py";
  { std::ofstream(script) << kRoundRobinProxy; }
  const std::string prefix = (tmp.path() / "picks").string();
  auto r = testing::run_command("LORASYNC_BENCH_PROXY_PICKS=" + testing::shell_quote(prefix) + " " +
                                testing::shell_quote(LORASYNC_BINARY) + " bench proxy --concurrency 4 --prompts 12 " +
                                "--rounds 1 --tracked-blocks 20000 --reference " + testing::shell_quote(script.string()) + " --python " +
                                testing::shell_quote(LORASYNC_PYTHON));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  constexpr int kRequests = 12 * 8;
  int split_prompts[2] = {0, 0};  // ours, the reference
  for (int run = 0; run < 2; ++run) {
    std::ifstream f(prefix + "." + std::to_string(run));
    ASSERT_TRUE(f.good()) << "no " << prefix << "." << run;
    std::vector<int> seen_index(kRequests, 0), seen_sent(kRequests, 0), seen_answered(kRequests, 0);
    std::map<int, std::set<int>> replicas_of_prompt;
    int lines = 0;
    long index, prompt, sent, answered, pick;
    while (f >> index >> prompt >> sent >> answered >> pick) {
      ++lines;
      ASSERT_GE(index, 0);
      ASSERT_LT(index, kRequests);
      ASSERT_GE(sent, 0);
      ASSERT_LT(sent, kRequests);
      ASSERT_GE(answered, 0);
      ASSERT_LT(answered, kRequests);
      ++seen_index[index];
      ++seen_sent[sent];
      ++seen_answered[answered];
      EXPECT_TRUE(pick == 0 || pick == 1) << "run " << run << ": pick " << pick;
      replicas_of_prompt[static_cast<int>(prompt)].insert(static_cast<int>(pick));
    }
    EXPECT_EQ(lines, kRequests) << "run " << run;
    for (int i = 0; i < kRequests; ++i) {  // each a permutation of the requests
      EXPECT_EQ(seen_index[i], 1);
      EXPECT_EQ(seen_sent[i], 1);
      EXPECT_EQ(seen_answered[i], 1);
    }
    EXPECT_EQ(replicas_of_prompt.size(), 12u);
    for (const auto& [p, reps] : replicas_of_prompt) split_prompts[run] += reps.size() > 1;
  }
  EXPECT_EQ(split_prompts[0], 0);  // ours: every prompt on one replica
  EXPECT_GT(split_prompts[1], 0);  // the round robin splits them
}

// --math-verify: our grades/s against Math-Verify's are timed on the same items (the first
// --math-verify-items of each workload), --math-verify-passes passes on each side, best pass
// against best pass, with every pass's rate in the config.
TEST(BenchCli, GradeTimesOursAndMathVerifyOnTheSameItemsBestPassAgainstBestPass) {
  auto r = run_lorasync("bench grade --seconds 0.01 --threads 1 --math-verify --math-verify-items 20 "
                        "--math-verify-passes 2 --python " + testing::shell_quote(LORASYNC_PYTHON));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  int rows = 0;
  for (const auto& rec : parse_jsonl(r.out)) {
    const std::string m = rec["metric"];
    if (!m.ends_with("_grades_per_s_vs_math_verify")) continue;
    ++rows;
    const auto& c = rec["config"];
    EXPECT_EQ(c["items"], 20) << rec.dump();
    EXPECT_EQ(c["passes"], 2) << rec.dump();
    ASSERT_EQ(c["ours_per_pass"].size(), 2u) << rec.dump();
    ASSERT_EQ(c["math_verify_per_pass"].size(), 2u) << rec.dump();
    double ours_best = 0, theirs_best = 0;
    for (const auto& x : c["ours_per_pass"]) ours_best = std::max(ours_best, x.get<double>());
    for (const auto& x : c["math_verify_per_pass"]) theirs_best = std::max(theirs_best, x.get<double>());
    EXPECT_GT(ours_best, 0);
    EXPECT_GT(theirs_best, 0);
    EXPECT_NEAR(rec["value"].get<double>(), ours_best, 1e-9 * ours_best) << rec.dump();
    EXPECT_NEAR(rec["baseline"].get<double>(), theirs_best, 1e-9 * theirs_best) << rec.dump();
  }
  EXPECT_EQ(rows, 3) << r.out;  // one per workload
}

}  // namespace
}  // namespace lorasync
