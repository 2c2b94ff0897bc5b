// Property/fuzz tests of the tokenizer's untrusted inputs: random bytes (malformed UTF-8 included)
// are either encoded — and then decode back to their NFC form — or rejected with InvalidInput;
// random ids decode to valid UTF-8; random mutations of a tokenizer.json load or fail with a
// lorasync::Error. Never a crash. Fixed seeds; -DLORASYNC_FUZZ_ITERS=N for longer runs.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <random>

#include "core/tokenizer/bpe_trainer.h"
#include "core/tokenizer/tokenizer.h"
#include "core/tokenizer/unicode.h"
#include "util/error.h"
#include "util/files.h"

#ifndef LORASYNC_FUZZ_ITERS
#define LORASYNC_FUZZ_ITERS 3000
#endif

namespace lorasync::tok {
namespace {

const std::string kQwenDir = std::string(LORASYNC_SHARED_DIR) + "/data/qwen2-tokenizer";

const TrainedBpe& small() {
  static const TrainedBpe t = [] {
    std::string corpus = read_file(std::string(LORASYNC_SHARED_DIR) + "/data/eval_amc.jsonl");
    BpeTrainerOptions o;
    o.vocab_size = 400;
    o.special_tokens = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
    return train_bpe(corpus, o);
  }();
  return t;
}

std::string random_bytes(std::mt19937& rng) {
  static const char* const kPieces[] = {"<|im_end|>", "<|im_start|>", " ", "\r\n", "'s", "é",
                                        "e\xCC\x81", "👨‍👩‍👧", "日本", "12", "\xF0\x9F", "\xC3",
                                        "\xED\xA0\x80", "\xFF", "\x80", "\xE4\xBD"};
  std::string s;
  int n = static_cast<int>(rng() % 40);
  for (int i = 0; i < n; ++i) {
    if (rng() % 3 == 0) s += kPieces[rng() % std::size(kPieces)];
    else s.push_back(static_cast<char>(rng() % 256));
  }
  return s;
}

void check_text(const Tokenizer& t, const std::string& s) {
  for (bool special : {true, false}) {
    EncodeOptions o;
    o.parse_special = special;
    std::vector<std::int32_t> ids;
    try {
      ids = t.encode(s, o);
    } catch (const Error& e) {
      ASSERT_EQ(e.kind(), ErrorKind::kInvalidInput) << e.what();
      ASSERT_NE(validate_utf8(s), std::string_view::npos) << "valid text rejected: " << e.what();
      continue;
    }
    ASSERT_EQ(validate_utf8(s), std::string_view::npos) << "malformed UTF-8 accepted";
    ASSERT_EQ(t.decode(ids), nfc(s));
    IncrementalDecoder dec(t);
    std::string streamed;
    for (auto id : ids) {
      std::string piece = dec.push(id);
      ASSERT_EQ(validate_utf8(piece), std::string_view::npos);
      streamed += piece;
    }
    streamed += dec.flush();
    ASSERT_EQ(streamed, nfc(s));
  }
}

TEST(TokenizerFuzz, RandomBytesQwen) {
  const auto t = Tokenizer::load(kQwenDir);
  std::mt19937 rng(1);
  for (int i = 0; i < LORASYNC_FUZZ_ITERS; ++i) ASSERT_NO_FATAL_FAILURE(check_text(t, random_bytes(rng)));
}

TEST(TokenizerFuzz, RandomBytesTrained) {
  const auto t = Tokenizer::from_json(small().tokenizer_json, small().config_json);
  std::mt19937 rng(2);
  for (int i = 0; i < LORASYNC_FUZZ_ITERS; ++i) ASSERT_NO_FATAL_FAILURE(check_text(t, random_bytes(rng)));
}

TEST(TokenizerFuzz, RandomIdsDecodeToValidUtf8) {
  const auto t = Tokenizer::from_json(small().tokenizer_json, small().config_json);
  std::mt19937 rng(3);
  for (int i = 0; i < LORASYNC_FUZZ_ITERS; ++i) {
    std::vector<std::int32_t> ids;
    int n = static_cast<int>(rng() % 20);
    for (int k = 0; k < n; ++k) ids.push_back(static_cast<std::int32_t>(rng() % (t.vocab_size() + 3)) - 1);
    try {
      std::string s = t.decode(ids);
      ASSERT_EQ(validate_utf8(s), std::string_view::npos);
    } catch (const Error& e) {
      ASSERT_EQ(e.kind(), ErrorKind::kInvalidInput);
    }
  }
}

// Mutations of a valid tokenizer.json: byte flips, truncation, and structural edits of JSON values.
TEST(TokenizerFuzz, MutatedTokenizerJson) {
  const std::string base = small().tokenizer_json;
  const nlohmann::json doc = nlohmann::json::parse(base);
  std::mt19937 rng(4);
  const nlohmann::json junk[] = {nullptr, 7, -1, "x", "a b c", nlohmann::json::array(),
                                 nlohmann::json::object(), true, 1e30, {{"Regex", "(("}},
                                 {"a", "b"}, 2147483647, 16777216};
  const char* const paths[] = {"/model/vocab", "/model/merges", "/model/merges/0", "/model/type",
                               "/model/unk_token", "/model/byte_fallback", "/pre_tokenizer",
                               "/pre_tokenizer/pretokenizers/0/pattern", "/pre_tokenizer/type",
                               "/pre_tokenizer/pretokenizers/0/behavior", "/normalizer", "/decoder",
                               "/added_tokens/0", "/added_tokens/0/id", "/added_tokens/1/content",
                               "/post_processor", "/model/vocab/a", "/model"};
  int loaded = 0, failed = 0;
  for (int i = 0; i < LORASYNC_FUZZ_ITERS / 10; ++i) {
    std::string text;
    if (i % 2 == 0) {
      nlohmann::json d = doc;
      auto p = nlohmann::json::json_pointer(paths[rng() % std::size(paths)]);
      try {
        d[p] = junk[rng() % std::size(junk)];
      } catch (const nlohmann::json::exception&) {
      }
      text = d.dump();
    } else {
      text = base;
      int n = static_cast<int>(rng() % 8) + 1;
      for (int k = 0; k < n; ++k) text[rng() % text.size()] = static_cast<char>(rng() % 256);
      if (rng() % 4 == 0) text.resize(rng() % text.size());
    }
    try {
      auto t = Tokenizer::from_json(text);
      ++loaded;
      // A mutated file that still loads may tokenize differently; it must still work: valid ids
      // that decode to valid UTF-8, or a clear error.
      try {
        auto ids = t.encode("Let x = 3; what's x^2? <|im_end|> 日本 \xC3\xA9");
        for (auto id : ids) ASSERT_TRUE(t.is_valid_id(id)) << id;
        ASSERT_EQ(validate_utf8(t.decode(ids)), std::string_view::npos);
      } catch (const Error& e) {
        ASSERT_FALSE(std::string(e.what()).empty());
      }
    } catch (const Error& e) {
      ++failed;
      ASSERT_FALSE(std::string(e.what()).empty());
    }
  }
  EXPECT_GT(failed, 0);
  EXPECT_GT(loaded, 0);
}

}  // namespace
}  // namespace lorasync::tok
