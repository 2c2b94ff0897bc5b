#include <gtest/gtest.h>

#include "util/bench_report.h"
#include "util/error.h"
#include "util/files.h"
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

}  // namespace
}  // namespace lorasync
