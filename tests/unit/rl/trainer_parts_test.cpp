// Unit tests of the trainer's parts (trainer.md §9): version names; the seeded epoch permutation;
// checkpoint round trip bit-exact and incomplete checkpoints skipped; Prometheus text; the server
// capability probe. The pipeline's own tests are in pipeline_test.cpp (libtorch-free, sanitized).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <set>

#include "core/model/model_config.h"
#include "core/tokenizer/tokenizer.h"
#include "reward/reward_fn.h"
#include "rl/checkpoint.h"
#include "rl/metrics_endpoint.h"
#include "rl/pipeline.h"
#include "rl_groups.h"
#include "rl/server_caps.h"
#include "util/error.h"
#include "util/files.h"

namespace lorasync::rl {
namespace {

TEST(TrainerParts, VersionNamesAndPermutations) {
  EXPECT_EQ(parse_version_name("policy-v12", "policy"), 12);
  EXPECT_FALSE(parse_version_name("policy-v012", "policy"));
  EXPECT_FALSE(parse_version_name("policy-v", "policy"));
  EXPECT_FALSE(parse_version_name("other-v3", "policy"));
  EXPECT_FALSE(parse_version_name("policy-v3x", "policy"));
  EXPECT_FALSE(parse_version_name("policy-v99999999999999999999", "policy"));
  auto a = epoch_permutation(100, 42, 0, true), b = epoch_permutation(100, 42, 0, true), c = epoch_permutation(100, 42, 1, true);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  std::set<std::int64_t> s(a.begin(), a.end());
  EXPECT_EQ(s.size(), 100u);
  EXPECT_EQ(epoch_permutation(5, 42, 3, false), (std::vector<std::int64_t>{0, 1, 2, 3, 4}));
}

TEST(TrainerParts, CheckpointRoundTripIsBitExact) {
  TempDir dir("lorasync-ckpt");
  auto mc = model::ModelConfig::preset("tiny");
  model::LoraConfig lc;
  lc.rank = 2;
  lc.alpha = 4;
  lc.targets = model::LoraConfig::parse_targets({"all-linear"});
  auto adapter = model::LoraAdapter::init(lc, mc, 3, torch::kCPU);
  for (auto& t : adapter.parameters()) t.normal_();
  CheckpointData d;
  d.step = 7;
  d.adapter = &adapter;
  for (auto& t : adapter.parameters()) {
    d.exp_avg.push_back(torch::randn_like(t));
    d.exp_avg_sq.push_back(torch::rand_like(t));
  }
  d.version_tensors[3] = adapter.parameters();
  d.groups = {make_group(1, 3, 2), make_group(2, 3, 2)};
  d.groups[1].scored = false;
  d.groups[1].members[2].reward = std::nan("");
  // An episode's member: its own prompt, a mask over the environment's tokens, versions per token.
  {
    Member& e = d.groups[0].members[1];
    e.ids = {10, 11, 12, 300, 301, 13};
    e.logprobs = {-0.5f, -1.0f, -0.25f, 0.0f, 0.0f, -2.0f};
    e.mask = {1, 1, 1, 0, 0, 1};
    e.versions = {3, 3, 3, 3, 3, 4};
    e.prompt_ids = {1, 2, 3, 4, 5};
    e.turns = 2;
    d.groups[0].prescored = true;
  }
  d.state = {{"cursor", cursor_to_json(Cursor{1, 5, {4, 3, 2, 1, 0}, {{7, 1, 2}}})}};
  const auto ck = dir.path() / "checkpoints";
  auto p1 = write_checkpoint(ck, d, 3);
  EXPECT_EQ(p1.filename(), "step-000007");
  EXPECT_TRUE(checkpoint_complete(p1));
  auto r = read_checkpoint(p1);
  EXPECT_EQ(r.step, 7);
  ASSERT_EQ(r.exp_avg.size(), d.exp_avg.size());
  for (std::size_t i = 0; i < r.exp_avg.size(); ++i) {
    EXPECT_TRUE(torch::equal(r.exp_avg[i], d.exp_avg[i]));
    EXPECT_TRUE(torch::equal(r.exp_avg_sq[i], d.exp_avg_sq[i]));
    EXPECT_TRUE(torch::equal(r.version_tensors.at(3)[i], d.version_tensors.at(3)[i]));
  }
  ASSERT_EQ(r.groups.size(), 2u);
  for (std::size_t g = 0; g < 2; ++g)
    for (std::size_t m = 0; m < 4; ++m) {
      EXPECT_EQ(r.groups[g].members[m].ids, d.groups[g].members[m].ids);
      EXPECT_EQ(r.groups[g].members[m].logprobs, d.groups[g].members[m].logprobs);  // bit-exact floats
      EXPECT_EQ(r.groups[g].members[m].advantage, d.groups[g].members[m].advantage);
    }
  {
    const Member& e = r.groups[0].members[1];
    EXPECT_EQ(e.mask, d.groups[0].members[1].mask);
    EXPECT_EQ(e.versions, d.groups[0].members[1].versions);
    EXPECT_EQ(e.prompt_ids, d.groups[0].members[1].prompt_ids);
    EXPECT_EQ(e.turns, 2);
    EXPECT_TRUE(r.groups[0].prescored);
    EXPECT_FALSE(r.groups[1].prescored);
    EXPECT_TRUE(r.groups[0].members[0].mask.empty()) << "a single-turn member stores no mask";
  }
  EXPECT_FALSE(r.groups[1].scored);
  EXPECT_FALSE(r.groups[1].members[2].valid());
  auto cur = cursor_from_json(r.state["cursor"]);
  EXPECT_EQ(cur.permutation, (std::vector<std::int64_t>{4, 3, 2, 1, 0}));
  ASSERT_EQ(cur.redo.size(), 1u);
  EXPECT_EQ(cur.redo[0].attempt, 2);
  // Save again from what was read: byte-identical tensor files.
  auto loaded = model::LoraAdapter::load_peft(r.adapter_dir, mc, torch::kCPU);
  CheckpointData d2 = r;
  d2.adapter = &loaded;
  d2.step = 8;
  auto p2 = write_checkpoint(ck, d2, 3);
  for (const char* f : {"optimizer.safetensors", "versions.safetensors", "queue.safetensors", "queue.json",
                        "adapter/adapter_model.safetensors"})
    EXPECT_EQ(read_file(p1 / f), read_file(p2 / f)) << f;
  // A corrupted newest checkpoint is skipped by resume; `latest` falls back to the older one.
  write_file_atomic(p2 / "queue.json", "{}");
  EXPECT_FALSE(checkpoint_complete(p2));
  auto found = find_resume_checkpoint(ck);
  ASSERT_TRUE(found);
  EXPECT_EQ(found->filename(), "step-000007");
  fs::remove(p1 / "manifest.json");
  EXPECT_FALSE(find_resume_checkpoint(ck));
  // Retention keeps the newest N.
  for (std::int64_t s = 10; s < 14; ++s) {
    d.step = s;
    write_checkpoint(ck, d, 2);
  }
  int n = 0;
  for (const auto& e : fs::directory_iterator(ck)) n += e.path().filename().string().rfind("step-", 0) == 0;
  EXPECT_EQ(n, 2);
}

TEST(TrainerParts, PrometheusText) {
  auto t = prometheus_text({{"ratio/min", 0.5}, {"rollout/retry_total", 3}, {"bad", std::nan("")}});
  EXPECT_NE(t.find("# TYPE lorasync_trainer_ratio_min gauge\nlorasync_trainer_ratio_min 0.5\n"), std::string::npos) << t;
  EXPECT_NE(t.find("# TYPE lorasync_trainer_rollout_retry_total counter"), std::string::npos);
  EXPECT_EQ(t.find("bad"), std::string::npos);
}

// The capability probe reads both shapes of /server_info: vLLM's (everything under vllm_config,
// dtypes as torch names, served_model_name a list or null) and lorasync's flat one.
TEST(ServerCaps, ReadsVllmNestedAndLorasyncFlatShapes) {
  using nlohmann::json;
  // The shape of vLLM's `GET /server_info?config_format=json` (VLLM_SERVER_DEV_MODE=1), trimmed.
  const json vllm = json::parse(R"({
    "vllm_config": {
      "model_config": {"model": "/models/Qwen2.5-Math-1.5B", "served_model_name": ["qwen-math", "alias"],
                       "max_model_len": 4096, "dtype": "torch.bfloat16", "seed": 0},
      "lora_config": {"max_lora_rank": 64, "max_loras": 6, "max_cpu_loras": null, "lora_dtype": "auto",
                      "fully_sharded_loras": false},
      "parallel_config": {"tensor_parallel_size": 1, "data_parallel_size": 2},
      "cache_config": {"block_size": 16}
    },
    "vllm_env": {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": true},
    "system_env": {}
  })");
  ServerCaps v = parse_server_info(vllm);
  EXPECT_TRUE(v.vllm);
  EXPECT_TRUE(v.lora_enabled);
  EXPECT_EQ(v.max_loras, 6);
  EXPECT_EQ(v.max_lora_rank, 64);
  EXPECT_FALSE(v.max_cpu_loras.has_value());
  EXPECT_FALSE(v.target_modules.has_value());
  EXPECT_EQ(v.data_parallel_size, 2);
  EXPECT_EQ(v.max_model_len, 4096);
  EXPECT_EQ(v.served_name, "qwen-math");
  EXPECT_EQ(v.dtype, "bfloat16");
  EXPECT_FALSE(v.base_model_sha256.has_value());
  // No served_model_name: the model path is the name; LoRA disabled is a null lora_config.
  json plain = vllm;
  plain["vllm_config"]["model_config"]["served_model_name"] = nullptr;
  plain["vllm_config"]["lora_config"] = nullptr;
  plain["vllm_config"]["model_config"]["dtype"] = "torch.float16";
  ServerCaps p = parse_server_info(plain);
  EXPECT_EQ(p.served_name, "/models/Qwen2.5-Math-1.5B");
  EXPECT_FALSE(p.lora_enabled);
  EXPECT_EQ(p.dtype, "float16");
  plain["vllm_config"]["model_config"]["served_model_name"] = "one-name";
  EXPECT_EQ(parse_server_info(plain).served_name, "one-name");

  const json flat = json::parse(R"({"model": "tiny", "dtype": "float32", "max_model_len": 2048,
    "lora_config": {"max_loras": 8, "max_lora_rank": 16, "target_modules": ["q_proj", "v_proj"]},
    "parallel_config": {"data_parallel_size": 1}, "base_model_sha256": "ab12", "adapter_push": "lorasync-push/1"})");
  ServerCaps f = parse_server_info(flat);
  EXPECT_EQ(f.adapter_push.value_or(""), "lorasync-push/1");
  EXPECT_FALSE(v.adapter_push.has_value());  // vLLM takes adapters by path only
  EXPECT_FALSE(f.vllm);
  EXPECT_EQ(f.served_name, "tiny");
  EXPECT_EQ(f.max_loras, 8);
  ASSERT_TRUE(f.target_modules.has_value());
  EXPECT_EQ(f.target_modules->size(), 2u);
  EXPECT_EQ(f.data_parallel_size, 1);
  EXPECT_EQ(f.base_model_sha256.value_or(""), "ab12");

  // Wrong types are refused with the key's name, never read as 0.
  for (auto [bad, key] : {std::pair<json, std::string>{json::parse(R"({"lora_config": {"max_loras": "6"}})"), "max_loras"},
                          {json::parse(R"({"vllm_config": {"model_config": {"max_model_len": 1.5}}})"), "max_model_len"},
                          {json::parse(R"({"lora_config": 3})"), "lora_config"},
                          {json::parse(R"({"adapter_push": 1})"), "adapter_push"},
                          {json::parse("[]"), "object"}}) {
    try {
      parse_server_info(bad);
      ADD_FAILURE() << bad.dump();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace lorasync::rl
