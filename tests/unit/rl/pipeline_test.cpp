// Unit tests of the trainer's rollout pipeline (rl/pipeline.h, trainer.md §1 and §9): staleness in
// sync indices, the switch sweep and requeue/abandon, queue order; and the pipeline's threads
// under version churn against an in-process server (the rollout io thread, the scoring workers, a
// trainer thread and a sync thread). libtorch-free: scripts/sanitize runs it under ASan + UBSan and
// TSan.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <random>
#include <set>
#include <tuple>
#include <thread>

#include "core/tokenizer/tokenizer.h"
#include "http/server.h"
#include "reward/reward_fn.h"
#include "rl/pipeline.h"
#include "rl_groups.h"
#include "util/error.h"
#include "util/hold.h"

namespace lorasync::rl {
namespace {

using nlohmann::json;

struct PipelineFixture : ::testing::Test {
  PipelineFixture() : tokenizer(tok::Tokenizer::load(std::string(LORASYNC_SHARED_DIR) + "/data/qwen2-tokenizer")) {
    for (int i = 0; i < 8; ++i) data.problems.push_back({i, "p" + std::to_string(i), {"1"}, {1, 2, 3}});
    data.n_rows = 8;
  }
  std::unique_ptr<Pipeline> make(std::int64_t max_staleness, std::int64_t attempts = 3) {
    PipelineOptions o;
    o.cfg.async.max_staleness = max_staleness;
    o.cfg.async.max_prompt_attempts = attempts;
    o.cfg.grpo.num_generations = 4;
    o.server_url = "http://127.0.0.1:1";
    o.vocab = 100;
    o.prefix = "policy";
    auto p = std::make_unique<Pipeline>(o, data, tokenizer, reward::make_reward_function("math_boxed"),
                                        [this](const GroupEvent& e) { events.push_back(e); });
    p->init_fresh();
    return p;
  }
  Dataset data;
  tok::Tokenizer tokenizer;
  std::vector<GroupEvent> events;
};

TEST_F(PipelineFixture, StalenessCountsSyncIndicesNotVersionNumbers) {
  auto p = make(1);
  p->add_version({1, 0, "policy-v1", "a"});
  p->switch_to(1);
  PipelineState st = p->capture();
  st.groups = {make_group(0, 1, 0)};
  p->restore(st);
  // A resume re-announces the current weights as a new number with the same sync index.
  p->add_version({7, 0, "policy-v7", "a"});
  p->switch_to(7);
  auto g = p->pop(0.1);
  ASSERT_TRUE(g);
  EXPECT_EQ(p->staleness_of(*g), 0);
  p->add_version({8, 1, "policy-v8", "b"});
  p->switch_to(8);
  EXPECT_EQ(p->staleness_of(*g), 1);
  p->add_version({9, 2, "policy-v9", "c"});
  p->switch_to(9);
  EXPECT_EQ(p->staleness_of(*g), 2);  // > max_staleness: the trainer drops it at dequeue
}

TEST_F(PipelineFixture, SwitchSweepsExactlyTheStaleGroupsAndRequeuesThem) {
  auto p = make(1);
  for (std::int64_t v = 1; v <= 3; ++v) p->add_version({v, v - 1, "policy-v" + std::to_string(v), ""});
  p->switch_to(2);
  PipelineState st = p->capture();
  st.groups = {make_group(3, 1, 0), make_group(4, 2, 1), make_group(5, 1, 0)};
  p->restore(st);
  EXPECT_EQ(p->queue_samples(), 12);
  p->switch_to(3);  // k(V) = 2: the two groups of k = 0 are beyond max_staleness = 1
  EXPECT_EQ(p->queue_samples(), 4);
  EXPECT_EQ(p->counters()["sample/dropped_stale_total"], 8);
  auto c = p->capture();
  ASSERT_EQ(c.cursor.redo.size(), 2u);
  std::set<std::int64_t> redo;
  for (const auto& r : c.cursor.redo) {
    redo.insert(r.index);
    EXPECT_EQ(r.attempt, 2);
  }
  EXPECT_EQ(redo, (std::set<std::int64_t>{3, 5}));
  int dropped = 0;
  for (const auto& e : events) dropped += e.disposition == "dropped_stale";
  EXPECT_EQ(dropped, 2);
}

TEST_F(PipelineFixture, DroppedPromptIsAbandonedAfterMaxAttempts) {
  auto p = make(0, /*attempts=*/2);
  p->add_version({1, 0, "policy-v1", ""});
  p->switch_to(1);
  Group g = make_group(6, 1, 0);
  p->drop_stale(g, 1);  // attempt 1 -> requeued as attempt 2
  auto c = p->capture();
  ASSERT_EQ(c.cursor.redo.size(), 1u);
  EXPECT_EQ(c.cursor.redo.front().attempt, 2);
  g.prompt.attempt = 2;
  p->drop_stale(g, 1);  // attempt 2 = max: abandoned
  EXPECT_EQ(p->counters()["rollout/abandoned_total"], 1);
  EXPECT_EQ(events.back().disposition, "abandoned");
}

TEST_F(PipelineFixture, QueueIsOrderedBySyncIndexThenCompletion) {
  auto p = make(4);
  p->add_version({1, 0, "policy-v1", ""});
  p->add_version({2, 1, "policy-v2", ""});
  p->switch_to(2);
  PipelineState st = p->capture();
  st.groups = {make_group(0, 2, 1), make_group(1, 1, 0), make_group(2, 2, 1), make_group(3, 1, 0)};
  p->restore(st);
  std::vector<std::int64_t> order;
  while (auto g = p->pop(0.01)) order.push_back(g->prompt.index);
  EXPECT_EQ(order, (std::vector<std::int64_t>{1, 3, 0, 2}));
}


// A generation server for the pipeline: completions of 1-6 tokens after 0-15 ms, every 7th request
// answers 503, provenance names the requested adapter. A request whose client leaves (a stale
// group cancelled by a switch) is counted and not answered.
class ChurnServer {
 public:
  ChurnServer() {
    http::ServerOptions o;
    o.threads = 2;
    server_ = std::make_unique<http::Server>(o, [this](http::Request& req, http::ResponseWriter& w) { return handle(req, w); });
    server_->start();
  }
  ~ChurnServer() { server_->stop(1.0); }
  std::uint16_t port() const { return server_->port(); }
  int requests() const { return requests_.load(); }
  int gone() const { return gone_.load(); }

 private:
  http::Task<void> handle(http::Request& req, http::ResponseWriter& w) {
    const json body = json::parse(req.body, nullptr, false);
    const int i = ++requests_;
    http::Response r = answer(std::string(req.path()), body, i);
    if (!co_await testing::hold_unless_client_leaves(w, 0.001 * static_cast<double>(std::mt19937(static_cast<unsigned>(i))() % 16))) {
      ++gone_;
      co_return;
    }
    co_await w.send(std::move(r));
  }

  static http::Response answer(const std::string& path, const json& body, int i) {
    if (path != "/v1/completions" || body.is_discarded()) return http::json_response(404, "{}");
    if (i % 7 == 0) return http::json_response(503, R"x({"error":{"message":"overloaded (scripted)"}})x");
    std::mt19937 rng(static_cast<unsigned>(i) * 2654435761u);
    json choices = json::array();
    for (int k = 0; k < body["n"].get<int>(); ++k) {
      json ids = json::array(), lps = json::array();
      const int len = 1 + static_cast<int>(rng() % 6);
      for (int t = 0; t < len; ++t) ids.push_back(100 + static_cast<int>(rng() % 1000)), lps.push_back(-0.5);
      choices.push_back({{"index", k}, {"text", ""}, {"finish_reason", "stop"}, {"token_ids", ids},
                         {"logprobs", {{"token_logprobs", lps}}}});
    }
    const std::string model = body["model"];
    return http::json_response(200, json{{"model", model}, {"choices", choices}, {"lorasync", {{"adapter", model}}}}.dump());
  }

  std::atomic<int> requests_{0}, gone_{0};
  std::unique_ptr<http::Server> server_;
};

// The pipeline's threads together: the rollout io thread (dispatch, retries after 503s,
// cancellation of stale groups), two scoring workers, a trainer thread (pop, staleness check,
// drop or train, a checkpoint capture now and then) and a sync thread (a new version every few
// trained groups: add, switch, wait for the old version's requests to end, retire). Under TSan
// this is the pipeline's race check; here it also checks the bookkeeping: nothing trained beyond
// the staleness bound, every trained group names a version that was announced, and after stop()
// nothing is in flight and every event is one of the documented dispositions.
TEST_F(PipelineFixture, ThreadsAgreeUnderVersionChurn) {
  ChurnServer server;
  for (int i = 8; i < 24; ++i) data.problems.push_back({i, "p" + std::to_string(i), {"1"}, {1, 2, 3, i}});
  data.n_rows = 24;
  PipelineOptions o;
  o.cfg.async.max_staleness = 1;
  o.cfg.async.max_prompt_attempts = 1000;  // nothing abandoned: every prompt is trained in the end
  o.cfg.async.max_inflight = 24;
  o.cfg.async.queue_maxsize = 16;
  o.cfg.async.score_workers = 2;
  o.cfg.async.retry_backoff_s = 0.001;
  o.cfg.async.retry_backoff_max_s = 0.005;
  o.cfg.grpo.num_generations = 4;
  o.cfg.generation.max_new_tokens = 8;
  o.server_url = fmt::format("http://127.0.0.1:{}", server.port());
  o.vocab = 151936;
  o.prefix = "policy";
  std::mutex ev_mu;
  std::map<std::string, int> dispositions;
  Pipeline p(o, data, tokenizer, reward::make_reward_function("math_boxed"), [&](const GroupEvent& e) {
    std::lock_guard lk(ev_mu);
    ++dispositions[e.disposition];
  });
  p.init_fresh();
  p.add_version({1, 0, "policy-v1", ""});
  p.switch_to(1);
  p.start();

  std::atomic<int> trained{0};
  std::atomic<bool> done{false};
  std::set<std::int64_t> announced{1};
  std::mutex announced_mu;
  std::thread sync([&] {
    std::int64_t v = 1;
    int at = 0;
    while (!done) {
      if (trained.load() < at + 4) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        continue;
      }
      at = trained.load();
      {
        std::lock_guard lk(announced_mu);
        announced.insert(v + 1);
      }
      p.add_version({v + 1, v, fmt::format("policy-v{}", v + 1), ""});
      p.switch_to(++v);
      // Versions that left the window: wait for their cancelled requests, then forget them.
      for (std::int64_t old = 1; old < v - o.cfg.async.max_staleness; ++old) {
        if (!p.version(old)) continue;
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        while (p.in_flight_uses(old) && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        ASSERT_FALSE(p.in_flight_uses(old)) << "version " << old << " still has requests 10 s after leaving the window";
        p.retire_version(old);
      }
    }
  });
  int stale_dropped = 0;
  std::set<std::int64_t> trained_versions;
  while (trained < 120) {
    auto g = p.pop(30);
    ASSERT_TRUE(g) << "no group within 30 s; fatal: " << p.fatal().value_or("none");
    const std::int64_t s = p.staleness_of(*g);
    if (s > o.cfg.async.max_staleness) {
      p.drop_stale(*g, s);
      ++stale_dropped;
      continue;
    }
    {
      std::lock_guard lk(announced_mu);
      ASSERT_TRUE(announced.count(g->version)) << g->version;
    }
    ASSERT_EQ(g->members.size(), 4u);
    trained_versions.insert(g->version);
    p.record_trained({*g});
    if (++trained % 10 == 0) {
      // A checkpoint while the threads run: the sync thread may switch versions during the capture,
      // so its version lies between the ones current before and after it.
      const std::int64_t before = p.current()->version;
      const PipelineState st = p.capture();
      const std::int64_t after = p.current()->version;
      EXPECT_GE(st.current, before);
      EXPECT_LE(st.current, after);
    }
  }
  done = true;
  sync.join();
  p.stop();
  EXPECT_FALSE(p.fatal()) << *p.fatal();
  EXPECT_EQ(p.inflight_sequences(), 0);
  EXPECT_GE(trained_versions.size(), 10u) << "the versions changed while groups were trained";
  const auto c = p.counters();
  EXPECT_GT(c.at("rollout/retry_total"), 0) << "503s were retried";
  EXPECT_EQ(c.at("rollout/failed_total"), 0);
  std::lock_guard lk(ev_mu);
  EXPECT_EQ(dispositions["trained"], 120);
  for (const auto& [d, n] : dispositions)
    EXPECT_TRUE(d == "trained" || d == "dropped_stale" || d == "cancelled") << d << " x" << n;
  EXPECT_GT(server.requests(), 120);
  std::printf("pipeline churn: %d requests, %d cancelled by the client (server saw %d), %d stale dropped, %zu versions trained\n",
              server.requests(), dispositions["cancelled"], server.gone(), stale_dropped, trained_versions.size());
}


// A server that refuses the request for one prompt with a configuration error (HTTP 400: fatal to
// the run) and holds the request for another until the test releases it, then answers 503 (a
// retryable error, seen after the fatal one).
class RefusingServer {
 public:
  RefusingServer(std::int32_t refused, std::int32_t held) : refused_(refused), held_(held) {
    server_ = std::make_unique<http::Server>(http::ServerOptions{}, [this](http::Request& req, http::ResponseWriter& w) { return handle(req, w); });
    server_->start();
  }
  ~RefusingServer() { server_->stop(1.0); }
  std::uint16_t port() const { return server_->port(); }
  void release() { released_ = true; }
  bool holding() const { return holding_; }

 private:
  http::Task<void> handle(http::Request& req, http::ResponseWriter& w) {
    const json body = json::parse(req.body, nullptr, false);
    const std::int32_t last = body["prompt"].back().get<std::int32_t>();
    if (last == refused_) {
      co_await w.send(http::error_response(400, "max_tokens is too large (scripted)"));
      co_return;
    }
    if (last == held_) {
      holding_ = true;
      while (!released_)
        if (!co_await testing::hold_unless_client_leaves(w, 0.002)) co_return;
    }
    co_await w.send(http::json_response(503, R"x({"error":{"message":"overloaded (scripted)"}})x"));
  }

  std::int32_t refused_, held_;
  std::atomic<bool> released_{false}, holding_{false};
  std::unique_ptr<http::Server> server_;
};

// Exactly once when the run ends on a fatal error: a group in flight when a server's answer is
// fatal (here a retry, requeued after its first attempt was dropped as stale, whose request fails
// after the fatal answer to another group's) ends with its prompt back in the redo list, with its
// attempt, so the checkpoint written on the way out still owes it; so does the refused group's.
// (Both used to end without a trace: neither trained, nor owed, nor abandoned.)
TEST_F(PipelineFixture, GroupsInFlightAtAFatalErrorStayOwed) {
  data.problems.clear();
  for (std::int32_t i = 0; i < 4; ++i) data.problems.push_back({i, "p" + std::to_string(i), {"1"}, {1, 2, 3, 40 + i}});
  data.n_rows = 4;
  PipelineOptions o;
  o.cfg.data.shuffle = false;
  o.cfg.async.max_staleness = 1;
  o.cfg.async.max_inflight = 8;  // two groups of 4
  o.cfg.async.retry_backoff_s = 0.001;
  o.cfg.async.retry_backoff_max_s = 0.002;
  o.cfg.grpo.num_generations = 4;
  o.vocab = 151936;
  o.prefix = "policy";
  RefusingServer server(/*refused=*/40, /*held=*/43);  // prompt 0's first attempt; prompt 3's retry
  o.server_url = fmt::format("http://127.0.0.1:{}", server.port());
  Pipeline p(o, data, tokenizer, reward::make_reward_function("math_boxed"), [this](const GroupEvent& e) { events.push_back(e); });
  p.init_fresh();
  p.add_version({1, 0, "policy-v1", ""});
  p.switch_to(1);
  Group g = make_group(3, 1, 0);
  p.drop_stale(g, 2);  // prompt 3, attempt 1: requeued as attempt 2, dispatched first
  p.start();
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while ((!p.fatal() || !server.holding()) && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  ASSERT_TRUE(p.fatal());
  EXPECT_NE(p.fatal()->find("HTTP 400"), std::string::npos) << *p.fatal();
  server.release();  // the retry's request now fails (503), after the fatal answer
  while (p.inflight_sequences() > 0 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  EXPECT_EQ(p.inflight_sequences(), 0);
  p.stop();  // the trainer's way out: stop, then the checkpoint's capture
  const PipelineState st = p.capture();
  std::set<std::tuple<std::int64_t, std::int64_t, std::int64_t>> redo;
  for (const auto& r : st.cursor.redo) redo.insert({r.index, r.epoch, r.attempt});
  EXPECT_EQ(redo, (std::set<std::tuple<std::int64_t, std::int64_t, std::int64_t>>{{3, 0, 2}, {0, 0, 1}}));
  EXPECT_TRUE(st.groups.empty());
  EXPECT_EQ(st.cursor.position, 1);  // nothing else was dispatched after the fatal answer
  ASSERT_EQ(events.size(), 1u);      // the drop; no abandonment, no failure
  EXPECT_EQ(events[0].disposition, "dropped_stale");
}
}  // namespace
}  // namespace lorasync::rl
