// Property test of the server's request parser: random bytes and mutated valid bodies never crash
// it; every rejection is an InvalidInput error (a 400 naming a field), never anything else.
#include <gtest/gtest.h>

#include <random>

#include "core/tokenizer/tokenizer.h"
#include "server/openai.h"
#include "util/error.h"

#ifndef LORASYNC_FUZZ_ITERS
#define LORASYNC_FUZZ_ITERS 6000
#endif

namespace lorasync::server {
namespace {

const tok::Tokenizer& tokenizer() {
  static tok::Tokenizer t = tok::Tokenizer::load(std::string(LORASYNC_SHARED_DIR) + "/data/qwen2-tokenizer");
  return t;
}

void check_one(const std::string& body, bool chat, tok::ChatFormat format) {
  try {
    auto r = chat ? parse_chat(body, tokenizer(), format) : parse_completion(body, tokenizer());
    ASSERT_FALSE(r.prompts.empty());
    for (const auto& p : r.prompts) ASSERT_FALSE(p.empty());
    ASSERT_GE(r.params.n, 1);
  } catch (const Error& e) {
    ASSERT_EQ(e.kind(), ErrorKind::kInvalidInput) << e.what() << "\nbody: " << body;
  }
}

// A chat body in every chat format (ChatML, Qwen3's thinking split, Llama 3's headers).
void check(const std::string& body, bool chat) {
  if (!chat) return check_one(body, false, tok::ChatFormat::kChatml);
  for (auto f : {tok::ChatFormat::kChatml, tok::ChatFormat::kQwen3, tok::ChatFormat::kLlama3}) check_one(body, true, f);
}

TEST(OpenAiParserFuzz, MutatedBodies) {
  const std::vector<std::string> seeds = {
      R"({"model": "m", "prompt": "Hello <|im_end|> world", "max_tokens": 5, "temperature": 0.7, "top_p": 0.9, "stop": ["\n"], "n": 2, "logprobs": 1, "seed": 3, "stream": true})",
      R"({"model": "m", "prompt": [1, 2, 3], "return_token_ids": true, "stop_token_ids": [5], "ignore_eos": false, "top_k": 4, "min_p": 0.1})",
      R"({"model": "m", "prompt": [[1, 2], "text", [3]], "stream_options": {"include_usage": true}})",
      R"({"model": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 3})",
      R"({"model": "m", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>\nr</think>\n\na</think>b"}, {"role": "user", "content": " x "}], "chat_template_kwargs": {"enable_thinking": false}})",
  };
  const std::string alphabet = "{}[]\",:0123456789-eE.truefalsnul \\u<|>";
  std::mt19937 rng(7);
  for (int it = 0; it < LORASYNC_FUZZ_ITERS; ++it) {
    std::string s = seeds[rng() % seeds.size()];
    int n = 1 + static_cast<int>(rng() % 5);
    for (int k = 0; k < n && !s.empty(); ++k) {
      std::size_t pos = rng() % s.size();
      switch (rng() % 4) {
        case 0: s[pos] = static_cast<char>(rng()); break;
        case 1: s[pos] = alphabet[rng() % alphabet.size()]; break;
        case 2: s.erase(pos, 1 + rng() % 4); break;
        default: s.insert(pos, 1, alphabet[rng() % alphabet.size()]);
      }
    }
    check(s, s.find("messages") != std::string::npos);
  }
}

TEST(OpenAiParserFuzz, RandomBytesAndTypes) {
  std::mt19937 rng(11);
  for (int it = 0; it < LORASYNC_FUZZ_ITERS / 3; ++it) {
    std::string s(rng() % 64, '\0');
    for (auto& c : s) c = static_cast<char>(rng());
    check(s, it % 2 == 0);
  }
  // Every field with every wrong type.
  const std::vector<std::string> values = {"null", "true", "1", "-1", "1.5", "1e308", "\"x\"", "[]", "{}", "[\"a\"]", "[1.5]", "[-1]", "[[]]"};
  for (const char* field : {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                            "stop_token_ids", "n", "logprobs", "stream", "stream_options", "repetition_penalty", "best_of"})
    for (const auto& v : values) {
      std::string body = std::string(R"({"model": "m", "prompt": [1], )") + "\"" + field + "\": " + v + "}";
      check(body, false);
    }
  for (const auto& v : values) {
    check(std::string(R"({"model": "m", "messages": [{"role": "user", "content": "q"}], "chat_template_kwargs": )") + v + "}", true);
    check(std::string(R"({"model": "m", "messages": [{"role": "user", "content": "q"}], "chat_template_kwargs": {"enable_thinking": )") + v + "}}", true);
  }
}

}  // namespace
}  // namespace lorasync::server
