// The stub replica's service-time spread (`bench proxy --stub-latency-spread`): a fixed service
// time makes a closed-loop client replay each wave of requests in the previous wave's exact order
// (docs/proxy.md), so the benchmark can draw each completion's time instead.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <cstdlib>
#include <set>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "fleet_fixture.h"

namespace lorasync::bench {
namespace {

using proxy::fixture::call;
using proxy::fixture::ids_prompt;

TEST(StubLatency, FactorsAreUniformWithinTheSpreadAndDependOnSeedIndexAndDraw) {
  EXPECT_EQ(service_time_factor(1, 0, 0, 0.0), 1.0);
  EXPECT_EQ(service_time_factor(7, 3, 12345, 0.0), 1.0);
  const int n = 20000;
  double lo = 2, hi = 0, sum = 0;
  int below = 0;  // below the midpoint
  std::vector<int> bins(10, 0);
  for (int d = 0; d < n; ++d) {
    const double f = service_time_factor(1, 0, static_cast<std::uint64_t>(d), 0.25);
    ASSERT_GE(f, 0.75);
    ASSERT_LT(f, 1.25);
    lo = std::min(lo, f);
    hi = std::max(hi, f);
    sum += f;
    below += f < 1.0;
    ++bins[std::min(9, static_cast<int>((f - 0.75) / 0.05))];
  }
  EXPECT_NEAR(sum / n, 1.0, 0.005);
  EXPECT_LT(lo, 0.751);
  EXPECT_GT(hi, 1.249);
  EXPECT_NEAR(below, n / 2, n / 50);
  for (int b : bins) EXPECT_NEAR(b, n / 10, n / 50) << "a tenth of the range";
  // Deterministic, and different streams for other seeds and replicas.
  EXPECT_EQ(service_time_factor(1, 0, 5, 0.25), service_time_factor(1, 0, 5, 0.25));
  std::set<double> firsts;
  for (int i = 0; i < 4; ++i)
    for (std::uint64_t seed = 1; seed <= 4; ++seed) firsts.insert(service_time_factor(seed, i, 0, 0.5));
  EXPECT_EQ(firsts.size(), 16u);
}

// Each completion waits its own drawn time (reported in X-Stub-Service-Us): within the spread,
// and not one fixed value; without a spread, the fixed latency.
TEST(StubLatency, CompletionsTakeTheirDrawnServiceTimes) {
  for (double spread : {0.0, 0.5}) {
    StubOptions so;
    so.latency_s = 0.04;
    so.latency_spread = spread;
    StubReplica stub(so);
    stub.start();
    std::vector<double> ms;
    for (int i = 0; i < 8; ++i) {
      auto r = call(stub.port(), "POST", "/v1/completions", ids_prompt({i + 1}));
      ASSERT_EQ(r.status, 200) << r.body;
      const auto* v = r.headers.find("X-Stub-Service-Us");
      ASSERT_NE(v, nullptr);
      const double got = std::strtod(v->c_str(), nullptr) / 1000.0;
      const double want = 40.0 * service_time_factor(so.seed, so.index, static_cast<std::uint64_t>(i), spread);
      EXPECT_GE(got, want - 0.01) << "completion " << i << " spread " << spread;  // a timer fires late, never early
      ms.push_back(want);
    }
    const double range = *std::max_element(ms.begin(), ms.end()) - *std::min_element(ms.begin(), ms.end());
    if (spread == 0) EXPECT_EQ(range, 0.0);
    else EXPECT_GT(range, 10.0) << "eight draws over 20-60 ms";
    stub.stop();
  }
}


// StubOptions::nice: the thread that served a request runs at that nice value afterwards (read
// back from /proc/self/task/*/stat, field 19), and the stub says it took it. A positive value
// needs no privilege.
// Threads of this process at nice `value` (from /proc/self/task/*/stat, field 19).
int threads_at_nice(const std::string& value) {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream f(e.path() / "stat");
    std::string line;
    std::getline(f, line);
    const auto close = line.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(line.substr(close + 2));  // from field 3 (state) on
    std::string field;
    for (int i = 3; i <= 19 && rest >> field; ++i)
      if (i == 19 && field == value) ++n;
  }
  return n;
}

int thread_count() {
  int n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}

TEST(StubLatency, TheStubsThreadsTakeTheirNiceValue) {
  const int before = threads_at_nice("7");
  StubOptions so;
  so.nice = 7;
  StubReplica stub(so);
  stub.start();
  EXPECT_EQ(stub.nice_applied(), 0);
  ASSERT_EQ(call(stub.port(), "POST", "/v1/completions", ids_prompt({1})).status, 200);
  EXPECT_EQ(stub.nice_applied(), 1);
  EXPECT_EQ(threads_at_nice("7"), before + 1) << "one server thread, now at nice 7";
  stub.stop();
}

// StubFleet (`bench proxy --stub-threads`): with one thread, that thread serves both replicas (one
// more thread in the process; after a request to each, exactly one thread at the stubs' nice value,
// and both stubs say they took it), and answers leave in the order their service times end; with a
// thread per replica, two. Both stop cleanly with a completion still waiting.
TEST(StubFleet, OneThreadServesEveryReplica) {
  for (bool one_thread : {true, false}) {
    SCOPED_TRACE(one_thread ? "one thread" : "a thread per replica");
    StubOptions so;
    so.nice = 9;
    so.latency_s = 0.05;
    const int before = thread_count(), niced_before = threads_at_nice("9");
    StubFleet fleet(so, 2, one_thread);
    ASSERT_EQ(fleet.size(), 2u);
    fleet.start();
    EXPECT_EQ(thread_count(), before + (one_thread ? 1 : 2));
    for (std::size_t i = 0; i < 2; ++i) {
      auto r = call(fleet[i].port(), "POST", "/v1/completions", ids_prompt({static_cast<int>(i) + 1}));
      ASSERT_EQ(r.status, 200) << r.body;
      const auto* idx = r.headers.find("X-Stub-Index");
      ASSERT_NE(idx, nullptr);
      EXPECT_EQ(*idx, std::to_string(i));
      EXPECT_EQ(fleet[i].nice_applied(), 1);
      EXPECT_EQ(fleet[i].completions(), 1u);
    }
    EXPECT_EQ(threads_at_nice("9"), niced_before + (one_thread ? 1 : 2));
    const auto urls = fleet.urls();
    ASSERT_EQ(urls.size(), 2u);
    EXPECT_NE(urls[0], urls[1]);
    // Replica 1's completion is asked first with the longer service time; replica 0's, asked
    // later, ends first and is answered first.
    fleet[1].latency_s.store(0.4);
    fleet[0].latency_s.store(0.1);
    std::mutex mu;
    std::vector<int> order;
    std::thread late([&] {
      ASSERT_EQ(call(fleet[1].port(), "POST", "/v1/completions", ids_prompt({7})).status, 200);
      std::lock_guard lk(mu);
      order.push_back(1);
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    ASSERT_EQ(call(fleet[0].port(), "POST", "/v1/completions", ids_prompt({8})).status, 200);
    {
      std::lock_guard lk(mu);
      order.push_back(0);
    }
    late.join();
    EXPECT_EQ(order, (std::vector<int>{0, 1}));
    // A completion still waiting when the fleet stops: its connection closes, nothing hangs (its
    // service time is an hour: a stop that waited for it would hold the test until its timeout).
    fleet[0].latency_s.store(3600);
    std::thread held([&] { EXPECT_NE(call(fleet[0].port(), "POST", "/v1/completions", ids_prompt({9})).status, 200); });
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    fleet.stop();
    held.join();
    fleet.stop();  // idempotent
  }
  StubFleet never_started(StubOptions{}, 2);  // goes without start()
}

}  // namespace
}  // namespace lorasync::bench
