// Black-box tests of `lorasync tokenize` and `lorasync train-tokenizer`.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cstdio>

#include "util/files.h"

namespace lorasync {
namespace {

using json = nlohmann::json;
const std::string kQwen = std::string(LORASYNC_SHARED_DIR) + "/data/qwen2-tokenizer";

// Runs the binary with `args` (already shell-quoted); returns {exit code, stdout}.
std::pair<int, std::string> run(const std::string& args) {
  std::string cmd = std::string("'") + LORASYNC_BINARY + "' " + args + " 2>/dev/null";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  while (std::size_t n = std::fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  int rc = pclose(p);
  return {WEXITSTATUS(rc), out};
}

TEST(TokenizerCli, EncodeDecodeAndJsonl) {
  auto [rc, out] = run("tokenize --tokenizer '" + kQwen + "' --text 'Hello  world<|im_end|>'");
  ASSERT_EQ(rc, 0);
  EXPECT_EQ(json::parse(out)["ids"], json({9707, 220, 1879, 151645}));
  auto [rc2, out2] = run("tokenize --tokenizer '" + kQwen + "/tokenizer.json' --no-special --text '<|im_end|>'");
  ASSERT_EQ(rc2, 0);
  EXPECT_GT(json::parse(out2)["ids"].size(), 1u);
  auto [rc3, out3] = run("tokenize --tokenizer '" + kQwen + "' --decode --ids 9707,220,1879,151645");
  ASSERT_EQ(rc3, 0);
  EXPECT_EQ(json::parse(out3)["text"], "Hello  world<|im_end|>");
  TempDir tmp("lorasync-tok-cli");
  write_file_durable(tmp.path() / "in.jsonl", "{\"text\": \"a\"}\n\n{\"text\": \"日本\"}\n");
  auto [rc4, out4] = run("tokenize --tokenizer '" + kQwen + "' --input '" + (tmp.path() / "in.jsonl").string() + "'");
  ASSERT_EQ(rc4, 0);
  EXPECT_EQ(out4, "{\"ids\":[64]}\n{\"ids\":[101059]}\n");
  // Bad input: exit 2 with a message.
  EXPECT_EQ(run("tokenize --tokenizer '" + kQwen + "' --decode --ids 1,x").first, 2);
  EXPECT_EQ(run("tokenize --tokenizer /nonexistent --text a").first, 2);
}

TEST(TokenizerCli, TrainTokenizerIsDeterministicAndLoads) {
  TempDir tmp("lorasync-train-tok");
  const std::string corpus = std::string(LORASYNC_SHARED_DIR) + "/data/eval_math500.jsonl";
  for (const char* d : {"a", "b"}) {
    auto [rc, out] = run("train-tokenizer --input '" + corpus + "' --vocab-size 600 --output '" +
                         (tmp.path() / d).string() + "' --special '<|endoftext|>,<|im_start|>,<|im_end|>'");
    ASSERT_EQ(rc, 0) << out;
    EXPECT_EQ(json::parse(out)["vocab_size"], 600);
  }
  EXPECT_EQ(read_file(tmp.path() / "a" / "tokenizer.json"), read_file(tmp.path() / "b" / "tokenizer.json"));
  auto [rc, out] = run("tokenize --tokenizer '" + (tmp.path() / "a").string() +
                       "' --text '<|im_start|>user'");
  ASSERT_EQ(rc, 0);
  EXPECT_EQ(json::parse(out)["ids"][0], 598);
}

}  // namespace
}  // namespace lorasync
