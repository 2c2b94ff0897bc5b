// The stub replicas answer completions as `lorasync serve` does: for the trace's requests, the
// body the stub writes (bench/proxy/completion_body.h) equals, byte for byte, what serve's
// response writer (server::CompletionState::final_json) renders for the same generated tokens,
// and the trainer's reading of it (nlohmann, the fields src/rl/pipeline.cpp checks) finds
// max_tokens ids and logprobs per choice.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "bench/proxy/completion_body.h"
#include "bench/proxy/grpo_trace.h"
#include "server/openai.h"

namespace lorasync::bench {
namespace {

std::string serve_body(const CompletionAsk& ask, const CompletionMeta& meta, std::uint64_t seed) {
  server::ParsedCompletion pc;
  pc.model = ask.model;
  pc.prompts.emplace_back(ask.prompt_ids.begin(), ask.prompt_ids.end());
  pc.params.n = ask.n;
  pc.params.max_tokens = ask.max_tokens;
  if (ask.logprobs) pc.params.logprobs = 0;
  pc.return_token_ids = ask.return_token_ids;
  server::Provenance prov;
  if (!meta.adapter.empty()) {
    prov.adapter = meta.adapter;
    prov.adapter_sha256 = meta.adapter_sha256;
  }
  prov.base_model_sha256 = meta.base_model_sha256;
  server::CompletionState state(meta.id, meta.created, pc, prov, nullptr);
  std::vector<engine::ChoiceDelta> deltas;
  for (int c = 0; c < ask.n; ++c) {
    engine::ChoiceDelta d;
    d.index = c;
    for (int k = 0; k < ask.max_tokens; ++k) {
      const GenToken t = generated_token(seed, static_cast<std::size_t>(c), static_cast<std::size_t>(k));
      engine::TokenOut out;
      out.id = t.id;
      out.logprob = t.logprob;
      out.text = std::string(t.text);
      d.text += out.text;
      d.tokens.push_back(std::move(out));
    }
    d.finish = engine::FinishReason::kLength;
    deltas.push_back(std::move(d));
  }
  engine::RequestUsage u;
  u.prompt_tokens = static_cast<std::int64_t>(meta.prompt_tokens);
  u.cached_prompt_tokens = static_cast<std::int64_t>(meta.cached_prompt_tokens);
  u.completion_tokens = static_cast<std::int64_t>(ask.n) * ask.max_tokens;
  state.add(0, deltas, u, true);
  return state.final_json();
}

CompletionMeta meta_for(const CompletionAsk& ask, std::uint64_t cached) {
  CompletionMeta m;
  m.id = "cmpl-stub0-7";
  m.created = 1767225600;
  m.adapter = ask.model;
  m.adapter_sha256 = std::string(64, 'a');
  m.base_model_sha256 = std::string(64, 'b');
  m.prompt_tokens = ask.prompt_ids.size();
  m.cached_prompt_tokens = cached;
  return m;
}

TEST(StubBody, TraceRequestsAnswerAsServeDoes) {
  TraceOptions to;
  to.prompts = 3;
  const auto trace = make_grpo_trace(to);
  ASSERT_FALSE(trace.empty());
  for (std::size_t i = 0; i < trace.size(); i += to.group) {
    CompletionAsk ask = read_completion_ask(trace[i].body);
    ask.model = trace[i].adapter;
    const nlohmann::json req = nlohmann::json::parse(trace[i].body);
    EXPECT_EQ(ask.n, 1);
    EXPECT_EQ(ask.max_tokens, 256);
    EXPECT_TRUE(ask.logprobs);
    EXPECT_TRUE(ask.return_token_ids);
    EXPECT_EQ(ask.prompt_ids, req["prompt"].get<std::vector<std::int64_t>>());
    const CompletionMeta meta = meta_for(ask, 32);
    const std::string stub = completion_body(ask, meta, 11 + i);
    EXPECT_EQ(stub, serve_body(ask, meta, 11 + i));
    // What the trainer reads of it.
    const nlohmann::json j = nlohmann::json::parse(stub);
    ASSERT_EQ(j["choices"].size(), 1u);
    const auto& c = j["choices"][0];
    EXPECT_EQ(c["token_ids"].size(), 256u);
    EXPECT_EQ(c["logprobs"]["token_logprobs"].size(), 256u);
    for (const auto& x : c["logprobs"]["token_logprobs"]) EXPECT_LE(x.get<double>(), 0.0);
    EXPECT_EQ(c["prompt_token_ids"], req["prompt"]);
    EXPECT_EQ(j["lorasync"]["adapter"], trace[i].adapter);
    EXPECT_EQ(j["usage"]["cached_prompt_tokens"], 32);
    // Per choice, a GRPO answer of 256 tokens is kilobytes, not the ~150 bytes the stubs once sent.
    EXPECT_GT(stub.size(), 4000u);
  }
}

TEST(StubBody, SeveralChoicesPlainAndBaseModel) {
  for (const bool lp : {false, true}) {
    CompletionAsk ask = read_completion_ask(R"({"model":"base","prompt":[1, 2,3],"n":4,"max_tokens":7)" +
                                            std::string(lp ? R"(,"logprobs":0)" : "") + "}");
    ask.model = "base";
    EXPECT_EQ(ask.n, 4);
    EXPECT_EQ(ask.max_tokens, 7);
    EXPECT_EQ(ask.logprobs, lp);
    EXPECT_FALSE(ask.return_token_ids);
    EXPECT_EQ(ask.prompt_ids, (std::vector<std::int64_t>{1, 2, 3}));
    CompletionMeta meta = meta_for(ask, 0);
    meta.adapter.clear();
    EXPECT_EQ(completion_body(ask, meta, 5), serve_body(ask, meta, 5));
  }
}

TEST(StubBody, TableIsJson) {
  const nlohmann::json t = nlohmann::json::parse(generation_table_json());
  EXPECT_EQ(t["tokens"].size(), 512u);
  EXPECT_EQ(t["logprobs"].size(), 509u);
}

}  // namespace
}  // namespace lorasync::bench
