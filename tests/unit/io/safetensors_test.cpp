#include <gtest/gtest.h>

#include <cstring>

#include "core/io/checkpoint_dir.h"
#include "core/io/safetensors.h"
#include "util/error.h"
#include "util/files.h"

namespace lorasync::io {
namespace {

std::vector<std::uint8_t> bytes_of(const std::vector<float>& v) {
  std::vector<std::uint8_t> b(v.size() * 4);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// A file image built by hand (not by our writer), so the reader is checked against the format.
std::vector<std::uint8_t> image(const std::string& header, std::size_t data_bytes) {
  std::vector<std::uint8_t> out(8);
  std::uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(n >> (8 * i));
  out.insert(out.end(), header.begin(), header.end());
  out.resize(out.size() + data_bytes, 0);
  return out;
}

std::string error_of(const std::vector<std::uint8_t>& img) {
  try {
    SafetensorsFile::from_bytes(img, "t.safetensors");
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput);
    return e.what();
  }
  return "";
}

TEST(Safetensors, RoundTripAllDtypes) {
  TempDir dir;
  auto f32 = bytes_of({1.5f, -2.0f, 3.25f, 0.0f, 7.0f, 8.0f});
  std::vector<std::uint8_t> bf16 = {0x80, 0x3f, 0x00, 0xc0};  // 1.0, -2.0
  std::vector<std::uint8_t> f16 = {0x00, 0x3c};               // 1.0
  std::vector<std::uint8_t> i64(16, 0);
  i64[0] = 7;
  std::vector<std::uint8_t> i32(4, 0xff);
  std::vector<std::uint8_t> u8 = {1, 2, 3};
  std::vector<std::uint8_t> b = {1, 0};
  std::vector<TensorToWrite> ts = {
      {"w", DType::kF32, {2, 3}, f32},  {"bf", DType::kBF16, {2}, bf16},
      {"h", DType::kF16, {1}, f16},     {"i64", DType::kI64, {2}, i64},
      {"i32", DType::kI32, {1}, i32},   {"u8", DType::kU8, {3}, u8},
      {"i8", DType::kI8, {3}, u8},      {"flag", DType::kBool, {2}, b},
      {"empty", DType::kF32, {0, 4}, {}}};
  write_safetensors(dir.path() / "a.safetensors", ts, {{"format", "pt"}, {"k", "v"}});
  SafetensorsFile f(dir.path() / "a.safetensors");
  EXPECT_EQ(f.tensors().size(), ts.size());
  EXPECT_EQ(f.metadata().at("k"), "v");
  for (const auto& t : ts) {
    const auto& v = f.get(t.name);
    EXPECT_EQ(v.dtype, t.dtype) << t.name;
    EXPECT_EQ(v.shape, t.shape) << t.name;
    ASSERT_EQ(v.nbytes, t.bytes.size()) << t.name;
    if (v.nbytes) {
      EXPECT_EQ(std::memcmp(v.data, t.bytes.data(), v.nbytes), 0) << t.name;
    }
  }
  // Data section aligned to 8 bytes.
  auto raw = read_file(dir.path() / "a.safetensors");
  std::uint64_t n = 0;
  std::memcpy(&n, raw.data(), 8);
  EXPECT_EQ((n + 8) % 8, 0u);
}

TEST(Safetensors, ReadsHandMadeFile) {
  auto img = image(R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"I8","shape":[],"data_offsets":[8,9]}})", 9);
  auto f = SafetensorsFile::from_bytes(img, "hand");
  EXPECT_EQ(f->get("a").numel(), 2);
  EXPECT_EQ(f->get("b").numel(), 1);  // scalar
}

TEST(Safetensors, RejectsBadHeadersWithNamedErrors) {
  EXPECT_NE(error_of({1, 2, 3}).find("too short"), std::string::npos);
  auto big = image("{}", 0);
  for (int i = 0; i < 4; ++i) big[static_cast<std::size_t>(i)] = 0xff;
  EXPECT_NE(error_of(big).find("exceeds"), std::string::npos);
  EXPECT_NE(error_of(image("[1,2]", 0)).find("JSON object"), std::string::npos);
  EXPECT_NE(error_of(image("{\"a\": ", 0)).find("not valid JSON"), std::string::npos);
  auto e = error_of(image(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8));
  EXPECT_NE(e.find("'w'"), std::string::npos);
  EXPECT_NE(e.find("needs 12 bytes"), std::string::npos);
  e = error_of(image(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8));
  EXPECT_NE(e.find("exceed the data size 8"), std::string::npos);
  e = error_of(image(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"v":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12));
  EXPECT_NE(e.find("overlap"), std::string::npos);
  e = error_of(image(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8));
  EXPECT_NE(e.find("appears twice"), std::string::npos);
  e = error_of(image(R"({"w":{"dtype":"Q4","shape":[1],"data_offsets":[0,4]}})", 4));
  EXPECT_NE(e.find("unsupported dtype 'Q4'"), std::string::npos);
  e = error_of(image(R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4));
  EXPECT_NE(e.find("non-negative"), std::string::npos);
  e = error_of(image(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}})", 4));
  EXPECT_NE(e.find("reversed"), std::string::npos);
  e = error_of(image(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,4]}})", 4));
  EXPECT_NE(e.find("too large"), std::string::npos);
}

TEST(Safetensors, MissingFileIsNotFound) {
  TempDir dir;
  try {
    SafetensorsFile f(dir.path() / "none.safetensors");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kNotFound);
  }
}

TEST(Checkpoint, ShardedEqualsSingle) {
  TempDir a, b;
  std::vector<std::vector<std::uint8_t>> store;
  std::vector<TensorToWrite> ts;
  for (int i = 0; i < 10; ++i) {
    std::vector<float> v(100);
    for (int k = 0; k < 100; ++k) v[static_cast<std::size_t>(k)] = static_cast<float>(i * 1000 + k);
    store.push_back(bytes_of(v));
  }
  for (int i = 0; i < 10; ++i)
    ts.push_back({fmt::format("layer.{}.w", i), DType::kF32, {10, 10}, store[static_cast<std::size_t>(i)]});
  EXPECT_EQ(write_weights(a.path(), ts, 1 << 20), 1);
  EXPECT_EQ(write_weights(b.path(), ts, 1000), 5);  // two 400-byte tensors per shard
  EXPECT_TRUE(fs::exists(b.path() / "model.safetensors.index.json"));
  auto wa = open_weights(a.path());
  auto wb = open_weights(b.path());
  EXPECT_EQ(wa.names(), wb.names());
  EXPECT_EQ(wb.n_files(), 5u);
  for (const auto& n : wa.names()) {
    const auto& x = wa.get(n);
    const auto& y = wb.get(n);
    ASSERT_EQ(x.nbytes, y.nbytes);
    EXPECT_EQ(std::memcmp(x.data, y.data, x.nbytes), 0) << n;
  }
}

TEST(Checkpoint, IndexNamingAWrongFileFails) {
  TempDir d;
  std::vector<std::uint8_t> buf(4, 0);
  write_safetensors(d.path() / "s1.safetensors", {{"a", DType::kF32, {1}, buf}});
  write_file_atomic(d.path() / "model.safetensors.index.json",
                    R"({"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}})");
  try {
    open_weights(d.path());
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'b'"), std::string::npos);
  }
  write_file_atomic(d.path() / "model.safetensors.index.json",
                    R"({"weight_map": {"a": "../etc/passwd"}})");
  EXPECT_THROW(open_weights(d.path()), Error);
}

}  // namespace
}  // namespace lorasync::io
