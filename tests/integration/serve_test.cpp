// Black-box tests of `lorasync serve`: the real binary on a tiny random model and adapters made by
// the foundation code, every endpoint and every documented error, on port 0.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include <thread>

#include "core/model/lora.h"
#include "core/model/model_config.h"
#include "engine/adapter_store.h"
#include "util/child_process.h"
#include "util/files.h"
#include "util/http_client.h"
#include "util/run_command.h"

namespace lorasync {
namespace {

using nlohmann::json;
using testing::http_request;

// The value of the unlabelled series `name` in a /metrics text, -1 when it is absent.
double metric_value(const std::string& text, const std::string& name) {
  const std::string key = "\n" + name + " ";
  const std::size_t at = text.find(key);
  return at == std::string::npos ? -1 : std::stod(text.substr(at + key.size()));
}

struct Fixture {
  TempDir dir{"lorasync-serve"};
  fs::path model, adapters;
  std::unique_ptr<testing::ChildProcess> proc;
  std::uint16_t port = 0;

  Fixture() {
    model = dir.path() / "tiny";
    adapters = dir.path() / "adapters";
    fs::create_directories(adapters);
    auto r = testing::run_lorasync("init-model --preset tiny --seed 2 --init-std 0.1 --output " +
                                   testing::shell_quote(model.string()));
    if (r.exit_code != 0) throw std::runtime_error(r.err);
  }

  // A PEFT adapter (non-zero B) published with a manifest, like the trainer does.
  fs::path make_adapter(const std::string& name, std::uint64_t seed, std::int64_t rank = 2, bool manifest = true) {
    auto cfg = model::ModelConfig::load(model);
    model::LoraConfig lc;
    lc.rank = rank;
    lc.alpha = 2.0 * static_cast<double>(rank);
    lc.targets = model::LoraConfig::parse_targets({"all-linear"});
    auto a = model::LoraAdapter::init(lc, cfg, seed, at::kCPU);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    for (std::int64_t l = 0; l < a.n_layers(); ++l)
      for (auto m : lc.targets) a.B(l, m).normal_(0, 0.3, gen);
    fs::path d = adapters / name;
    a.save_peft(d);
    if (manifest) engine::write_adapter_manifest(d, name, 1, 0, "tiny", "");
    return d;
  }

  std::string shutdown_grace = "5";  // seconds (--shutdown-grace)
  void start(std::vector<std::string> extra = {}, std::vector<std::string> env = {}) {
    std::vector<std::string> argv = {LORASYNC_BINARY, "serve", "--model", model.string(), "--served-model-name",
                                     "tiny", "--port", "0", "--kv-cache-memory", "32MiB", "--max-model-len", "512",
                                     "--max-loras", "3", "--max-lora-rank", "8", "--allowed-adapter-root",
                                     adapters.string(), "--shutdown-grace", shutdown_grace};
    argv.insert(argv.end(), extra.begin(), extra.end());
    proc = std::make_unique<testing::ChildProcess>(argv, env);
    auto line = proc->read_line(60);
    if (!line) throw std::runtime_error("serve did not start: " + proc->stderr_text());
    port = static_cast<std::uint16_t>(json::parse(*line)["port"].get<int>());
  }

  testing::HttpResult post(const std::string& path, const json& body, std::vector<std::string> h = {}) {
    return http_request(port, "POST", path, body.dump(), h);
  }
  testing::HttpResult post_raw(const std::string& path, const std::string& body) {
    return http_request(port, "POST", path, body);
  }
  testing::HttpResult get(const std::string& path) { return http_request(port, "GET", path); }
};

class Serve : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    f_ = new Fixture();
    f_->start();
  }
  static void TearDownTestSuite() { delete f_; }
  static Fixture& f() { return *f_; }
  static Fixture* f_;

  // The error shape and a message naming `needle`, then a healthy server.
  static void expect_error(const testing::HttpResult& r, int status, const std::string& needle,
                           const std::string& param = "") {
    EXPECT_EQ(r.status, status) << r.body;
    auto j = json::parse(r.body, nullptr, false);
    ASSERT_TRUE(j.is_object() && j.contains("error")) << r.body;
    EXPECT_EQ(j["error"]["code"], status);
    EXPECT_NE(j["error"]["message"].get<std::string>().find(needle), std::string::npos) << r.body;
    if (!param.empty()) EXPECT_EQ(j["error"]["param"], param) << r.body;
    EXPECT_EQ(f().get("/health").status, 200) << "server not healthy after an error";
  }
};
Fixture* Serve::f_ = nullptr;

TEST_F(Serve, HealthModelsInfoMetrics) {
  EXPECT_EQ(f().get("/health").status, 200);
  auto m = json::parse(f().get("/v1/models").body);
  EXPECT_EQ(m["object"], "list");
  EXPECT_EQ(m["data"][0]["id"], "tiny");
  EXPECT_EQ(m["data"][0]["max_model_len"], 512);
  auto info = json::parse(f().get("/server_info").body);
  EXPECT_EQ(info["dtype"], "float32");
  EXPECT_EQ(info["lora_config"]["max_loras"], 3);
  EXPECT_EQ(info["lora_config"]["max_lora_rank"], 8);
  EXPECT_EQ(info["kv_cache"]["block_size"], 16);
  auto vinfo = json::parse(f().get("/server_info?config_format=json").body);
  EXPECT_EQ(vinfo["vllm_config"]["lora_config"]["max_loras"], 3);
  auto metrics = f().get("/metrics");
  EXPECT_EQ(metrics.status, 200);
  EXPECT_NE(metrics.body.find("lorasync_server_kv_blocks_used"), std::string::npos);
  EXPECT_NE(metrics.body.find("lorasync_server_time_to_first_token_seconds_bucket"), std::string::npos);
}

TEST_F(Serve, CompletionsTextIdsBatchAndProvenance) {
  auto r = f().post("/v1/completions", {{"model", "tiny"}, {"prompt", "1 + 1 ="}, {"max_tokens", 4},
                                        {"temperature", 0}, {"logprobs", 2}, {"return_token_ids", true}});
  ASSERT_EQ(r.status, 200) << r.body;
  auto j = json::parse(r.body);
  EXPECT_EQ(j["object"], "text_completion");
  auto& c = j["choices"][0];
  EXPECT_EQ(c["token_ids"].size(), 4u);
  EXPECT_EQ(c["logprobs"]["token_logprobs"].size(), 4u);
  EXPECT_EQ(c["logprobs"]["top_logprobs"].size(), 4u);
  EXPECT_FALSE(c["prompt_token_ids"].empty());
  EXPECT_EQ(j["usage"]["completion_tokens"], 4);
  EXPECT_TRUE(j["lorasync"]["adapter"].is_null());
  EXPECT_EQ(j["lorasync"]["base_model_sha256"].get<std::string>().size(), 64u);
  // Token-id prompts and batches: each prompt gets n choices.
  r = f().post("/v1/completions", {{"model", "tiny"}, {"prompt", {{1, 2, 3}, {4, 5}}}, {"max_tokens", 2}, {"n", 2}, {"seed", 1}});
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(json::parse(r.body)["choices"].size(), 4u);
  // Tokenize / detokenize round trip.
  auto t = json::parse(f().post("/tokenize", {{"model", "tiny"}, {"prompt", "Hello, world"}}).body);
  EXPECT_EQ(t["count"], t["tokens"].size());
  auto d = json::parse(f().post("/detokenize", {{"model", "tiny"}, {"tokens", t["tokens"]}}).body);
  EXPECT_EQ(d["prompt"], "Hello, world");
}

TEST_F(Serve, StreamingSseAndChat) {
  auto r = f().post("/v1/completions", {{"model", "tiny"}, {"prompt", {5, 6, 7}}, {"max_tokens", 5}, {"stream", true},
                                        {"temperature", 0}, {"stream_options", {{"include_usage", true}}}});
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(r.headers["content-type"], "text/event-stream");
  auto ev = testing::sse_events(r.body);
  ASSERT_GE(ev.size(), 3u);
  EXPECT_EQ(ev.back(), "[DONE]");
  EXPECT_TRUE(json::parse(ev[ev.size() - 2]).contains("usage"));
  std::string text;
  for (std::size_t i = 0; i + 2 < ev.size(); ++i) text += json::parse(ev[i])["choices"][0]["text"].get<std::string>();
  auto whole = json::parse(f().post("/v1/completions", {{"model", "tiny"}, {"prompt", {5, 6, 7}}, {"max_tokens", 5}, {"temperature", 0}}).body);
  EXPECT_EQ(text, whole["choices"][0]["text"]);
  auto c = f().post("/v1/chat/completions", {{"model", "tiny"}, {"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"max_tokens", 3}});
  ASSERT_EQ(c.status, 200) << c.body;
  auto cj = json::parse(c.body);
  EXPECT_EQ(cj["object"], "chat.completion");
  EXPECT_EQ(cj["choices"][0]["message"]["role"], "assistant");
  EXPECT_TRUE(cj["choices"][0]["logprobs"].is_null());
}

// Chat logprobs come in the chat shape (choices[].logprobs.content[] with token, logprob, bytes,
// top_logprobs), as vLLM and OpenAI return them; the bytes of the tokens make up the message.
TEST_F(Serve, ChatLogprobsInTheChatShape) {
  auto c = f().post("/v1/chat/completions", {{"model", "tiny"}, {"messages", {{{"role", "user"}, {"content", "hi"}}}},
                                             {"max_tokens", 4}, {"temperature", 0}, {"logprobs", true}, {"top_logprobs", 2},
                                             {"ignore_eos", true}});
  ASSERT_EQ(c.status, 200) << c.body;
  auto ch = json::parse(c.body)["choices"][0];
  const auto& content = ch["logprobs"]["content"];
  ASSERT_TRUE(content.is_array()) << ch.dump();
  ASSERT_EQ(content.size(), 4u);
  std::string bytes;
  for (const auto& t : content) {
    EXPECT_TRUE(t["token"].is_string());
    EXPECT_LE(t["logprob"].get<double>(), 0.0);
    ASSERT_TRUE(t["bytes"].is_array());
    for (const auto& b : t["bytes"]) bytes.push_back(static_cast<char>(b.get<int>()));
    ASSERT_EQ(t["top_logprobs"].size(), 2u);
    EXPECT_GE(t["top_logprobs"][0]["logprob"].get<double>(), t["top_logprobs"][1]["logprob"].get<double>());
    EXPECT_TRUE(t["top_logprobs"][0].contains("bytes"));
  }
  EXPECT_EQ(bytes, ch["message"]["content"].get<std::string>());
  // Without top_logprobs each entry still carries an empty list; streaming gives the same shape.
  auto s = f().post("/v1/chat/completions", {{"model", "tiny"}, {"messages", {{{"role", "user"}, {"content", "hi"}}}},
                                             {"max_tokens", 4}, {"temperature", 0}, {"logprobs", true}, {"stream", true},
                                             {"ignore_eos", true}});
  ASSERT_EQ(s.status, 200) << s.body;
  std::size_t streamed = 0;
  for (const auto& e : testing::sse_events(s.body)) {
    if (e == "[DONE]") continue;
    auto j = json::parse(e);
    for (const auto& sc : j["choices"])
      if (sc["logprobs"].is_object())
        for (const auto& t : sc["logprobs"]["content"]) {
          EXPECT_TRUE(t["top_logprobs"].is_array() && t["top_logprobs"].empty());
          ++streamed;
        }
  }
  EXPECT_EQ(streamed, 4u);
  expect_error(f().post("/v1/chat/completions", {{"model", "tiny"}, {"messages", {{{"role", "user"}, {"content", "hi"}}}},
                                                 {"logprobs", true}, {"top_logprobs", -1}}),
               400, "top_logprobs must be in [0, 1000]", "top_logprobs");
}

// A body nested a million levels deep is refused with a 400 before any DOM work (error messages
// used to serialise the value recursively and overflow the io thread's stack), on the completion
// routes and the others; the replica keeps serving.
TEST_F(Serve, DeeplyNestedBodiesAreRefusedAndTheReplicaSurvives) {
  const std::string deep = std::string(1000000, '[') + std::string(1000000, ']');
  for (const char* path : {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
                           "/v1/load_lora_adapter"}) {
    auto r = f().post_raw(path, std::string(R"({"model": )") + deep + "}");
    EXPECT_EQ(r.status, 400) << path << ": " << r.body.substr(0, 300);
    EXPECT_NE(r.body.find("deeper than 64 levels"), std::string::npos) << path << ": " << r.body.substr(0, 300);
  }
  // A shallow container in a wrong field is described, not dumped.
  expect_error(f().post("/v1/completions", {{"model", "tiny"}, {"prompt", "x"}, {"seed", {{"a", 1}, {"b", 2}}}}), 400,
               "seed must be an integer, got an object of 2 keys", "seed");
  auto ok = f().post("/v1/completions", {{"model", "tiny"}, {"prompt", {1, 2}}, {"max_tokens", 2}});
  EXPECT_EQ(ok.status, 200) << ok.body;
}

TEST_F(Serve, DocumentedErrors) {
  expect_error(f().post_raw("/v1/completions", "{not json"), 400, "not valid JSON");
  expect_error(f().post("/v1/completions", {{"model", "tiny"}, {"prompt", "x"}, {"temperature", "hot"}}), 400,
               "temperature must be a number", "temperature");
  expect_error(f().post("/v1/completions", {{"model", "tiny"}, {"prompt", "x"}, {"max_tokens", 0}}), 400,
               "max_tokens must be at least 1, got 0", "max_tokens");
  expect_error(f().post("/v1/completions", {{"model", "nope"}, {"prompt", "x"}}), 404, "nope", "model");
  expect_error(f().post("/v1/completions", {{"prompt", "x"}}), 400, "model is required", "model");
  std::vector<int> long_prompt(600, 7);
  expect_error(f().post("/v1/completions", {{"model", "tiny"}, {"prompt", long_prompt}}), 400,
               "maximum context length is 512", "prompt");
  expect_error(f().post("/v1/completions", {{"model", "tiny"}, {"prompt", {1, 99999999}}}), 400,
               "outside the vocabulary", "prompt");
  expect_error(f().post("/v1/completions", {{"model", "tiny"}, {"prompt", {1, -5}}}), 400, "-5", "prompt");
  expect_error(f().get("/v1/nothing"), 404, "no route");
  expect_error(f().get("/v1/completions"), 405, "not allowed");
  // Adapters.
  auto outside = f().dir.path() / "elsewhere";
  fs::create_directories(outside);
  expect_error(f().post("/v1/load_lora_adapter", {{"lora_name", "a"}, {"lora_path", outside.string()}}), 403,
               "outside the allowed adapter roots", "lora_path");
  expect_error(f().post("/v1/load_lora_adapter", {{"lora_name", "a"}, {"lora_path", (f().adapters / "missing").string()}}),
               404, "No adapter found for");
  auto big = f().make_adapter("big-rank", 3, 16);
  expect_error(f().post("/v1/load_lora_adapter", {{"lora_name", "big"}, {"lora_path", big.string()}}), 400,
               "max_lora_rank 8");
  expect_error(f().post("/v1/load_lora_adapter", {{"lora_path", big.string()}}), 400, "lora_name", "lora_name");
  expect_error(f().post("/v1/unload_lora_adapter", {{"lora_name", "never-loaded"}}), 404, "never-loaded");
  auto a1 = f().make_adapter("e1", 4);
  auto a2 = f().make_adapter("e2", 5);
  auto first = f().post("/v1/load_lora_adapter", {{"lora_name", "dup"}, {"lora_path", a1.string()}});
  ASSERT_EQ(first.status, 200);
  EXPECT_EQ(json::parse(first.body)["created"], true);
  auto again = f().post("/v1/load_lora_adapter", {{"lora_name", "dup"}, {"lora_path", a1.string()}});
  EXPECT_EQ(again.status, 200);
  EXPECT_EQ(json::parse(again.body)["created"], false);  // idempotent: the proxy keeps it on a rollback
  expect_error(f().post("/v1/load_lora_adapter", {{"lora_name", "dup"}, {"lora_path", a2.string()}}), 409,
               "immutable", "lora_name");
  EXPECT_EQ(f().post("/v1/unload_lora_adapter", {{"lora_name", "dup"}}).status, 200);
}

TEST_F(Serve, AdapterServingMatchesTrainerLogprobs) {
  auto dir = f().make_adapter("policy-v1", 11);
  auto l = f().post("/v1/load_lora_adapter", {{"lora_name", "policy-v1"}, {"lora_path", dir.string()}});
  ASSERT_EQ(l.status, 200) << l.body;
  auto lj = json::parse(l.body);
  EXPECT_EQ(lj["rank"], 2);
  auto models = json::parse(f().get("/v1/models").body);
  bool listed = false;
  for (const auto& m : models["data"]) listed |= m["id"] == "policy-v1" && m["parent"] == "tiny";
  EXPECT_TRUE(listed);
  auto r = f().post("/v1/completions", {{"model", "policy-v1"}, {"prompt", {11, 12, 13, 14}}, {"max_tokens", 8},
                                        {"temperature", 1.0}, {"seed", 9}, {"logprobs", 0}, {"return_token_ids", true},
                                        {"ignore_eos", true}});
  ASSERT_EQ(r.status, 200) << r.body;
  auto j = json::parse(r.body);
  EXPECT_EQ(j["lorasync"]["adapter"], "policy-v1");
  EXPECT_EQ(j["lorasync"]["adapter_sha256"], lj["adapter_sha256"]);
  std::string ids;
  for (const auto& v : j["choices"][0]["token_ids"]) ids += (ids.empty() ? "" : ",") + std::to_string(v.get<int>());
  auto cmd = testing::run_lorasync("logprobs --model " + testing::shell_quote(f().model.string()) + " --adapter " +
                                   testing::shell_quote(dir.string()) + " --prompt-ids 11,12,13,14 --completion-ids " + ids);
  ASSERT_EQ(cmd.exit_code, 0) << cmd.err;
  auto ref = json::parse(cmd.out)["logprobs"];
  auto got = j["choices"][0]["logprobs"]["token_logprobs"];
  ASSERT_EQ(ref.size(), got.size());
  for (std::size_t i = 0; i < ref.size(); ++i) EXPECT_NEAR(got[i].get<double>(), ref[i].get<double>(), 1e-4) << i;
  // The same prompt under the base model and under the adapter never shares prefix blocks.
  std::vector<int> prompt(70, 3);
  json req = {{"model", "policy-v1"}, {"prompt", prompt}, {"max_tokens", 1}};
  f().post("/v1/completions", req);
  EXPECT_EQ(json::parse(f().post("/v1/completions", req).body)["usage"]["cached_prompt_tokens"], 64);
  req["model"] = "tiny";
  EXPECT_EQ(json::parse(f().post("/v1/completions", req).body)["usage"]["cached_prompt_tokens"], 0);
  // A GRPO group (n = 8) prefills once: the fork counter grows by 7 prompts (7 x 40 tokens).
  const double before = metric_value(f().get("/metrics").body, "lorasync_server_fork_shared_tokens_total");
  auto g = f().post("/v1/completions", {{"model", "policy-v1"}, {"prompt", std::vector<int>(40, 9)}, {"max_tokens", 2}, {"n", 8}, {"seed", 1}});
  ASSERT_EQ(g.status, 200);
  EXPECT_EQ(json::parse(g.body)["choices"].size(), 8u);
  const double after = metric_value(f().get("/metrics").body, "lorasync_server_fork_shared_tokens_total");
  ASSERT_GE(before, 0) << "no lorasync_server_fork_shared_tokens_total in /metrics";
  EXPECT_EQ(after - before, 7 * 40);
  EXPECT_EQ(f().post("/v1/unload_lora_adapter", {{"lora_name", "policy-v1"}}).status, 200);
  expect_error(f().post("/v1/completions", {{"model", "policy-v1"}, {"prompt", {1}}}), 404, "policy-v1");
}

// The vLLM shapes TRL's AsyncGRPOTrainer client reads (trl/experimental/async_grpo/vllm_client.py
// and async_rollout_worker.py), each as TRL sends it; tests/conformance/test_trl_async_grpo.py
// runs TRL itself.
TEST_F(Serve, TrlAsyncGrpoClientShapes) {
  auto ws = f().get("/get_world_size");
  ASSERT_EQ(ws.status, 200) << ws.body;
  EXPECT_EQ(json::parse(ws.body)["world_size"], 1);
  auto v = json::parse(f().get("/server_info?config_format=json").body)["vllm_config"];
  EXPECT_EQ(v["model_config"]["dtype"], "float32");
  EXPECT_EQ(v["parallel_config"]["data_parallel_size"], 1);
  EXPECT_EQ(v["lora_config"]["max_lora_rank"], 8);
  // Generation: token-id prompt, return_token_ids, logprobs 0, top_k 0 (off), a 63-bit seed.
  json gen = {{"model", "tiny"}, {"prompt", {5, 6, 7}}, {"max_tokens", 4}, {"temperature", 1.0}, {"top_p", 1.0},
              {"top_k", 0}, {"repetition_penalty", 1.0}, {"n", 1}, {"return_token_ids", true}, {"logprobs", 0},
              {"seed", 9223372036854775807LL}, {"ignore_eos", true}};
  auto r = f().post("/v1/completions", gen);
  ASSERT_EQ(r.status, 200) << r.body;
  auto c = json::parse(r.body)["choices"][0];
  EXPECT_EQ(c["token_ids"].size(), 4u);
  EXPECT_EQ(c["logprobs"]["token_logprobs"].size(), 4u);
  // Adapter loads carry vLLM's load_inplace flag (TRL sends false); a non-boolean is named.
  auto dir = f().make_adapter("trl-policy-v1", 21);
  json load = {{"lora_name", "trl-policy-v1"}, {"lora_path", dir.string()}, {"load_inplace", false}};
  EXPECT_EQ(f().post("/v1/load_lora_adapter", load).status, 200);
  load["load_inplace"] = true;  // the same content again: already loaded
  EXPECT_EQ(f().post("/v1/load_lora_adapter", load).status, 200);
  load["load_inplace"] = "yes";
  expect_error(f().post("/v1/load_lora_adapter", load), 400, "load_inplace must be a boolean", "load_inplace");
  EXPECT_EQ(f().post("/v1/unload_lora_adapter", {{"lora_name", "trl-policy-v1"}}).status, 200);
}

// Amplification limits (issue 16): what one request may ask of the engine is bounded and each
// refusal names the field; an int64-sized max_tokens is a 400, not an overflow.
TEST_F(Serve, RequestLimitsAreEnforcedAndNamed) {
  expect_error(f().post("/v1/completions", {{"model", "tiny"}, {"prompt", "x"}, {"n", 1025}}), 400, "n must be in [1, 1024]",
               "n");
  std::vector<std::vector<int>> prompts(5, std::vector<int>{1, 2});
  expect_error(f().post("/v1/completions", {{"model", "tiny"}, {"prompt", prompts}, {"n", 1000}}), 400,
               "at most 4096 per request", "prompt");
  std::vector<std::string> stops(33, "zz");
  expect_error(f().post("/v1/completions", {{"model", "tiny"}, {"prompt", "x"}, {"stop", stops}}), 400,
               "at most 32 stop strings", "stop");
  expect_error(f().post("/v1/completions", {{"model", "tiny"}, {"prompt", "x"}, {"stop", std::string(1025, 'a')}}), 400,
               "at most 1024 bytes", "stop");
  expect_error(f().post("/v1/completions", {{"model", "tiny"}, {"prompt", "x"}, {"stop_token_ids", std::vector<int>(257, 1)}}),
               400, "at most 256 stop_token_ids", "stop_token_ids");
  expect_error(f().post_raw("/v1/completions", R"({"model": "tiny", "prompt": [1, 2], "max_tokens": 9223372036854775807})"),
               400, "maximum context length is 512", "max_tokens");
  // Unknown paths (scans, typos) share one metrics series; the label never holds client bytes.
  f().get("/no/such/path-evil");
  f().get("/another/unknown");
  auto metrics = f().get("/metrics").body;
  EXPECT_EQ(metrics.find("evil"), std::string::npos);
  EXPECT_EQ(metrics.find("/another/unknown"), std::string::npos);
  EXPECT_NE(metrics.find("route=\"other\",code=\"404\""), std::string::npos) << metrics;
}

TEST_F(Serve, PauseResumeAndResetPrefixCache) {
  EXPECT_EQ(f().post("/pause?mode=keep", json::object()).status, 200);
  EXPECT_EQ(json::parse(f().get("/is_paused").body)["is_paused"], true);
  // A request sent while paused waits, then completes after resume.
  testing::HttpResult late;
  std::thread t([&] { late = f().post("/v1/completions", {{"model", "tiny"}, {"prompt", {1, 2}}, {"max_tokens", 2}}); });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_EQ(late.status, 0);  // still waiting
  EXPECT_EQ(f().post("/resume", json::object()).status, 200);
  t.join();
  EXPECT_EQ(late.status, 200);
  EXPECT_EQ(json::parse(f().get("/is_paused").body)["is_paused"], false);
  expect_error(f().post("/pause?mode=sideways", json::object()), 400, "mode");
  f().post("/resume", json::object());
  EXPECT_EQ(f().post("/reset_prefix_cache", json::object()).status, 200);
}

TEST(ServeAuth, ApiKeyAndGracefulShutdown) {
  Fixture fx;
  fx.start({"--api-key", "sekret"});
  EXPECT_EQ(fx.get("/health").status, 200);  // open
  auto r = fx.post("/v1/completions", {{"model", "tiny"}, {"prompt", {1}}, {"max_tokens", 1}});
  EXPECT_EQ(r.status, 401);
  EXPECT_EQ(r.headers["www-authenticate"], "Bearer");
  r = fx.post("/v1/completions", {{"model", "tiny"}, {"prompt", {1}}, {"max_tokens", 1}}, {"Authorization: Bearer wrong"});
  EXPECT_EQ(r.status, 401);
  r = fx.post("/v1/completions", {{"model", "tiny"}, {"prompt", {1}}, {"max_tokens", 1}}, {"Authorization: Bearer sekret"});
  EXPECT_EQ(r.status, 200) << r.body;
  // SIGTERM while a long request runs: it finishes within the grace period, then the exit is clean.
  testing::HttpResult longr;
  std::thread t([&] {
    longr = fx.post("/v1/completions", {{"model", "tiny"}, {"prompt", {1, 2}}, {"max_tokens", 200}, {"ignore_eos", true}},
                    {"Authorization: Bearer sekret"});
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  fx.proc->kill(SIGTERM);
  t.join();
  EXPECT_EQ(longr.status, 200) << longr.body;
  EXPECT_EQ(json::parse(longr.body)["usage"]["completion_tokens"], 200);
  EXPECT_EQ(fx.proc->wait_exit(30), std::optional<int>(0)) << fx.proc->stderr_text();
}

// A raw keep-alive connection: several requests, each answer read by its Content-Length.
class KeepAlive {
 public:
  explicit KeepAlive(std::uint16_t port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    timeval tv{60, 0};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) throw std::runtime_error("connect failed");
  }
  ~KeepAlive() { ::close(fd_); }
  // Sends a GET and returns the status line and headers and body ("" + status 0 when the
  // connection ended without an answer).
  testing::HttpResult get(const std::string& path) {
    std::string req = "GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
    if (::send(fd_, req.data(), req.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(req.size())) return {};
    testing::HttpResult r;
    std::size_t hdr_end;
    while ((hdr_end = buf_.find("\r\n\r\n")) == std::string::npos)
      if (!fill()) return r;
    const std::string head = buf_.substr(0, hdr_end);
    r.status = std::atoi(head.c_str() + head.find(' ') + 1);
    for (std::size_t p = head.find("\r\n"); p != std::string::npos;) {
      auto next = head.find("\r\n", p + 2);
      auto line = head.substr(p + 2, next == std::string::npos ? std::string::npos : next - p - 2);
      if (auto c = line.find(':'); c != std::string::npos)
        r.headers[testing::lower(line.substr(0, c))] = line.substr(line.find_first_not_of(' ', c + 1));
      p = next;
    }
    const std::size_t len = std::stoul(r.headers["content-length"]);
    while (buf_.size() < hdr_end + 4 + len)
      if (!fill()) return {};
    r.body = buf_.substr(hdr_end + 4, len);
    buf_.erase(0, hdr_end + 4 + len);
    return r;
  }

 private:
  bool fill() {
    char b[4096];
    ssize_t n = ::recv(fd_, b, sizeof b, 0);
    if (n <= 0) return false;
    buf_.append(b, static_cast<std::size_t>(n));
    return true;
  }
  int fd_;
  std::string buf_;
};

TEST(ServeFaults, EngineFailuresAnswer500AndHealthFollowsTheEngine) {
  Fixture fx;
  // Step 0 hangs for 2 s (past --step-timeout 0.5); steps 1-3 fail; step 4 on are normal.
  fx.start({"--step-timeout", "0.5"}, {"LORASYNC_FAULTS=step_hang=0:2,step_fail=1:3"});
  const json one = {{"model", "tiny"}, {"prompt", {1, 2, 3}}, {"max_tokens", 1}};
  testing::HttpResult slow;
  std::thread t([&] { slow = fx.post("/v1/completions", one); });
  testing::HttpResult h;
  for (int i = 0; i < 400 && (h = fx.get("/health")).status == 200; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(h.status, 503);
  EXPECT_NE(h.body.find("running for"), std::string::npos) << h.body;
  t.join();
  EXPECT_EQ(slow.status, 200) << slow.body;
  // The engine thread marks the step ended just after it hands out the step's outputs: the slow
  // answer can arrive a moment before /health turns back to 200.
  int after = 0;
  for (int i = 0; i < 200 && (after = fx.get("/health").status) != 200; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(after, 200) << "the step ended";
  for (int i = 0; i < 3; ++i) {
    auto r = fx.post("/v1/completions", one);
    EXPECT_EQ(r.status, 500) << r.body;
    EXPECT_NE(r.body.find("injected fault at step"), std::string::npos) << r.body;
    EXPECT_NE(r.body.find("internal_server_error"), std::string::npos) << r.body;
  }
  h = fx.get("/health");
  EXPECT_EQ(h.status, 503) << "three failed steps in a row";
  EXPECT_NE(h.body.find("engine steps failed"), std::string::npos) << h.body;
  bool counted = false;  // (stats are published just after the outputs)
  for (int i = 0; i < 200 && !counted; ++i) {
    counted = fx.get("/metrics").body.find("lorasync_server_engine_step_failures_total 3\n") != std::string::npos;
    if (!counted) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(counted);
  auto ok = fx.post("/v1/completions", one);
  EXPECT_EQ(ok.status, 200) << ok.body;
  EXPECT_EQ(fx.get("/health").status, 200) << "a good step ends the failure streak";
  EXPECT_FALSE(fx.proc->wait_exit(0).has_value()) << "the replica still runs";
}

TEST(ServeFaults, AFullQueueAnswers429WithRetryAfter) {
  Fixture fx;
  fx.start({"--max-queued-seqs", "2"});
  ASSERT_EQ(fx.post("/pause?mode=keep", json::object()).status, 200);
  testing::HttpResult first;
  std::thread t([&] {
    first = fx.post("/v1/completions", {{"model", "tiny"}, {"prompt", {1, 2}}, {"max_tokens", 2}, {"n", 2}});
  });
  // The first request is queued (paused engine) once the waiting gauge shows it.
  for (int i = 0; i < 400; ++i) {
    if (fx.get("/metrics").body.find("lorasync_server_requests_waiting 1\n") != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  auto r = fx.post("/v1/completions", {{"model", "tiny"}, {"prompt", {3}}, {"max_tokens", 1}});
  EXPECT_EQ(r.status, 429) << r.body;
  EXPECT_EQ(r.headers["retry-after"], "1");
  EXPECT_NE(r.body.find("--max-queued-seqs"), std::string::npos) << r.body;
  ASSERT_EQ(fx.post("/resume", json::object()).status, 200);
  t.join();
  EXPECT_EQ(first.status, 200) << first.body;
  EXPECT_EQ(fx.post("/v1/completions", {{"model", "tiny"}, {"prompt", {3}}, {"max_tokens", 1}}).status, 200);
}

TEST(ServeFaults, OversizedBodiesGetTheir413AndShutdownAnswersKeepAliveRequests) {
  Fixture fx;
  // A grace period no loaded machine outlasts: the in-flight request must finish within it, and
  // the keep-alive probe must land inside it (the bounds below only turn a hang into a failure).
  fx.shutdown_grace = "60";
  fx.start({"--max-body-bytes", "65536"});
  // 8 MiB against a 64 KiB limit: the client is still sending when the server answers; the answer
  // must survive (no reset from closing with unread input).
  std::string big(8u << 20, ' ');
  big.front() = '{';
  big.back() = '}';
  auto r = fx.post_raw("/v1/completions", big);
  EXPECT_EQ(r.status, 413) << r.body;
  EXPECT_NE(r.body.find("65536"), std::string::npos) << r.body;
  // Shutdown: a keep-alive connection that asks again during the grace period gets a 503 with
  // Connection: close, not silence.
  KeepAlive ka(fx.port);
  EXPECT_EQ(ka.get("/health").status, 200);
  testing::HttpResult longr;
  std::thread t([&] {
    longr = fx.post("/v1/completions", {{"model", "tiny"}, {"prompt", {1, 2}}, {"max_tokens", 200}, {"ignore_eos", true}});
  });
  for (int i = 0; i < 3000; ++i) {
    if (fx.get("/metrics").body.find("lorasync_server_requests_running 1\n") != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  fx.proc->kill(SIGTERM);
  // The listener closes at once; probe the keep-alive connection until the server is stopping.
  testing::HttpResult late;
  for (int i = 0; i < 3000; ++i) {
    late = ka.get("/health");
    if (late.status != 200) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(late.status, 503) << late.body;
  EXPECT_EQ(testing::lower(late.headers["connection"]), "close");
  EXPECT_EQ(late.headers["retry-after"], "1");
  t.join();
  EXPECT_EQ(longr.status, 200) << "the in-flight request still finishes";
  EXPECT_EQ(fx.proc->wait_exit(90), std::optional<int>(0)) << fx.proc->stderr_text();
}

}  // namespace
}  // namespace lorasync
