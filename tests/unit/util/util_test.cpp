#include <gtest/gtest.h>

#include <random>

#include "util/json_limits.h"
#include "util/bench_report.h"
#include "util/error.h"
#include "util/supervised_process.h"
#include "util/files.h"
#include "util/json_lines.h"
#include "util/sha256.h"
#include "util/strings.h"

namespace lorasync {
namespace {

TEST(Strings, ParseIntList) {
  EXPECT_EQ(parse_int_list("1, 2,3", "ids"), (std::vector<std::int64_t>{1, 2, 3}));
  EXPECT_TRUE(parse_int_list("", "ids").empty());
  try {
    parse_int_list("1,x", "--prompt-ids");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput);
    EXPECT_NE(std::string(e.what()).find("--prompt-ids"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("'x'"), std::string::npos);
  }
}

TEST(Strings, ParseBytes) {
  EXPECT_EQ(parse_bytes("4GiB", "kv"), 4ull << 30);
  EXPECT_EQ(parse_bytes("512 MiB", "kv"), 512ull << 20);
  EXPECT_EQ(parse_bytes("1000", "kv"), 1000u);
  EXPECT_EQ(parse_bytes("1.5GB", "kv"), 1500000000u);
  EXPECT_THROW(parse_bytes("4 parsecs", "kv"), Error);
  EXPECT_THROW(parse_bytes("", "kv"), Error);
}

TEST(Sha256, KnownVectors) {
  EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(Files, AtomicWriteReplacesAndLeavesNoTemp) {
  TempDir dir;
  auto p = dir.path() / "x.json";
  write_file_atomic(p, "one");
  write_file_atomic(p, "two");
  EXPECT_EQ(read_file(p), "two");
  int n = 0;
  for (const auto& e : fs::directory_iterator(dir.path())) {
    (void)e;
    ++n;
  }
  EXPECT_EQ(n, 1);
  EXPECT_EQ(sha256_file(p), sha256_hex("two"));
}

TEST(Files, ReadMissingIsNotFound) {
  TempDir dir;
  try {
    read_file(dir.path() / "nope");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kNotFound);
    EXPECT_NE(std::string(e.what()).find("nope"), std::string::npos);
  }
}

TEST(Bench, Percentile) {
  EXPECT_DOUBLE_EQ(percentile({1, 2, 3, 4, 5}, 50), 3);
  EXPECT_DOUBLE_EQ(percentile({1, 2}, 100), 2);
  EXPECT_DOUBLE_EQ(percentile({}, 99), 0);
}

// Pairs of adjacent runs, the order swapped every pair; each value lands on its own side.
TEST(Bench, AlternatePairsSwapTheOrderEveryPair) {
  std::string order;
  int calls = 0;
  auto pairs = alternate_pairs(4, [&](bool candidate) {
    order += candidate ? 'c' : 'b';
    ++calls;
    return candidate ? 100.0 + calls : static_cast<double>(calls);
  });
  EXPECT_EQ(order, "cbbccbbc");
  ASSERT_EQ(pairs.size(), 4u);
  for (const auto& [c, b] : pairs) {
    EXPECT_GT(c, 100);
    EXPECT_LT(b, 100);
  }
  EXPECT_DOUBLE_EQ(pairs[0].first, 101);
  EXPECT_DOUBLE_EQ(pairs[1].second, 3);
  EXPECT_TRUE(alternate_pairs(0, [](bool) { return 1.0; }).empty());
}

// The depth scan of untrusted JSON: brackets inside strings (escaped quotes too) do not count,
// counting stops past the limit, and random bracket strings agree with a direct count.
TEST(JsonLimits, NestingDepthIgnoresStringsAndStopsAtTheLimit) {
  EXPECT_EQ(json_nesting_depth("{}"), 1u);
  EXPECT_EQ(json_nesting_depth(R"({"a": [1, {"b": [[]]}]})"), 5u);
  EXPECT_EQ(json_nesting_depth(R"({"a": "[[[[{{{{", "b": "\"[[["})"), 1u);
  EXPECT_EQ(json_nesting_depth("42"), 0u);
  const std::string deep = std::string(1000000, '[') + std::string(1000000, ']');
  EXPECT_EQ(json_nesting_depth(deep, 64), 65u);
  EXPECT_NO_THROW(check_json_depth(std::string(64, '[') + std::string(64, ']')));
  try {
    check_json_depth(R"({"model": )" + deep + "}");
    FAIL() << "a million levels were accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput);
    EXPECT_NE(std::string(e.what()).find("deeper than 64 levels"), std::string::npos) << e.what();
  }
  // A raw NUL (nlohmann would stop reading there and accept the prefix): refused with its offset.
  try {
    check_json_depth(std::string("{\"model\": \"m\"}\0{\"junk\"", 22));
    FAIL() << "a body with a NUL byte was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("NUL byte at offset 14"), std::string::npos) << e.what();
  }
  std::mt19937 rng(7);
  for (int t = 0; t < 200; ++t) {
    std::string s;
    std::size_t depth = 0, deepest = 0;
    for (int i = 0; i < 200; ++i) {
      if (rng() % 2 == 0) {
        s += (rng() % 2) ? '[' : '{';
        deepest = std::max(deepest, ++depth);
      } else if (depth > 0) {
        s += (rng() % 2) ? ']' : '}';
        --depth;
      } else {
        s += R"("x[{\"")";
      }
    }
    EXPECT_EQ(json_nesting_depth(s, 1000), deepest) << s;
  }
}

TEST(Jsonl, SkipsEmptyAndPartialLinesAndAMissingFile) {
  TempDir dir("lorasync-jsonl");
  EXPECT_TRUE(read_jsonl(dir.path() / "none.jsonl").empty());
  write_file_atomic(dir.path() / "m.jsonl", "{\"step\": 1}\n\n{\"step\": 2}\n{\"step\": 3, \"lo");  // the last line is being written
  const auto rows = read_jsonl(dir.path() / "m.jsonl");
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[1]["step"], 2);
}

TEST(ChildProcess, FirstLineExitStatusAndUsage) {
  TempDir dir("lorasync-child");
  ChildProcess ok("echo", {"/bin/sh", "-c", "echo '{\"port\": 5}'; exit 3"}, dir.path());
  EXPECT_EQ(ok.first_line(30), "{\"port\": 5}");
  EXPECT_EQ(ok.wait(), 3);
  EXPECT_EQ(ok.status_text(), "exit status 3");
  EXPECT_GT(ok.peak_rss_mb(), 0.0);
  EXPECT_GE(ok.cpu_s(), 0.0);
  ChildProcess quiet("quiet", {"/bin/sh", "-c", "echo oops >&2; exit 1"}, dir.path());
  try {
    quiet.first_line(30);
    FAIL() << "no first line, yet no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("quiet did not start (exit status 1)"), std::string::npos) << e.what();
  }
  EXPECT_EQ(read_file(dir.path() / "quiet.log"), "oops\n");
  ChildProcess sleeper("sleeper", {"/bin/sleep", "60"}, dir.path());
  sleeper.stop(5);
  EXPECT_EQ(sleeper.code(), 128 + 15);
  EXPECT_EQ(sleeper.status_text(), "killed by signal 15");
}

}  // namespace
}  // namespace lorasync
