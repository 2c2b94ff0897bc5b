#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <atomic>
#include <condition_variable>
#include <limits>
#include <map>
#include <mutex>
#include <thread>

#include "core/model/logprobs.h"
#include "core/model/decoder_model.h"
#include "core/tokenizer/tokenizer.h"
#include "engine/adapter_store.h"
#include "engine/engine.h"
#include "util/error.h"
#include "util/files.h"

namespace lorasync::engine {
namespace {

// Collects a request's output and lets the test wait for the end.
class Collector : public RequestSink {
 public:
  void on_output(std::vector<ChoiceDelta> deltas, const RequestUsage& usage, bool done) override {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& d : deltas) {
      auto& c = choices_[d.index];
      for (auto& t : d.tokens) {
        c.ids.push_back(t.id);
        c.logprobs.push_back(t.logprob);
      }
      c.text += d.text;
      if (d.finish != FinishReason::kNone) {
        c.finish = d.finish;
        c.error = d.error;
        c.internal = d.internal;
      }
    }
    usage_ = usage;
    done_ = done;
    cv_.notify_all();
  }
  struct Choice {
    std::vector<std::int32_t> ids;
    std::vector<float> logprobs;
    std::string text, error;
    FinishReason finish = FinishReason::kNone;
    bool internal = false;
  };
  void wait() {
    std::unique_lock<std::mutex> lk(mu_);
    ASSERT_TRUE(cv_.wait_for(lk, std::chrono::seconds(120), [&] { return done_; })) << "request timed out";
  }
  const Choice& choice(int i) { return choices_[i]; }
  std::size_t n_choices() const { return choices_.size(); }
  RequestUsage usage() const { return usage_; }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<int, Choice> choices_;
  RequestUsage usage_;
  bool done_ = false;
};

struct Env {
  std::shared_ptr<const model::DecoderModel> model;
  std::shared_ptr<const tok::Tokenizer> tokenizer;
  model::ModelConfig cfg;
};

Env& env() {
  static Env* e = [] {
    auto* x = new Env;
    x->cfg = model::ModelConfig::preset("tiny");
    x->model = model::DecoderModel::from_named(x->cfg, model::random_weights(x->cfg, 5, at::kFloat, 0.1),
                                             at::kFloat, at::kCPU);
    x->tokenizer = std::make_shared<const tok::Tokenizer>(
        tok::Tokenizer::load(std::string(LORASYNC_SHARED_DIR) + "/data/qwen2-tokenizer"));
    return x;
  }();
  return *e;
}

EngineOptions small_opts() {
  EngineOptions o;
  o.served_model_name = "base";
  o.max_model_len = 512;
  o.kv_cache_bytes = 4 << 20;
  o.max_loras = 4;
  o.eos_ids = {151643};
  return o;
}

std::shared_ptr<Collector> run(Engine& e, const std::string& model, std::vector<std::int32_t> prompt,
                               SamplingParams p, const std::string& id) {
  auto c = std::make_shared<Collector>();
  RequestSpec s;
  s.id = id;
  s.model = model;
  s.prompt = std::move(prompt);
  s.params = p;
  s.sink = c;
  e.submit(std::move(s));
  return c;
}

std::vector<std::int32_t> prompt_of(int seed, int len) {
  std::vector<std::int32_t> v;
  for (int i = 0; i < len; ++i) v.push_back((seed * 7919 + i * 104729) % 150000);
  return v;
}

LoadedAdapter make_adapter(const std::string& name, std::uint64_t seed, std::int64_t rank = 2) {
  model::LoraConfig lc;
  lc.rank = rank;
  lc.alpha = 2.0 * static_cast<double>(rank);
  lc.targets = model::LoraConfig::parse_targets({"all-linear"});
  auto a = model::LoraAdapter::init(lc, env().cfg, seed, at::kCPU);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed + 1000);
  for (std::int64_t l = 0; l < a.n_layers(); ++l)
    for (auto m : lc.targets) a.B(l, m).normal_(0, 0.5, gen);
  LoadedAdapter la;
  la.name = name;
  la.path = "/mem/" + name;
  la.sha256 = "sha-" + name + "-" + std::to_string(seed);
  la.weights = std::make_shared<const model::LoraAdapter>(std::move(a));
  return la;
}

TEST(Engine, GreedyMatchesReferenceGenerate) {
  Engine e(env().model, env().tokenizer, small_opts());
  SamplingParams p;
  p.temperature = 0;
  p.max_tokens = 12;
  p.ignore_eos = true;
  p.logprobs = 0;
  auto prompt = prompt_of(1, 37);
  auto c = run(e, "base", prompt, p, "r1");
  c->wait();
  model::GenerateOptions g;
  g.max_new_tokens = 12;
  std::vector<std::int64_t> p64(prompt.begin(), prompt.end());
  auto ref = model::generate(*env().model, nullptr, p64, g);
  ASSERT_EQ(c->choice(0).ids.size(), 12u);
  for (std::size_t i = 0; i < 12; ++i) {
    EXPECT_EQ(c->choice(0).ids[i], ref.ids[i]) << i;
    EXPECT_NEAR(c->choice(0).logprobs[i], ref.logprobs[i], 1e-5) << i;
  }
  EXPECT_EQ(c->choice(0).finish, FinishReason::kLength);
  EXPECT_EQ(c->usage().prompt_tokens, 37);
  EXPECT_EQ(c->usage().completion_tokens, 12);
}

TEST(Engine, SampledLogprobsEqualTrainerLogprobs) {
  Engine e(env().model, env().tokenizer, small_opts());
  e.install_adapter(make_adapter("a1", 3)).get();
  SamplingParams p;
  p.temperature = 0.9;
  p.seed = 11;
  p.max_tokens = 10;
  p.ignore_eos = true;
  auto prompt = prompt_of(2, 20);
  auto c = run(e, "a1", prompt, p, "r");
  c->wait();
  auto ad = make_adapter("a1", 3);
  std::vector<std::int64_t> p64(prompt.begin(), prompt.end()),
      c64(c->choice(0).ids.begin(), c->choice(0).ids.end());
  auto lp = model::completion_logprobs(*env().model, ad.weights.get(), {{p64, c64}}, 0.9);
  for (std::size_t i = 0; i < c64.size(); ++i) EXPECT_NEAR(c->choice(0).logprobs[i], lp[0][i], 1e-4) << i;
}

TEST(Engine, BatchInvarianceAcrossAdaptersAndSeeds) {
  auto opts = small_opts();
  opts.kv_cache_bytes = 16 << 20;
  Engine e(env().model, env().tokenizer, opts);
  for (int i = 0; i < 3; ++i) e.install_adapter(make_adapter("v" + std::to_string(i), 20 + i)).get();
  const std::vector<std::string> models = {"base", "v0", "v1", "v2"};
  auto params_of = [](int i) {
    SamplingParams p;
    p.max_tokens = 8;
    p.ignore_eos = true;
    if (i % 2 == 0) p.temperature = 0;
    else {
      p.temperature = 1.0;
      p.seed = 100 + i;
    }
    return p;
  };
  // Alone, one at a time.
  std::vector<Collector::Choice> alone;
  for (int i = 0; i < 32; ++i) {
    auto c = run(e, models[i % 4], prompt_of(i, 5 + (i * 7) % 40), params_of(i), "alone" + std::to_string(i));
    c->wait();
    alone.push_back(c->choice(0));
  }
  // All 32 at once.
  std::vector<std::shared_ptr<Collector>> cs;
  for (int i = 0; i < 32; ++i)
    cs.push_back(run(e, models[i % 4], prompt_of(i, 5 + (i * 7) % 40), params_of(i), "b" + std::to_string(i)));
  for (int i = 0; i < 32; ++i) {
    cs[static_cast<std::size_t>(i)]->wait();
    const auto& got = cs[static_cast<std::size_t>(i)]->choice(0);
    EXPECT_EQ(got.ids, alone[static_cast<std::size_t>(i)].ids) << "request " << i;
    for (std::size_t k = 0; k < got.logprobs.size() && k < alone[static_cast<std::size_t>(i)].logprobs.size(); ++k)
      EXPECT_NEAR(got.logprobs[k], alone[static_cast<std::size_t>(i)].logprobs[k], 1e-5) << i << "/" << k;
  }
}

TEST(Engine, DecodeGraphStepsGiveTheEagerEnginesTokens) {
  // GraphMode::kAlways on the CPU: every all-decode step runs on the decode graphs' static
  // buffers (padded to its bucket, padding rows on the scratch slot, adapters by slot), as a
  // captured CUDA graph would replay them; kOff runs the engine's own decode batch.
  auto on = small_opts();
  on.kv_cache_bytes = 16 << 20;
  on.graph_mode = EngineOptions::GraphMode::kAlways;
  auto off = on;
  off.graph_mode = EngineOptions::GraphMode::kOff;
  std::int64_t graph_steps = 0;
  auto run_all = [&](const EngineOptions& o) {
    Engine e(env().model, env().tokenizer, o);
    for (int i = 0; i < 3; ++i) e.install_adapter(make_adapter("g" + std::to_string(i), 40 + i)).get();
    const std::vector<std::string> models = {"base", "g0", "g1", "g2"};
    std::vector<std::shared_ptr<Collector>> cs;
    for (int i = 0; i < 13; ++i) {
      SamplingParams p;
      p.max_tokens = 6 + i % 5;
      p.ignore_eos = true;
      p.logprobs = 0;
      if (i % 3 == 0) {
        p.temperature = 0.8;
        p.seed = 7 + i;
      } else {
        p.temperature = 0;
      }
      cs.push_back(run(e, models[static_cast<std::size_t>(i % 4)], prompt_of(50 + i, 3 + (i * 11) % 30), p,
                       "d" + std::to_string(i)));
    }
    std::vector<Collector::Choice> out;
    for (auto& c : cs) {
      c->wait();
      out.push_back(c->choice(0));
    }
    graph_steps = e.stats().decode_graph_steps;
    return out;
  };
  auto want = run_all(off);
  EXPECT_EQ(graph_steps, 0);
  auto got = run_all(on);
  EXPECT_GT(graph_steps, 3);  // the steps after every prompt was in: 7 here
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].ids, want[i].ids) << "request " << i;
    ASSERT_EQ(got[i].logprobs.size(), want[i].logprobs.size()) << i;
    for (std::size_t k = 0; k < got[i].logprobs.size(); ++k)
      EXPECT_NEAR(got[i].logprobs[k], want[i].logprobs[k], 1e-4) << i << "/" << k;
  }
}

TEST(Engine, PrefixCacheKeyedByAdapterAndGroupPrefillsOnce) {
  Engine e(env().model, env().tokenizer, small_opts());
  e.install_adapter(make_adapter("x", 1)).get();
  SamplingParams p;
  p.max_tokens = 3;
  p.temperature = 0;
  p.ignore_eos = true;
  auto prompt = prompt_of(9, 70);  // 4 full blocks + 6
  auto a = run(e, "base", prompt, p, "a");
  a->wait();
  EXPECT_EQ(a->usage().cached_prompt_tokens, 0);
  auto b = run(e, "base", prompt, p, "b");
  b->wait();
  EXPECT_EQ(b->usage().cached_prompt_tokens, 64);
  EXPECT_EQ(b->choice(0).ids, a->choice(0).ids);
  auto x = run(e, "x", prompt, p, "x");  // same tokens, other adapter: no sharing
  x->wait();
  EXPECT_EQ(x->usage().cached_prompt_tokens, 0);
  // A GRPO group: n = 8 computes the prompt once.
  auto before = e.stats();
  SamplingParams g;
  g.n = 8;
  g.max_tokens = 4;
  g.temperature = 1.0;
  g.seed = 5;
  g.ignore_eos = true;
  auto prompt2 = prompt_of(77, 135);
  auto grp = run(e, "x", prompt2, g, "grp");
  grp->wait();
  auto after = e.stats();
  EXPECT_EQ(grp->n_choices(), 8u);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(grp->choice(i).ids.size(), 4u);
  EXPECT_EQ(after.prefill_tokens_computed - before.prefill_tokens_computed, 135);
  EXPECT_EQ(after.fork_shared_tokens - before.fork_shared_tokens, 7 * 135);
  // Members use seed + j: member 3 equals a lone request seeded 8.
  SamplingParams one = g;
  one.n = 1;
  one.seed = 8;
  auto m3 = run(e, "x", prompt2, one, "m3");
  m3->wait();
  EXPECT_EQ(m3->choice(0).ids, grp->choice(3).ids);
}

TEST(Engine, ConcurrentSingleRolloutsOfOnePromptShareItsPrefill) {
  Engine e(env().model, env().tokenizer, small_opts());
  SamplingParams p;
  p.max_tokens = 3;
  p.temperature = 1.0;
  p.ignore_eos = true;
  auto prompt = prompt_of(31, 135);  // 8 full blocks + 7 tokens
  e.pause(PauseMode::kKeep);         // all 8 arrive before the first step
  std::vector<std::shared_ptr<Collector>> cs;
  for (int g = 0; g < 8; ++g) {
    p.seed = static_cast<std::uint64_t>(g);
    cs.push_back(run(e, "base", prompt, p, "g" + std::to_string(g)));
  }
  e.resume();
  std::int64_t cached = 0;
  for (auto& c : cs) {
    c->wait();
    cached += c->usage().cached_prompt_tokens;
  }
  // The first computes 135 prompt tokens; the 7 others reuse its 8 full blocks.
  EXPECT_EQ(cached, 7 * 128);
  EXPECT_LE(e.stats().prefill_tokens_computed, 135 + 7 * 7);
}

TEST(Engine, PreemptionUnderATinyKvPoolLosesNothing) {
  auto opts = small_opts();
  opts.max_model_len = 160;
  // 12 blocks of 16 tokens: one max-length sequence fits, six 100-token sequences do not.
  opts.kv_cache_bytes = model::KvPool::bytes_per_slot(env().cfg, at::kFloat) * 16 * 12;
  Engine e(env().model, env().tokenizer, opts);
  SamplingParams p;
  p.max_tokens = 40;
  p.temperature = 0;
  p.ignore_eos = true;
  std::vector<std::shared_ptr<Collector>> cs;
  for (int i = 0; i < 6; ++i) cs.push_back(run(e, "base", prompt_of(i, 60), p, "p" + std::to_string(i)));
  for (auto& c : cs) c->wait();
  EXPECT_GT(e.stats().preemptions, 0);
  for (int i = 0; i < 6; ++i) {
    model::GenerateOptions g;
    g.max_new_tokens = 40;
    auto pr = prompt_of(i, 60);
    auto ref = model::generate(*env().model, nullptr, std::vector<std::int64_t>(pr.begin(), pr.end()), g);
    EXPECT_EQ(cs[static_cast<std::size_t>(i)]->choice(0).ids,
              std::vector<std::int32_t>(ref.ids.begin(), ref.ids.end())) << i;
  }
}

TEST(Engine, StopConditions) {
  Engine e(env().model, env().tokenizer, small_opts());
  SamplingParams p;
  p.temperature = 0;
  p.max_tokens = 10;
  p.ignore_eos = true;
  auto base = run(e, "base", prompt_of(3, 10), p, "s0");
  base->wait();
  const auto& ids = base->choice(0).ids;
  ASSERT_EQ(ids.size(), 10u);
  // A stop id ends the completion and is included.
  SamplingParams s = p;
  s.stop_token_ids = {ids[3]};
  auto c = run(e, "base", prompt_of(3, 10), s, "s1");
  c->wait();
  auto first = std::find(ids.begin(), ids.end(), ids[3]) - ids.begin();
  EXPECT_EQ(c->choice(0).ids.size(), static_cast<std::size_t>(first + 1));
  EXPECT_EQ(c->choice(0).finish, FinishReason::kStop);
  // A stop string cuts the text before it.
  const std::string full = base->choice(0).text;
  if (full.size() > 4) {
    SamplingParams t = p;
    t.stop = {full.substr(full.size() / 2, 2)};
    auto d = run(e, "base", prompt_of(3, 10), t, "s2");
    d->wait();
    EXPECT_EQ(d->choice(0).finish, FinishReason::kStop);
    EXPECT_EQ(d->choice(0).text, full.substr(0, full.find(t.stop[0])));
  }
  EXPECT_EQ(base->choice(0).text, env().tokenizer->decode(ids, true));
}

TEST(Engine, AdapterLifecycle) {
  auto opts = small_opts();
  opts.max_loras = 2;
  Engine e(env().model, env().tokenizer, opts);
  auto o = e.install_adapter(make_adapter("p1", 1)).get();
  EXPECT_TRUE(o.created);
  EXPECT_FALSE(e.install_adapter(make_adapter("p1", 1)).get().created);  // idempotent
  auto other = make_adapter("p1", 2);
  try {
    e.install_adapter(other).get();
    FAIL();
  } catch (const Error& err) {
    EXPECT_EQ(err.kind(), ErrorKind::kConflict);
  }
  e.install_adapter(make_adapter("p2", 2)).get();
  // Keep p1 busy, unload it: the request finishes with p1, new ones get NotFound.
  e.pause(PauseMode::kKeep);
  SamplingParams p;
  p.max_tokens = 5;
  p.temperature = 0;
  p.ignore_eos = true;
  auto busy = run(e, "p1", prompt_of(1, 12), p, "busy");
  auto busy2 = run(e, "p2", prompt_of(1, 12), p, "busy2");
  EXPECT_EQ(e.unload_adapter("p1").get(), "draining");
  try {
    run(e, "p1", prompt_of(1, 12), p, "late");
    FAIL();
  } catch (const Error& err) {
    EXPECT_EQ(err.kind(), ErrorKind::kNotFound);
  }
  // Both slots hold adapters with requests in flight: a third load is refused, not evicted.
  try {
    e.install_adapter(make_adapter("p3", 3)).get();
    FAIL();
  } catch (const Error& err) {
    EXPECT_EQ(err.kind(), ErrorKind::kUnavailable);
  }
  e.resume();
  busy->wait();
  busy2->wait();
  EXPECT_EQ(busy->choice(0).ids.size(), 5u);
  EXPECT_EQ(busy->choice(0).finish, FinishReason::kLength);
  EXPECT_TRUE(e.install_adapter(make_adapter("p3", 3)).get().created);  // p1's slot was freed
  EXPECT_EQ(e.adapters().size(), 2u);
  try {
    e.unload_adapter("nope").get();
    FAIL();
  } catch (const Error& err) {
    EXPECT_EQ(err.kind(), ErrorKind::kNotFound);
  }
}

TEST(Engine, TwoPhaseLoadStagesInvisiblyCommitsAndReclaimsExpiredSlots) {
  auto opts = small_opts();
  opts.max_loras = 2;
  Engine e(env().model, env().tokenizer, opts);
  SamplingParams p;
  p.max_tokens = 2;
  p.temperature = 0;
  p.ignore_eos = true;
  // Prepared: a slot holds it, nothing sees it.
  EXPECT_TRUE(e.stage_adapter(make_adapter("s1", 1), 60).get().created);
  EXPECT_EQ(e.staged_adapters(), 1);
  EXPECT_TRUE(e.adapters().empty());
  EXPECT_FALSE(e.find_adapter("s1"));
  try {
    run(e, "s1", prompt_of(1, 8), p, "early");
    FAIL();
  } catch (const Error& err) {
    EXPECT_EQ(err.kind(), ErrorKind::kNotFound);
  }
  // Preparing the same content again renews it; other content under the name is refused.
  EXPECT_FALSE(e.stage_adapter(make_adapter("s1", 1), 60).get().created);
  try {
    e.stage_adapter(make_adapter("s1", 2), 60).get();
    FAIL();
  } catch (const Error& err) {
    EXPECT_EQ(err.kind(), ErrorKind::kConflict);
  }
  // Commit: visible and serving; a second commit is a no-op.
  auto c = e.commit_adapter("s1").get();
  EXPECT_TRUE(c.created);
  EXPECT_EQ(c.resident, 1);
  EXPECT_EQ(e.staged_adapters(), 0);
  EXPECT_FALSE(e.commit_adapter("s1").get().created);
  auto out = run(e, "s1", prompt_of(1, 8), p, "served");
  out->wait();
  EXPECT_EQ(out->choice(0).ids.size(), 2u);
  // Preparing a loaded name with its content is a no-op, with other content a conflict.
  EXPECT_FALSE(e.stage_adapter(make_adapter("s1", 1), 60).get().created);
  EXPECT_THROW(e.stage_adapter(make_adapter("s1", 3), 60).get(), Error);
  // Abort frees the slot; aborting again or what was never prepared is harmless; committing
  // what is not prepared is NotFound.
  e.stage_adapter(make_adapter("s2", 2), 60).get();
  EXPECT_EQ(e.abort_staged("s2").get(), "aborted");
  EXPECT_EQ(e.abort_staged("s2").get(), "not_prepared");
  try {
    e.commit_adapter("s2").get();
    FAIL();
  } catch (const Error& err) {
    EXPECT_EQ(err.kind(), ErrorKind::kNotFound);
  }
  // A prepared slot whose commit never came within its deadline is reused by the next load
  // (two slots: s1 resident, s3 prepared with a deadline already past).
  e.stage_adapter(make_adapter("s3", 3), -1).get();
  EXPECT_TRUE(e.install_adapter(make_adapter("s4", 4)).get().created);
  EXPECT_EQ(e.staged_adapters(), 0);
  EXPECT_THROW(e.commit_adapter("s3").get(), Error);
  // While its deadline holds, a prepared slot is not taken: no slot is free.
  EXPECT_EQ(e.unload_adapter("s4").get(), "unloaded");
  e.stage_adapter(make_adapter("s5", 5), 60).get();
  try {
    e.install_adapter(make_adapter("s6", 6)).get();
    FAIL();
  } catch (const Error& err) {
    EXPECT_EQ(err.kind(), ErrorKind::kUnavailable);
  }
}

TEST(Engine, AbortAndPauseAbort) {
  Engine e(env().model, env().tokenizer, small_opts());
  e.pause(PauseMode::kKeep);
  SamplingParams p;
  p.max_tokens = 50;
  p.ignore_eos = true;
  auto a = run(e, "base", prompt_of(1, 8), p, "ab");
  e.abort("ab");
  a->wait();
  EXPECT_EQ(a->choice(0).finish, FinishReason::kAbort);
  p.n = 3;
  auto b = run(e, "base", prompt_of(2, 8), p, "ab2");
  e.pause(PauseMode::kAbort);
  b->wait();
  EXPECT_EQ(b->n_choices(), 3u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(b->choice(i).finish, FinishReason::kAbort);
  EXPECT_TRUE(e.is_paused());
  e.resume();
  EXPECT_FALSE(e.is_paused());
}

TEST(Engine, ValidationNamesTheField) {
  Engine e(env().model, env().tokenizer, small_opts());
  auto expect_param = [&](RequestSpec s, const std::string& param, const std::string& needle) {
    try {
      e.validate(s);
      ADD_FAILURE() << "accepted; expected an error on " << param;
    } catch (const Error& err) {
      EXPECT_EQ(err.param(), param) << err.what();
      EXPECT_NE(std::string(err.what()).find(needle), std::string::npos) << err.what();
    }
  };
  RequestSpec ok;
  ok.model = "base";
  ok.prompt = {1, 2, 3};
  auto s = ok;
  s.params.max_tokens = 0;
  expect_param(s, "max_tokens", "got 0");
  s = ok;
  s.prompt = {1, 999999};
  expect_param(s, "prompt", "999999");
  s = ok;
  s.model = "ghost";
  expect_param(s, "model", "ghost");
  s = ok;
  s.prompt.assign(600, 1);
  expect_param(s, "prompt", "maximum context length is 512");
  s = ok;
  s.params.max_tokens = 510;
  expect_param(s, "max_tokens", "513 tokens");
  s = ok;
  s.params.top_p = 0;
  expect_param(s, "top_p", "(0, 1]");
  s = ok;
  s.params.temperature = -1;
  expect_param(s, "temperature", "-1");
}

// A sink that fails on every delivery (a broken connection bridge): its request must end without
// taking the engine down.
class ThrowingSink : public RequestSink {
 public:
  void on_output(std::vector<ChoiceDelta>, const RequestUsage&, bool) override {
    ++calls;
    throw std::runtime_error("sink broke");
  }
  std::atomic<int> calls{0};
};

TEST(EngineFaults, FailedStepsEndTheirRequestsAsInternalErrorsAndHealthFollows) {
  auto opts = small_opts();
  std::atomic<std::int64_t> fail_from{std::numeric_limits<std::int64_t>::max()};
  opts.before_forward = [&](std::int64_t step) {
    if (step >= fail_from) throw std::runtime_error("boom");
  };
  opts.max_step_failures = 2;
  Engine e(env().model, env().tokenizer, opts);
  EXPECT_TRUE(e.health().healthy);
  // Step 0 prefills and forks; step 1 decodes the three sequences of one group and fails: ending
  // the group at its first sequence frees the other two, which the failure path must not read.
  fail_from = 1;
  SamplingParams p;
  p.max_tokens = 4;
  p.n = 3;
  auto a = run(e, "base", prompt_of(3, 40), p, "fa");
  a->wait();
  ASSERT_EQ(a->n_choices(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(a->choice(i).finish, FinishReason::kError);
    EXPECT_TRUE(a->choice(i).internal);
    EXPECT_NE(a->choice(i).error.find("engine error: boom"), std::string::npos) << a->choice(i).error;
  }
  EXPECT_TRUE(e.alive());
  EXPECT_TRUE(e.health().healthy) << "one failure is not a pattern";
  // Two requests in one failing step: ending one must not read the other's freed sequences.
  p.n = 2;
  fail_from = 0;
  e.pause(PauseMode::kKeep);
  auto b = run(e, "base", prompt_of(4, 20), p, "fb");
  auto c = run(e, "base", prompt_of(5, 20), p, "fc");
  e.resume();
  b->wait();
  c->wait();
  EXPECT_EQ(b->choice(0).finish, FinishReason::kError);
  EXPECT_EQ(c->choice(1).finish, FinishReason::kError);
  auto h = e.health();
  EXPECT_FALSE(h.healthy) << h.consecutive_failures;
  EXPECT_GE(h.consecutive_failures, 2);
  EXPECT_NE(h.reason.find("boom"), std::string::npos) << h.reason;
  // (Stats are published after the outputs are delivered.)
  for (int i = 0; i < 400 && e.stats().step_failures < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_GE(e.stats().step_failures, 2);
  // Recovery: the next step succeeds, health comes back, outputs are the normal ones.
  fail_from = std::numeric_limits<std::int64_t>::max();
  p.n = 1;
  p.temperature = 0;
  auto d = run(e, "base", prompt_of(6, 10), p, "fd");
  d->wait();
  EXPECT_EQ(d->choice(0).finish, FinishReason::kLength);
  EXPECT_EQ(d->choice(0).ids.size(), 4u);
  EXPECT_TRUE(e.health().healthy);
  for (int i = 0; i < 400 && e.stats().running > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(e.stats().running, 0);
  EXPECT_EQ(e.stats().kv_blocks_used, 0) << "failed steps leak no KV blocks";
}

TEST(EngineFaults, AHungStepMakesTheEngineUnhealthyUntilItEnds) {
  auto opts = small_opts();
  std::atomic<bool> hang{false};
  opts.step_timeout_s = 0.2;
  opts.before_forward = [&](std::int64_t) {
    while (hang) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  };
  Engine e(env().model, env().tokenizer, opts);
  hang = true;
  SamplingParams p;
  p.max_tokens = 2;
  auto a = run(e, "base", prompt_of(7, 10), p, "hang");
  // Wait (by condition, not by a fixed sleep) until the watchdog sees the step past its timeout.
  EngineHealth h;
  for (int i = 0; i < 2000 && (h = e.health()).healthy; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_FALSE(h.healthy);
  EXPECT_GT(h.step_running_s, 0.2);
  EXPECT_NE(h.reason.find("running for"), std::string::npos) << h.reason;
  hang = false;
  a->wait();
  EXPECT_TRUE(e.health().healthy);
}

TEST(EngineFaults, AThrowingSinkEndsOnlyItsRequest) {
  Engine e(env().model, env().tokenizer, small_opts());
  auto bad = std::make_shared<ThrowingSink>();
  RequestSpec s;
  s.id = "bad";
  s.model = "base";
  s.prompt = prompt_of(8, 10);
  s.params.max_tokens = 8;
  s.sink = bad;
  e.submit(s);
  SamplingParams p;
  p.max_tokens = 8;
  auto ok = run(e, "base", prompt_of(9, 10), p, "ok");
  ok->wait();
  EXPECT_EQ(ok->choice(0).finish, FinishReason::kLength);
  // The broken request is gone (no sequence left running) and the engine still serves.
  for (int i = 0; i < 400 && e.stats().running + e.stats().waiting > 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(e.stats().running + e.stats().waiting, 0);
  EXPECT_GE(bad->calls.load(), 1);
  EXPECT_TRUE(e.alive());
  auto again = run(e, "base", prompt_of(10, 10), p, "again");
  again->wait();
  EXPECT_EQ(again->choice(0).finish, FinishReason::kLength);
}

TEST(EngineFaults, AdmissionControlRefusesPastTheQueueLimit) {
  auto opts = small_opts();
  opts.max_queued_seqs = 4;
  Engine e(env().model, env().tokenizer, opts);
  e.pause(PauseMode::kKeep);
  SamplingParams p;
  p.max_tokens = 2;
  p.n = 3;
  e.check_capacity(3);
  auto a = run(e, "base", prompt_of(11, 10), p, "q1");
  try {
    e.check_capacity(2);
    ADD_FAILURE() << "a fifth sequence was admitted past max_queued_seqs = 4";
  } catch (const Error& err) {
    EXPECT_EQ(err.kind(), ErrorKind::kUnavailable);
    EXPECT_NE(std::string(err.what()).find("--max-queued-seqs"), std::string::npos) << err.what();
  }
  EXPECT_NO_THROW(e.check_capacity(1));
  EXPECT_EQ(e.stats().rejected_queue_full, 1);
  e.resume();
  a->wait();
  EXPECT_NO_THROW(e.check_capacity(4)) << "completed requests free their places";
}

TEST(AdapterStore, ManifestChecksAndAllowedRoots) {
  TempDir d;
  auto dir = d.path() / "adapters" / "policy-v1";
  auto ad = make_adapter("policy-v1", 4);
  ad.weights->save_peft(dir);
  // No manifest, well-formed PEFT files: loads, identity from the files.
  auto l = read_adapter("policy-v1", dir.string(), {}, env().cfg, 8, at::kCPU);
  EXPECT_EQ(l.sha256.size(), 64u);
  auto digest = write_adapter_manifest(dir, "policy-v1", 1, 0, "tiny", "abc");
  EXPECT_EQ(digest, l.sha256);
  EXPECT_EQ(read_adapter("policy-v1", dir.string(), {}, env().cfg, 8, at::kCPU).sha256, digest);
  // Outside the allowed roots: Forbidden, also through "..".
  try {
    read_adapter("x", (d.path() / "adapters" / ".." / "adapters" / "policy-v1").string(),
                 {(d.path() / "other").string()}, env().cfg, 8, at::kCPU);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kForbidden);
  }
  EXPECT_NO_THROW(read_adapter("x", dir.string(), {(d.path() / "adapters").string()}, env().cfg, 8, at::kCPU));
  // Rank above the limit: InvalidInput naming it.
  try {
    read_adapter("x", dir.string(), {}, env().cfg, 1, at::kCPU);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput);
    EXPECT_NE(std::string(e.what()).find("max_lora_rank"), std::string::npos) << e.what();
  }
  // A file that does not match the manifest: "No adapter found" (it may still be arriving).
  auto st = read_file(dir / "adapter_model.safetensors");
  write_file_atomic(dir / "adapter_model.safetensors", st.substr(0, st.size() / 2));
  try {
    read_adapter("x", dir.string(), {}, env().cfg, 8, at::kCPU);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kNotFound);
    EXPECT_EQ(std::string(e.what()).rfind("No adapter found for", 0), 0u) << e.what();
  }
  try {
    read_adapter("x", (d.path() / "missing").string(), {}, env().cfg, 8, at::kCPU);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kNotFound);
  }
}

// Loads fail closed and never block: what a hostile or broken bucket can put in an adapter
// directory is refused with the reason, within bounded time.
TEST(AdapterStore, HostileDirectoriesAreRefusedNotFollowedOrWaitedOn) {
  TempDir d;
  const fs::path root = d.path() / "adapters";
  auto good = root / "good";
  make_adapter("good", 5).weights->save_peft(good);
  auto expect_refused = [&](const fs::path& dir, ErrorKind kind, const std::string& needle,
                            const AdapterLoadPolicy* pol = nullptr) {
    AdapterLoadPolicy p;
    p.allowed_roots = {root.string()};
    p.max_rank = 8;
    if (pol) p = *pol;
    try {
      read_adapter("x", dir.string(), p, env().cfg, at::kCPU);
      ADD_FAILURE() << dir << " loaded; expected: " << needle;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), kind) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  // A FIFO in place of the weights (no manifest): refused at once, not read forever.
  auto fifo = root / "fifo";
  fs::create_directories(fifo);
  fs::copy_file(good / "adapter_config.json", fifo / "adapter_config.json");
  ASSERT_EQ(::mkfifo((fifo / "adapter_model.safetensors").c_str(), 0600), 0);
  expect_refused(fifo, ErrorKind::kInvalidInput, "is not a regular file");
  // A file that is a symbolic link (to the good weights, or to /dev/zero): refused.
  auto link = root / "link";
  fs::create_directories(link);
  fs::copy_file(good / "adapter_config.json", link / "adapter_config.json");
  fs::create_symlink(good / "adapter_model.safetensors", link / "adapter_model.safetensors");
  expect_refused(link, ErrorKind::kInvalidInput, "symbolic link");
  auto zero = root / "zero";
  fs::create_directories(zero);
  fs::copy_file(good / "adapter_config.json", zero / "adapter_config.json");
  fs::create_symlink("/dev/zero", zero / "adapter_model.safetensors");
  expect_refused(zero, ErrorKind::kInvalidInput, "symbolic link");
  // A directory symlinked out of the root resolves outside it: Forbidden.
  fs::create_directories(d.path() / "elsewhere");
  make_adapter("out", 6).weights->save_peft(d.path() / "elsewhere" / "out");
  fs::create_directory_symlink(d.path() / "elsewhere" / "out", root / "escape");
  expect_refused(root / "escape", ErrorKind::kForbidden, "outside the allowed adapter roots");
  // Oversized files: refused by size before any byte is read.
  auto big = root / "big";
  fs::create_directories(big);
  fs::copy_file(good / "adapter_model.safetensors", big / "adapter_model.safetensors");
  write_file_atomic(big / "adapter_config.json", std::string(2u << 20, ' '));
  expect_refused(big, ErrorKind::kInvalidInput, "more than the 1048576 allowed");
  // A manifest that names another base model: Conflict, with both identities.
  auto other = root / "other-base";
  make_adapter("ob", 7).weights->save_peft(other);
  write_adapter_manifest(other, "ob", 1, 0, "some-other-model", std::string(64, 'a'));
  AdapterLoadPolicy pol;
  pol.allowed_roots = {root.string()};
  pol.max_rank = 8;
  pol.base_sha256 = std::string(64, 'b');
  expect_refused(other, ErrorKind::kConflict, "trained on base model some-other-model", &pol);
  pol.base_sha256 = std::string(64, 'a');
  EXPECT_NO_THROW(read_adapter("x", other.string(), pol, env().cfg, at::kCPU));
  // A manifest entry that is not a plain name.
  auto bad = root / "bad-manifest";
  make_adapter("bm", 8).weights->save_peft(bad);
  write_file_atomic(bad / "manifest.json", R"({"files": {"../good/adapter_config.json": {"bytes": 1, "sha256": ""}}})");
  expect_refused(bad, ErrorKind::kInvalidInput, "invalid file name");
  // Entries and fields of the wrong type: refused with the key (400), not a library exception.
  write_file_atomic(bad / "manifest.json", R"({"files": {"adapter_config.json": {"bytes": "12", "sha256": ""}}})");
  expect_refused(bad, ErrorKind::kInvalidInput, "files.adapter_config.json.bytes");
  write_file_atomic(bad / "manifest.json", R"({"files": {"adapter_config.json": {"bytes": -1, "sha256": ""}}})");
  expect_refused(bad, ErrorKind::kInvalidInput, "non-negative integer");
  write_file_atomic(bad / "manifest.json",
                    R"({"files": {"adapter_config.json": {"bytes": 1, "sha256": ")" + std::string(64, 'a') + R"("}}, "base_model": 3})");
  expect_refused(bad, ErrorKind::kInvalidInput, "base_model must be an object");
  // A manifest cut short while being written: "No adapter found" (retried), not 400.
  write_file_atomic(bad / "manifest.json", R"({"files": {"adapter_config.json": {"by)");
  expect_refused(bad, ErrorKind::kNotFound, "incomplete or invalid");
  // A root that does not exist allows nothing (no lexical fallback).
  AdapterLoadPolicy ghost;
  ghost.allowed_roots = {(d.path() / "no-such-root").string()};
  expect_refused(good, ErrorKind::kForbidden, "outside the allowed adapter roots", &ghost);
  // And the good one still loads.
  AdapterLoadPolicy ok;
  ok.allowed_roots = {root.string()};
  EXPECT_NO_THROW(read_adapter("x", good.string(), ok, env().cfg, at::kCPU));
}

}  // namespace
}  // namespace lorasync::engine
