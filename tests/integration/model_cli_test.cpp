// Black-box tests of the model tools through the real binary: init-model, generate, logprobs.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "util/files.h"
#include "util/run_command.h"

namespace lorasync {
namespace {

using testing::run_lorasync;
using testing::shell_quote;

class ModelCli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir("lorasync-modelcli");
    auto r = run_lorasync("init-model --preset tiny --seed 3 --output " +
                          shell_quote((dir_->path() / "tiny").string()));
    ASSERT_EQ(r.exit_code, 0) << r.err;
  }
  static void TearDownTestSuite() { delete dir_; }
  static std::string model() { return shell_quote((dir_->path() / "tiny").string()); }
  static TempDir* dir_;
};
TempDir* ModelCli::dir_ = nullptr;

TEST_F(ModelCli, InitModelWritesHuggingFaceLayout) {
  for (const char* f : {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"})
    EXPECT_TRUE(fs::exists(dir_->path() / "tiny" / f)) << f;
  auto cfg = nlohmann::json::parse(read_file(dir_->path() / "tiny" / "config.json"));
  EXPECT_EQ(cfg["model_type"], "qwen2");
  EXPECT_EQ(cfg["num_hidden_layers"], 2);
  // No staging directory is left behind.
  for (const auto& e : fs::directory_iterator(dir_->path()))
    EXPECT_EQ(e.path().filename().string().find("staging"), std::string::npos);
  // Refuses to overwrite without --overwrite.
  auto r = run_lorasync("init-model --preset tiny --output " + model());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("--overwrite"), std::string::npos) << r.err;
}

TEST_F(ModelCli, GenerateAndLogprobsAgree) {
  auto g = run_lorasync("generate --model " + model() +
                        " --prompt-ids 10,20,30 --max-tokens 5 --temperature 0.8 --seed 4 --ignore-eos");
  ASSERT_EQ(g.exit_code, 0) << g.err;
  auto gj = nlohmann::json::parse(g.out);
  ASSERT_EQ(gj["ids"].size(), 5u);
  std::string ids;
  for (const auto& v : gj["ids"]) ids += (ids.empty() ? "" : ",") + std::to_string(v.get<long>());
  auto l = run_lorasync("logprobs --model " + model() + " --prompt-ids 10,20,30 --completion-ids " +
                        ids + " --temperature 0.8");
  ASSERT_EQ(l.exit_code, 0) << l.err;
  auto lj = nlohmann::json::parse(l.out);
  for (std::size_t i = 0; i < 5; ++i)
    EXPECT_NEAR(lj["logprobs"][i].get<double>(), gj["logprobs"][i].get<double>(), 1e-5);
  // Same seed, same tokens.
  auto g2 = run_lorasync("generate --model " + model() +
                         " --prompt-ids 10,20,30 --max-tokens 5 --temperature 0.8 --seed 4 --ignore-eos");
  EXPECT_EQ(nlohmann::json::parse(g2.out)["ids"], gj["ids"]);
}

TEST_F(ModelCli, LogprobsBatchInput) {
  TempDir d;
  write_file_atomic(d.path() / "in.jsonl",
                    "{\"prompt_ids\": [1, 2], \"completion_ids\": [3, 4, 5]}\n\n"
                    "{\"prompt_ids\": [7], \"completion_ids\": [8]}\n");
  auto r = run_lorasync("logprobs --model " + model() + " --input " +
                        shell_quote((d.path() / "in.jsonl").string()));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::istringstream lines(r.out);
  std::string a, b;
  std::getline(lines, a);
  std::getline(lines, b);
  EXPECT_EQ(nlohmann::json::parse(a)["logprobs"].size(), 3u);
  EXPECT_EQ(nlohmann::json::parse(b)["logprobs"].size(), 1u);
}

TEST_F(ModelCli, BadInputGetsClearErrors) {
  auto r = run_lorasync("logprobs --model " + model() + " --prompt-ids 1,2 --completion-ids 999999999");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("completion_ids[0] = 999999999 is outside the vocabulary"), std::string::npos) << r.err;
  r = run_lorasync("logprobs --model /nonexistent/model --prompt-ids 1 --completion-ids 2");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("/nonexistent/model/config.json"), std::string::npos) << r.err;
  r = run_lorasync("generate --model " + model() + " --prompt-ids 1 --max-tokens 0");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("--max-tokens"), std::string::npos) << r.err;
  r = run_lorasync("init-model --preset huge --output /tmp/never");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("unknown model preset 'huge'"), std::string::npos) << r.err;
  r = run_lorasync("logprobs --model " + model() + " --adapter /nonexistent/adapter --prompt-ids 1 --completion-ids 2");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("/nonexistent/adapter"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace lorasync
