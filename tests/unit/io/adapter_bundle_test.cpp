// The push bundle (core/io/adapter_manifest.h): a round trip, every rule's refusal naming the
// problem, and properties over mutated bodies (no truncation or flipped byte is ever accepted as
// the same adapter; nothing but lorasync::Error comes out).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <map>
#include <random>
#include <string>

#include "core/io/adapter_manifest.h"
#include "util/error.h"
#include "util/sha256.h"

namespace lorasync::io {
namespace {

struct Fixture {
  std::map<std::string, std::string> files;
  std::string manifest;
};

Fixture fixture(std::size_t weights_bytes = 3000) {
  Fixture f;
  f.files["adapter_config.json"] = R"({"peft_type": "LORA", "r": 1})";
  std::string w(weights_bytes, '\0');
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = static_cast<char>((i * 131 + 7) & 0xff);
  f.files["adapter_model.safetensors"] = w;
  nlohmann::json m = {{"format", "lorasync-adapter/1"}, {"name", "policy-v3"}, {"files", nlohmann::json::object()}};
  std::map<std::string, std::string> shas;
  for (const auto& [n, b] : f.files) {
    shas[n] = sha256_hex(b);
    m["files"][n] = {{"bytes", b.size()}, {"sha256", shas[n]}};
  }
  m["adapter_sha256"] = adapter_digest(shas);
  m["base_model"] = {{"name", "tiny"}, {"sha256", std::string(64, 'a')}};
  f.manifest = m.dump(2);  // as the publisher writes it: several lines
  return f;
}

std::string refusal(const std::string& body) {
  try {
    parse_adapter_bundle(body);
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "accepted";
  return "";
}

TEST(AdapterBundle, RoundTripKeepsNamePathFilesAndDigest) {
  auto f = fixture();
  const std::string body = make_adapter_bundle("policy-v3", "/bucket/a/policy-v3", f.manifest, f.files);
  EXPECT_EQ(body.find('\n'), body.size() - 3000 - f.files["adapter_config.json"].size() - 1);
  auto b = parse_adapter_bundle(body);
  EXPECT_EQ(b.lora_name, "policy-v3");
  EXPECT_EQ(b.lora_path, "/bucket/a/policy-v3");
  ASSERT_EQ(b.files.size(), 2u);
  for (const auto& [n, bytes] : f.files) EXPECT_EQ(std::string(b.files.at(n)), bytes);
  EXPECT_EQ(b.adapter_sha256, nlohmann::json::parse(f.manifest)["adapter_sha256"]);
  EXPECT_EQ(b.manifest.base_sha256, std::string(64, 'a'));
  // Without a path, and unverified (framing only): the same views, no digest.
  auto u = parse_adapter_bundle(make_adapter_bundle("x", "", f.manifest, f.files), false);
  EXPECT_TRUE(u.lora_path.empty());
  EXPECT_TRUE(u.adapter_sha256.empty());
  EXPECT_EQ(u.files.size(), 2u);
}

TEST(AdapterBundle, EveryRuleIsRefusedWithItsReason) {
  auto f = fixture();
  const std::string good = make_adapter_bundle("policy-v3", "", f.manifest, f.files);
  EXPECT_NE(refusal(good.substr(0, good.size() - 1)).find("truncated or padded"), std::string::npos);
  EXPECT_NE(refusal(good + "x").find("truncated or padded"), std::string::npos);
  std::string flipped = good;
  flipped[flipped.size() - 10] ^= 1;
  EXPECT_NE(refusal(flipped).find("adapter_model.safetensors does not match its SHA-256"), std::string::npos);
  EXPECT_NE(refusal("").find("no header line"), std::string::npos);
  EXPECT_NE(refusal(std::string(2 << 20, 'x')).find("no header line"), std::string::npos);
  EXPECT_NE(refusal("[1]\n").find("not a JSON object"), std::string::npos);
  EXPECT_NE(refusal(R"({"format": "lorasync-push/2", "lora_name": "a", "manifest": {}})" "\n").find("format"), std::string::npos);
  EXPECT_NE(refusal(R"({"format": "lorasync-push/1", "lora_name": "", "manifest": {}})" "\n").find("lora_name"), std::string::npos);
  EXPECT_NE(refusal(R"({"format": "lorasync-push/1", "lora_name": "a"})" "\n").find("no manifest"), std::string::npos);
  EXPECT_NE(refusal(R"({"format": "lorasync-push/1", "lora_name": "a", "lora_path": 3, "manifest": {}})" "\n").find("lora_path"),
            std::string::npos);
  // A manifest without the weights, with a bad entry, or whose digest lies.
  auto m = nlohmann::json::parse(f.manifest);
  auto no_weights = m;
  no_weights["files"].erase("adapter_model.safetensors");
  auto cfg_only = f.files;
  cfg_only.erase("adapter_model.safetensors");
  EXPECT_NE(refusal(make_adapter_bundle("a", "", no_weights.dump(), cfg_only)).find("does not list adapter_model.safetensors"),
            std::string::npos);
  auto bad_entry = m;
  bad_entry["files"]["adapter_config.json"]["sha256"] = "XYZ";
  EXPECT_NE(refusal(make_adapter_bundle("a", "", bad_entry.dump(), f.files)).find("64 lowercase hex"), std::string::npos);
  auto lying = m;
  lying["adapter_sha256"] = std::string(64, 'b');
  EXPECT_NE(refusal(make_adapter_bundle("a", "", lying.dump(), f.files)).find("adapter_sha256"), std::string::npos);
  // A listed size larger than the whole body is refused before any arithmetic on it.
  auto huge = m;
  huge["files"]["adapter_model.safetensors"]["bytes"] = std::uint64_t{1} << 62;
  EXPECT_NE(refusal(make_adapter_bundle("a", "", huge.dump(), f.files)).find("more than the body holds"), std::string::npos);
}

TEST(AdapterBundle, NoTruncationOrSingleByteChangeIsAcceptedAsTheSameAdapter) {
  auto f = fixture(700);
  const std::string good = make_adapter_bundle("policy-v3", "/p", f.manifest, f.files);
  const std::string digest = parse_adapter_bundle(good).adapter_sha256;
  for (std::size_t n = 0; n < good.size(); ++n) EXPECT_THROW(parse_adapter_bundle(good.substr(0, n)), Error) << n;
  std::mt19937 rng(11);
  for (int i = 0; i < 3000; ++i) {
    std::string b = good;
    const std::size_t pos = rng() % b.size();
    b[pos] = static_cast<char>(b[pos] ^ static_cast<char>(1 + rng() % 255));
    try {
      auto p = parse_adapter_bundle(b);
      // Only the header's free text (name, path, other manifest fields) may change and still parse.
      EXPECT_EQ(p.adapter_sha256, digest) << pos;
      EXPECT_LT(pos, good.find('\n')) << pos;
    } catch (const Error&) {
    }
  }
}

}  // namespace
}  // namespace lorasync::io
