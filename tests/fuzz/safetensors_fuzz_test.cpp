// Property test: random and mutated safetensors images never crash the reader; every failure is
// an InvalidInput error, and every accepted file's tensors lie inside the buffer.
#include <gtest/gtest.h>

#include <random>

#include "core/io/safetensors.h"
#include "util/error.h"

#ifndef LORASYNC_FUZZ_ITERS
#define LORASYNC_FUZZ_ITERS 20000
#endif

namespace lorasync::io {
namespace {

std::vector<std::uint8_t> valid_image(std::mt19937& rng) {
  std::string header = R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},"b":{"dtype":"BF16","shape":[3],"data_offsets":[16,22]}})";
  std::vector<std::uint8_t> out(8);
  std::uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(n >> (8 * i));
  out.insert(out.end(), header.begin(), header.end());
  for (int i = 0; i < 22; ++i) out.push_back(static_cast<std::uint8_t>(rng()));
  return out;
}

void check(const std::vector<std::uint8_t>& img) {
  try {
    auto f = SafetensorsFile::from_bytes(img, "fuzz");
    for (const auto& t : f->tensors()) {
      ASSERT_GE(t.data, img.data());
      ASSERT_LE(t.data + t.nbytes, img.data() + img.size());
      ASSERT_EQ(static_cast<std::size_t>(t.numel()) * dtype_size(t.dtype), t.nbytes);
    }
  } catch (const Error& e) {
    ASSERT_EQ(e.kind(), ErrorKind::kInvalidInput) << e.what();
  }
}

TEST(SafetensorsFuzz, RandomBytes) {
  std::mt19937 rng(1234);
  for (int it = 0; it < LORASYNC_FUZZ_ITERS / 4; ++it) {
    std::vector<std::uint8_t> img(rng() % 200);
    for (auto& b : img) b = static_cast<std::uint8_t>(rng());
    if (img.size() >= 8 && (rng() & 1)) {  // plausible header length
      std::uint64_t n = rng() % (img.size() - 7);
      for (int i = 0; i < 8; ++i) img[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(n >> (8 * i));
      if (img.size() > 8) img[8] = '{';
    }
    check(img);
  }
}

TEST(SafetensorsFuzz, MutatedValidImages) {
  std::mt19937 rng(99);
  const std::string alphabet = "{}[]\",:0123456789-eE.FBIUa_ ";
  for (int it = 0; it < LORASYNC_FUZZ_ITERS; ++it) {
    auto img = valid_image(rng);
    int n_mut = 1 + static_cast<int>(rng() % 4);
    for (int m = 0; m < n_mut; ++m) {
      std::size_t pos = rng() % img.size();
      switch (rng() % 4) {
        case 0: img[pos] = static_cast<std::uint8_t>(rng()); break;
        case 1: img[pos] = static_cast<std::uint8_t>(alphabet[rng() % alphabet.size()]); break;
        case 2: img.erase(img.begin() + static_cast<std::ptrdiff_t>(pos)); break;
        default: img.insert(img.begin() + static_cast<std::ptrdiff_t>(pos), static_cast<std::uint8_t>(alphabet[rng() % alphabet.size()]));
      }
      if (img.empty()) break;
    }
    check(img);
  }
}

}  // namespace
}  // namespace lorasync::io
