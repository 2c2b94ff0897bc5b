// Multi-turn episodes (rl/environment.h, rl/episode.h, docs/environments.md): protocol v1's
// answer parsers; the worker pool against a scripted Python environment (tests/unit/rl/envs/
// scripted_env.py, stdlib only) including every hostile behaviour (garbage, a 50 MB line, a crash
// mid-step, a hang past the deadline, the wrong id, an error answer), each a failure of its kind
// that kills the worker so that nothing late is read as the next answer; and episodes through the
// pipeline against an in-process completion server: token-in/token-out (each turn's prompt is the
// previous prompt plus exactly the sampled and the environment's tokens), the mask, per-token
// versions, rewards summed over turns, limits and failures counted by cause. libtorch-free:
// scripts/sanitize runs it under ASan + UBSan and TSan.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fmt/format.h>

#include <atomic>
#include <fstream>
#include <mutex>
#include <thread>

#include "core/tokenizer/tokenizer.h"
#include "http/server.h"
#include "reward/reward_fn.h"
#include "rl/episode.h"
#include "rl/environment.h"
#include "rl/pipeline.h"
#include "util/error.h"
#include "util/files.h"

namespace lorasync::rl {
namespace {

using nlohmann::json;

std::string script() { return std::string(LORASYNC_SOURCE_DIR) + "/tests/unit/rl/envs/scripted_env.py"; }

EnvOptions env_options(const std::string& mode, double timeout_s = 20) {
  EnvOptions o;
  o.command = {"python3", script(), "--mode", mode};
  o.workers = 2;
  o.timeout_s = timeout_s;
  o.startup_s = 30;
  o.memory_mb = 1024;
  o.max_output_bytes = 1 << 20;
  return o;
}

EnvFailure failure_of(const std::function<void()>& f, std::string* msg = nullptr) {
  try {
    f();
  } catch (const EnvFailed& e) {
    if (msg) *msg = e.what();
    return e.kind();
  }
  ADD_FAILURE() << "no EnvFailed";
  return EnvFailure::kUnavailable;
}

TEST(EnvProtocol, ParsesWellFormedAnswers) {
  Observation o = parse_reset_answer(R"({"id": 3, "observation": {"messages": [{"role": "user", "content": "hi"}]}, "done": false})", 3);
  ASSERT_EQ(o.messages.size(), 1u);
  EXPECT_EQ(o.messages[0].role, "user");
  EXPECT_EQ(o.messages[0].content, "hi");
  o = parse_reset_answer(R"({"id": 1, "observation": {"token_ids": [5, 6]}})", 1);
  EXPECT_TRUE(o.tokens);
  EXPECT_EQ(o.token_ids, (std::vector<std::int64_t>{5, 6}));
  EnvStepResult s = parse_step_answer(R"({"id": 9, "observation": null, "reward": 0.5, "done": true, "info": {"k": 1}})", 9);
  EXPECT_TRUE(s.done);
  EXPECT_FALSE(s.has_observation);
  EXPECT_DOUBLE_EQ(s.reward, 0.5);
  EXPECT_EQ(s.info, R"({"k":1})");
  s = parse_step_answer(R"({"id": 2, "observation": {"messages": [{"role": "tool", "content": "4"}]}, "done": false})", 2);
  EXPECT_FALSE(s.done);
  EXPECT_DOUBLE_EQ(s.reward, 0.0);
  ASSERT_TRUE(s.has_observation);
  EXPECT_EQ(s.observation.messages[0].role, "tool");
}

TEST(EnvProtocol, RefusesMalformedAnswersNamingTheFault) {
  struct Case {
    std::string line, needle;
  };
  const Case reset_cases[] = {
      {"not json", "not JSON"},
      {"[1]", "not a JSON object"},
      {R"({"observation": {"token_ids": []}})", "no integer \"id\""},
      {R"({"id": 2, "observation": {"token_ids": []}})", "id is 2, expected 1"},
      {R"({"id": 1, "done": true, "observation": {"token_ids": [1]}})", "at least one model turn"},
      {R"({"id": 1})", "no \"observation\""},
      {R"({"id": 1, "observation": {"messages": [], "token_ids": []}})", "exactly one of"},
      {R"({"id": 1, "observation": {"messages": [{"role": "assistant", "content": "x"}]}})", "not one of system, user, tool"},
      {R"({"id": 1, "observation": {"messages": [{"role": "user"}]}})", "string \"content\""},
      {R"({"id": 1, "observation": {"token_ids": [1.5]}})", "non-integer"},
      {R"({"id": 1, "observation": {"messages": []}})", "no message"},
      {R"({"id": 1, "done": "no", "observation": {"token_ids": [1]}})", "not a boolean"},
  };
  for (const auto& c : reset_cases) {
    std::string msg;
    EXPECT_EQ(failure_of([&] { parse_reset_answer(c.line, 1); }, &msg), EnvFailure::kInvalid) << c.line;
    EXPECT_NE(msg.find(c.needle), std::string::npos) << c.line << " -> " << msg;
  }
  const Case step_cases[] = {
      {R"({"id": 1, "reward": 1})", "boolean \"done\""},
      {R"({"id": 1, "done": false, "reward": 1})", "needs an \"observation\""},
      {R"({"id": 1, "done": true, "reward": "1"})", "not a number"},
      {R"({"id": 1, "done": true, "reward": 1e999})", "not"},
  };
  for (const auto& c : step_cases) {
    std::string msg;
    EXPECT_EQ(failure_of([&] { parse_step_answer(c.line, 1); }, &msg), EnvFailure::kInvalid) << c.line;
    EXPECT_NE(msg.find(c.needle), std::string::npos) << c.line << " -> " << msg;
  }
  std::string msg;
  EXPECT_EQ(failure_of([&] { parse_step_answer(R"({"id": 1, "error": "boom"})", 1); }, &msg), EnvFailure::kError);
  EXPECT_NE(msg.find("boom"), std::string::npos);
}

TEST(EnvPool, RunsEpisodesAndReusesAHealthyWorker) {
  EnvironmentPool pool(env_options("ok"));
  for (int episode = 0; episode < 3; ++episode) {
    auto s = pool.open();
    Observation o = s->reset(R"({"index": 4, "problem": "p4", "answers": ["1"]})", 77);
    ASSERT_EQ(o.messages.size(), 2u);
    EXPECT_EQ(o.messages[1].content, "say yes to p4");
    EnvStepResult a = s->step({"maybe", {1, 2, 3}, "stop"});
    EXPECT_FALSE(a.done);
    EXPECT_DOUBLE_EQ(a.reward, 0.25);
    EXPECT_NE(a.info.find("\"n_ids\":3"), std::string::npos) << a.info;
    EnvStepResult b = s->step({"yes", {4}, "stop"});
    EXPECT_TRUE(b.done);
    EXPECT_DOUBLE_EQ(b.reward, 1.0);
  }
  EXPECT_EQ(pool.workers_started(), 1) << "a worker that ended its episodes cleanly is reused";
}

// Each hostile behaviour fails its own exchange with its kind, the worker is killed (a fresh one
// serves the next episode), and a healthy episode afterwards works.
TEST(EnvPool, HostileEnvironmentsFailTheirEpisodeOnly) {
  struct Case {
    std::string mode;
    EnvFailure kind;
    std::string needle;
  };
  const Case cases[] = {
      {"garbage", EnvFailure::kInvalid, "not JSON"},
      {"huge", EnvFailure::kInvalid, "without a newline"},
      {"wrong_id", EnvFailure::kInvalid, "expected 1"},
      {"crash_step", EnvFailure::kCrashed, "exited with status 3"},
      {"hang", EnvFailure::kTimeout, "no answer within 1 s"},
      {"error", EnvFailure::kError, "scripted"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.mode);
    EnvironmentPool pool(env_options(c.mode, /*timeout_s=*/c.mode == "hang" ? 1 : 20));
    std::string msg;
    {
      auto s = pool.open();
      EnvFailure k = failure_of(
          [&] {
            s->reset(R"({"index": 0})", 1);
            s->step({"yes", {1}, "stop"});
          },
          &msg);
      EXPECT_EQ(k, c.kind);
      EXPECT_NE(msg.find(c.needle), std::string::npos) << msg;
    }
    // The next episode gets a worker again (a fresh process unless the failure was the
    // environment's own error answer, which keeps it).
    auto s = pool.open();
    const std::int64_t before = pool.workers_started();
    if (c.mode == "error") {
      s->reset(R"({"index": 0})", 1);
      EXPECT_EQ(pool.workers_started(), before) << "an error answer keeps the worker";
    } else {
      EXPECT_EQ(failure_of([&] {
                  s->reset(R"({"index": 0})", 1);
                  s->step({"yes", {1}, "stop"});
                }),
                c.kind);
      EXPECT_EQ(pool.workers_started(), before + 1) << "a failed worker is never reused";
    }
  }
}

TEST(EnvPool, ShutdownEndsARunningExchange) {
  EnvironmentPool pool(env_options("hang", 3600));
  auto s = pool.open();
  s->reset(R"({"index": 0})", 1);
  std::thread t([&] { pool.shutdown(); });
  EXPECT_EQ(failure_of([&] { s->step({"x", {1}, "stop"}); }), EnvFailure::kUnavailable);
  t.join();
  EXPECT_EQ(failure_of([&] { pool.open(); }), EnvFailure::kUnavailable);
}

TEST(EnvPool, RefusesAProgramThatCannotStart) {
  EnvOptions o = env_options("ok");
  o.command = {"/nonexistent/env-program"};
  EnvironmentPool pool(o);
  auto s = pool.open();
  std::string msg;
  EXPECT_EQ(failure_of([&] { s->reset("{}", 1); }, &msg), EnvFailure::kUnavailable);
  EXPECT_NE(msg.find("cannot start '/nonexistent/env-program'"), std::string::npos) << msg;
}

// A completion server for episodes: every request gets n choices of the same scripted tokens
// (the tokens of "yes" then <|im_end|>, or `length_tokens` tokens cut by max_tokens), named as the
// requested version. Records each request's prompt.
class TurnServer {
 public:
  explicit TurnServer(std::vector<std::int64_t> turn) : turn_(std::move(turn)) {
    http::ServerOptions o;
    o.threads = 2;
    server_ = std::make_unique<http::Server>(o, [this](http::Request& req, http::ResponseWriter& w) { return handle(req, w); });
    server_->start();
  }
  ~TurnServer() { server_->stop(1.0); }
  std::uint16_t port() const { return server_->port(); }
  std::vector<std::vector<std::int64_t>> prompts() const {
    std::lock_guard lk(mu_);
    return prompts_;
  }
  std::atomic<bool> cut{false};  // answer finish_reason "length" with max_tokens tokens

 private:
  http::Task<void> handle(http::Request& req, http::ResponseWriter& w) {
    std::string out = answer(req.body);
    co_await w.send(http::json_response(200, std::move(out)));
  }
  // Outside the coroutine (g++ 12 miscompiles string-literal braced lists in coroutines).
  std::string answer(const std::string& text) {
    const json body = json::parse(text, nullptr, false);
    {
      std::lock_guard lk(mu_);
      prompts_.push_back(body["prompt"].get<std::vector<std::int64_t>>());
    }
    json choices = json::array();
    for (int k = 0; k < body["n"].get<int>(); ++k) {
      std::vector<std::int64_t> ids = turn_;
      std::string finish = "stop";
      if (cut) ids.assign(static_cast<std::size_t>(body["max_tokens"].get<int>()), 220), finish = "length";
      std::vector<double> lps(ids.size(), -0.5);
      choices.push_back({{"index", k}, {"text", ""}, {"finish_reason", finish}, {"token_ids", ids}, {"logprobs", {{"token_logprobs", lps}}}});
    }
    const std::string model = body["model"];
    return json{{"model", model}, {"choices", choices}, {"lorasync", {{"adapter", model}}}}.dump();
  }
  std::vector<std::int64_t> turn_;
  mutable std::mutex mu_;
  std::vector<std::vector<std::int64_t>> prompts_;
  std::unique_ptr<http::Server> server_;
};

struct EpisodeFixture : ::testing::Test {
  EpisodeFixture() : tokenizer(tok::Tokenizer::load(std::string(LORASYNC_SHARED_DIR) + "/data/qwen2-tokenizer")) {
    for (int i = 0; i < 4; ++i) data.problems.push_back({i, "p" + std::to_string(i), {"1"}, {1, 2, 3}});
    data.n_rows = 4;
    im_end = *tokenizer.token_to_id("<|im_end|>");
    tok::EncodeOptions eo;
    eo.add_special_tokens = false;
    for (auto id : tokenizer.encode("yes", eo)) yes.push_back(id);
    yes.push_back(im_end);
  }
  PipelineOptions options(const std::string& mode, std::uint16_t port, std::int64_t max_turns = 4) {
    PipelineOptions o;
    o.cfg.grpo.num_generations = 2;
    o.cfg.async.max_inflight = 4;
    o.cfg.async.max_retries = 0;
    o.cfg.async.max_prompt_attempts = 1;
    o.cfg.generation.max_new_tokens = 16;
    o.cfg.generation.context_len = 512;
    o.cfg.env.command = {"python3", script(), "--mode", mode};
    o.cfg.env.workers = 2;
    o.cfg.env.timeout_s = 20;
    o.cfg.env.max_turns = max_turns;
    o.server_url = fmt::format("http://127.0.0.1:{}", port);
    o.vocab = tokenizer.vocab_size();
    o.stop_ids = {im_end};
    o.prefix = "policy";
    return o;
  }
  // Runs the pipeline until one group is queued (or `wait_s`), then stops it.
  std::optional<Group> one_group(Pipeline& p, double wait_s = 60) {
    p.init_fresh();
    p.add_version({1, 0, "policy-v1", ""});
    p.switch_to(1);
    p.start();
    auto g = p.pop(wait_s);
    p.stop();
    if (!g)
      for (const auto& [k, v] : p.counters()) std::printf("  counter %s = %lld\n", k.c_str(), static_cast<long long>(v));
    return g;
  }
  Dataset data;
  tok::Tokenizer tokenizer;
  std::int64_t im_end = 0;
  std::vector<std::int64_t> yes;
};

TEST_F(EpisodeFixture, TurnsExtendTheContextTokenForTokenAndOnlyTheModelsTokensAreTrained) {
  TurnServer server(yes);
  Pipeline p(options("ok", server.port()), data, tokenizer, reward::make_reward_function("math_boxed"), nullptr);
  auto g = one_group(p);
  ASSERT_TRUE(g) << p.fatal().value_or("no group");
  EXPECT_TRUE(g->prescored);
  EXPECT_EQ(g->version, 1);
  ASSERT_EQ(g->members.size(), 2u);
  const auto first = render_env_turn(tokenizer, {{"system", "Answer yes."}, {"user", "say yes to p" + std::to_string(g->prompt.index)}}, false);
  const auto again = render_env_turn(tokenizer, {{"user", "again"}}, true);
  EXPECT_EQ(tokenizer.decode(std::vector<std::int32_t>(again.begin(), again.end())), "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n");
  for (const auto& m : g->members) {
    EXPECT_EQ(m.prompt_ids, first);
    EXPECT_EQ(m.turns, 2);
    EXPECT_EQ(m.finish, "done");
    EXPECT_DOUBLE_EQ(m.reward, 1.25) << "the turns' rewards add up: 0.25 + 1.0";
    // ids = turn 1 + the environment's turn + turn 2; mask 1 on the model's tokens only.
    std::vector<std::int64_t> expect = yes;
    expect.insert(expect.end(), again.begin(), again.end());
    expect.insert(expect.end(), yes.begin(), yes.end());
    ASSERT_EQ(std::vector<std::int64_t>(m.ids.begin(), m.ids.end()), expect);
    ASSERT_EQ(m.mask.size(), expect.size());
    ASSERT_EQ(m.versions.size(), expect.size());
    ASSERT_EQ(m.logprobs.size(), expect.size());
    for (std::size_t i = 0; i < expect.size(); ++i) {
      const bool model = i < yes.size() || i >= yes.size() + again.size();
      EXPECT_EQ(m.mask[i], model ? 1 : 0) << i;
      EXPECT_EQ(m.logprobs[i], model ? -0.5f : 0.0f) << i;
      EXPECT_EQ(m.versions[i], 1) << i;
    }
    EXPECT_EQ(m.model_tokens(), static_cast<std::int64_t>(2 * yes.size()));
  }
  // Token-in/token-out: every continuation's prompt is the first prompt + the sampled tokens +
  // the environment's tokens, exactly.
  std::vector<std::int64_t> second = first;
  second.insert(second.end(), yes.begin(), yes.end());
  second.insert(second.end(), again.begin(), again.end());
  int firsts = 0, seconds = 0;
  for (const auto& pr : server.prompts()) {
    if (pr == first) ++firsts;
    else if (pr == second) ++seconds;
  }
  EXPECT_GE(firsts, 2);
  EXPECT_GE(seconds, 2);
  const auto c = p.counters();
  EXPECT_GE(c.at("episode/total"), 2);
  EXPECT_GE(c.at("episode/turns_total"), 4);
  EXPECT_EQ(c.at("rollout/env_crashed_total"), 0);
}

TEST_F(EpisodeFixture, TokenObservationsAreAppendedVerbatim) {
  TurnServer server(yes);
  Pipeline p(options("tokens", server.port()), data, tokenizer, reward::make_reward_function("math_boxed"), nullptr);
  auto g = one_group(p);
  ASSERT_TRUE(g) << p.fatal().value_or("no group");
  const auto& m = g->members[0];
  std::vector<std::int64_t> expect = yes;
  for (std::int64_t t : {11, 12, 13}) expect.push_back(t);
  expect.insert(expect.end(), yes.begin(), yes.end());
  EXPECT_EQ(std::vector<std::int64_t>(m.ids.begin(), m.ids.end()), expect);
}

TEST_F(EpisodeFixture, LimitsEndEpisodesWithTheirRewardsSoFar) {
  {
    TurnServer server(yes);
    Pipeline p(options("never_done", server.port(), /*max_turns=*/3), data, tokenizer, reward::make_reward_function("math_boxed"), nullptr);
    auto g = one_group(p);
    ASSERT_TRUE(g) << p.fatal().value_or("no group");
    for (const auto& m : g->members) {
      EXPECT_EQ(m.turns, 3);
      EXPECT_EQ(m.finish, "truncated_turns");
      EXPECT_DOUBLE_EQ(m.reward, 0.75);
    }
    EXPECT_GE(p.counters().at("episode/truncated_turns_total"), 2);
  }
  {
    TurnServer server(yes);
    Pipeline p(options("overflow", server.port()), data, tokenizer, reward::make_reward_function("math_boxed"), nullptr);
    auto g = one_group(p);
    ASSERT_TRUE(g) << p.fatal().value_or("no group");
    for (const auto& m : g->members) {
      EXPECT_EQ(m.turns, 1);
      EXPECT_EQ(m.finish, "truncated_observation");
      EXPECT_DOUBLE_EQ(m.reward, 0.5);
      EXPECT_EQ(std::vector<std::int64_t>(m.ids.begin(), m.ids.end()), yes) << "nothing of the refused observation is kept";
    }
    EXPECT_GE(p.counters().at("episode/truncated_observation_total"), 2);
  }
  {
    // Turns cut by max_tokens go to the environment (finish_reason "length"), and the template's
    // <|im_end|> closes each cut turn before the environment's message, as a context token.
    TurnServer server(yes);
    server.cut = true;
    PipelineOptions o = options("ok", server.port());
    Pipeline p(o, data, tokenizer, reward::make_reward_function("math_boxed"), nullptr);
    auto g = one_group(p);
    ASSERT_TRUE(g) << p.fatal().value_or("no group");
    const auto again = render_env_turn(tokenizer, {{"user", "again"}}, true);
    const auto n = static_cast<std::size_t>(o.cfg.generation.max_new_tokens);
    for (const auto& m : g->members) {
      EXPECT_EQ(m.finish, "done");
      EXPECT_EQ(m.turns, 2);
      EXPECT_DOUBLE_EQ(m.reward, 0.25) << "the environment scored the cut turns (no \"yes\" in them)";
      ASSERT_EQ(m.ids.size(), n + 1 + again.size() + n);
      EXPECT_EQ(m.ids[n], im_end);
      EXPECT_EQ(m.mask[n], 0);
      EXPECT_EQ(m.model_tokens(), static_cast<std::int64_t>(2 * n));
    }
    EXPECT_GE(p.counters().at("episode/cut_turns_total"), 4);
  }
}

// A crashing, erroring or garbage-answering environment fails its episodes (NaN rewards: a
// group without two valid members is requeued, counted as failed) and is counted by cause; the
// pipeline keeps running and nothing is queued from them.
TEST_F(EpisodeFixture, EnvironmentFailuresAreCountedByCause) {
  struct Case {
    std::string mode, counter;
  };
  for (const Case& c : {Case{"crash_step", "rollout/env_crashed_total"}, Case{"error", "rollout/env_error_total"},
                        Case{"garbage", "rollout/env_invalid_total"}, Case{"bad_token", "rollout/env_invalid_total"}}) {
    SCOPED_TRACE(c.mode);
    TurnServer server(yes);
    PipelineOptions o = options(c.mode, server.port());
    o.cfg.data.epochs = 1;
    Pipeline p(o, data, tokenizer, reward::make_reward_function("math_boxed"), nullptr);
    p.init_fresh();
    p.add_version({1, 0, "policy-v1", ""});
    p.switch_to(1);
    p.start();
    // Every prompt's single attempt fails: the run is exhausted without a group.
    for (int i = 0; i < 600 && p.counters().at(c.counter) < 8; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    auto g = p.pop(0.1);
    p.stop();
    EXPECT_FALSE(g);
    const auto cnt = p.counters();
    EXPECT_EQ(cnt.at(c.counter), 8) << "4 prompts x 2 episodes";
    EXPECT_EQ(cnt.at("rollout/failed_total") + cnt.at("rollout/abandoned_total") >= 4, true);
    EXPECT_FALSE(p.fatal());
  }
}

}  // namespace
}  // namespace lorasync::rl
