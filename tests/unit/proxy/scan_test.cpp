// Request scanner and block hashing rules (proxy.md §3.1-3.2), plus a fuzz/property test of the
// scanner against nlohmann::json on random and mutated bodies (never crashes; accepts exactly the
// valid JSON objects up to depth 64).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <random>
#include <regex>
#include <set>

#include "proxy/prompt_scan.h"

#ifndef LORASYNC_FUZZ_ITERS
#define LORASYNC_FUZZ_ITERS 20000
#endif

namespace lorasync::proxy {
namespace {

PromptScan scan_ok(const std::string& body, std::size_t bs = 16) {
  PromptScan s;
  auto e = scan_routed_request(body, bs, s);
  EXPECT_FALSE(e) << body << ": " << (e ? e->message : "");
  return s;
}

std::optional<ScanError> scan_err(const std::string& body) {
  PromptScan s;
  return scan_routed_request(body, 16, s);
}

std::string ids(int n, int base = 0) {
  std::string s = "[";
  for (int i = 0; i < n; ++i) {
    if (i) s += ',';
    s += std::to_string(base + i);
  }
  return s + "]";
}

// H (XXH3-128 with a secret derived from the key): the same key gives the same hashes, another key
// other ones, and distinct inputs (every length 0-300, one byte changed) do not collide.
TEST(Hash128, KeyedDeterministicAndCollisionFreeOnNearInputs) {
  std::string buf(300, '\0');
  for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<char>(i * 7);
  set_hash_key(1, 2);
  const Hash128 a = hash128(buf);
  set_hash_key(1, 3);
  const Hash128 b = hash128(buf);
  set_hash_key(1, 2);
  EXPECT_EQ(hash128(buf), a);
  EXPECT_NE(a, b);
  std::set<std::pair<std::uint64_t, std::uint64_t>> seen;
  for (std::size_t n = 0; n <= buf.size(); ++n) {
    std::string s = buf.substr(0, n);
    EXPECT_TRUE(seen.insert({hash128(s).lo, hash128(s).hi}).second) << n;
    for (std::size_t i = 0; i < n; i += 13) {
      std::string t = s;
      t[i] = static_cast<char>(t[i] ^ 1);
      EXPECT_TRUE(seen.insert({hash128(t).lo, hash128(t).hi}).second) << n << " " << i;
    }
  }
}

TEST(Scan, WholeBlocksOnly) {
  EXPECT_EQ(scan_ok(R"({"prompt":)" + ids(135) + "}").blocks.size(), 8u);
  EXPECT_EQ(scan_ok(R"({"prompt":")" + std::string(63, 'x') + "\"}").blocks.size(), 0u);
  EXPECT_EQ(scan_ok(R"({"prompt":")" + std::string(128, 'x') + "\"}").blocks.size(), 2u);
  EXPECT_EQ(scan_ok(R"({"prompt":)" + ids(16) + "}").kind, PromptKind::kTokenIds);
}

// h_i = H(h_{i-1} || kind || payload) from h_0 = H(model), recomputed here for block sizes on
// both sides of the scanner's stack buffer (64 ids, 128 text bytes) and for text and ids.
TEST(Scan, BlockHashesFollowTheFormulaForSmallAndLargeBlocks) {
  for (std::size_t bs : {1, 16, 64, 65, 100}) {
    const int n = static_cast<int>(3 * bs + bs / 2);  // three whole blocks and a partial one
    auto s = scan_ok(R"({"model":"m","prompt":)" + ids(n, 7) + "}", bs);
    ASSERT_EQ(s.blocks.size(), 3u) << bs;
    Hash128 prev = hash128(std::string_view("m"));
    for (std::size_t b = 0; b < 3; ++b) {
      std::string buf(reinterpret_cast<const char*>(&prev), 16);
      buf += '\x01';
      for (std::size_t i = 0; i < bs; ++i) {
        const std::int64_t v = 7 + static_cast<std::int64_t>(b * bs + i);
        buf.append(reinterpret_cast<const char*>(&v), 8);
      }
      prev = hash128(buf);
      EXPECT_EQ(s.blocks[b], prev) << "ids, block size " << bs << ", block " << b;
    }
    std::string text;
    for (std::size_t i = 0; i < 3 * 4 * bs + 2 * bs; ++i) text += static_cast<char>('a' + i % 26);
    auto t = scan_ok(R"({"model":"m","prompt":")" + text + "\"}", bs);
    ASSERT_EQ(t.blocks.size(), 3u) << bs;
    prev = hash128(std::string_view("m"));
    for (std::size_t b = 0; b < 3; ++b) {
      std::string buf(reinterpret_cast<const char*>(&prev), 16);
      buf += '\x02';
      buf += text.substr(b * 4 * bs, 4 * bs);
      prev = hash128(buf);
      EXPECT_EQ(t.blocks[b], prev) << "text, block size " << bs << ", block " << b;
    }
  }
}

// The blocks of token ids h_1..h_n computed from the spec's formula.
std::vector<Hash128> formula_blocks(std::string_view model, const std::vector<std::int64_t>& v, std::size_t bs) {
  std::vector<Hash128> out;
  Hash128 prev = hash128(model);
  for (std::size_t b = 0; (b + 1) * bs <= v.size(); ++b) {
    std::string buf(reinterpret_cast<const char*>(&prev), 16);
    buf += '\x01';
    buf.append(reinterpret_cast<const char*>(v.data() + b * bs), 8 * bs);
    prev = hash128(buf);
    out.push_back(prev);
  }
  return out;
}

// Token ids are parsed while the body is validated (one pass): random arrays (signs, 1-19 digits,
// random whitespace, keys in any order, a duplicate `prompt` where the last one wins) give the
// formula's blocks.
TEST(Scan, TokenIdsReadInTheValidatingPassGiveTheFormulasBlocks) {
  std::mt19937_64 rng(7);
  const char* const kWs[] = {"", " ", "\n", "\t ", "\r\n  "};
  for (int it = 0; it < 300; ++it) {
    const std::size_t bs = 1 + rng() % 20;
    std::vector<std::int64_t> v(rng() % 90);
    std::string arr = "[";
    for (std::size_t i = 0; i < v.size(); ++i) {
      const int digits = 1 + static_cast<int>(rng() % (it % 10 == 0 ? 19 : 18));
      // (19 digits lead with 1-8: at most 8.99e18, within int64.)
      std::int64_t x = static_cast<std::int64_t>(1 + rng() % (digits == 19 ? 8 : 9));
      for (int d = 1; d < digits; ++d) x = x * 10 + static_cast<std::int64_t>(rng() % 10);
      if (digits == 1 && rng() % 4 == 0) x = 0;
      if (rng() % 3 == 0) x = -x;
      v[i] = x;
      arr += kWs[rng() % 5];
      arr += std::to_string(x);
      arr += kWs[rng() % 5];
      if (i + 1 < v.size()) arr += ',';
    }
    arr += "]";
    std::string model = "m";
    model += std::to_string(rng() % 3);
    std::string body;
    switch (rng() % 3) {
      case 0: body = R"({"model":")" + model + R"(","prompt":)" + arr + "}"; break;
      case 1: body = R"({"prompt":)" + arr + R"(,"max_tokens":8,"model":")" + model + "\"}"; break;
      default: body = R"({"prompt":"replaced","model":")" + model + R"(","prompt":)" + arr + R"(,"messages":[1,2]})"; break;
    }
    const PromptScan sc = scan_ok(body, bs);
    if (v.empty()) {
      EXPECT_TRUE(sc.blocks.empty()) << body;
      continue;
    }
    EXPECT_EQ(sc.kind, PromptKind::kTokenIds) << body;
    EXPECT_EQ(sc.n_units, v.size()) << body;
    EXPECT_EQ(sc.blocks, formula_blocks(model, v, bs)) << body;
  }
  // The last duplicate wins in both directions.
  const std::string ids16 = ids(16);
  EXPECT_EQ(scan_ok(R"({"prompt":)" + ids16 + R"(,"prompt":")" + std::string(64, 'x') + "\"}").kind, PromptKind::kText);
  EXPECT_EQ(scan_ok(R"({"prompt":")" + std::string(64, 'x') + R"(","prompt":)" + ids16 + "}").kind, PromptKind::kTokenIds);
  // `messages` counts only without `prompt`; as token ids it is hashed the same way.
  std::vector<std::int64_t> v16(16);
  for (int i = 0; i < 16; ++i) v16[static_cast<std::size_t>(i)] = i;
  EXPECT_EQ(scan_ok(R"({"messages":)" + ids16 + "}").blocks, formula_blocks("", v16, 16));
}

// The scanner's fast run (64-byte windows of ids separated by "," or ", ") against the formula:
// long arrays in both layouts, aligned anywhere, with one disturbance somewhere in some of them
// (a sign, 8-19 digits, other whitespace, which hand over to the slow path; a leading zero, ",,"
// or a fraction, which must be refused as before).
TEST(Scan, TheFastRunOfIdsGivesTheFormulasBlocksAndRefusesWhatTheSlowPathRefuses) {
  std::mt19937_64 rng(11);
  const auto number = [&](int digits) {
    std::int64_t x = static_cast<std::int64_t>(1 + rng() % (digits == 19 ? 8 : 9));
    for (int d = 1; d < digits; ++d) x = x * 10 + static_cast<std::int64_t>(rng() % 10);
    return x;
  };
  int refused = 0, accepted = 0;
  for (int it = 0; it < 600; ++it) {
    const std::size_t bs = 1 + rng() % 20;
    const bool spaced = rng() % 2;
    std::vector<std::int64_t> v(40 + 2 * (rng() % 300));  // (an even count: `at | 1` is an index)
    std::vector<std::string> toks(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) {
      v[i] = rng() % 10 == 0 ? static_cast<std::int64_t>(rng() % 10) : number(1 + static_cast<int>(rng() % 7));
      toks[i] = std::to_string(v[i]);
    }
    const std::size_t at = rng() % v.size();
    std::string sep_at = spaced ? ", " : ",";
    bool valid = true;
    switch (it % 10) {
      case 0: v[at] = -number(1 + static_cast<int>(rng() % 6)); toks[at] = std::to_string(v[at]); break;
      case 1: v[at] = number(8 + static_cast<int>(rng() % 12)); toks[at] = std::to_string(v[at]); break;
      case 2: sep_at = rng() % 2 ? ",\n" : (rng() % 2 ? " , " : ",  "); break;
      case 3: toks[at] = "0" + std::to_string(1 + rng() % 9); valid = false; break;  // a leading zero
      case 4: sep_at = ",,"; valid = v.size() == at + 1; break;  // (after the last id it is no separator)
      case 5: toks[at | 1] += ".5"; valid = false; break;  // (a fraction first would make it no ids)
      case 6: v[at] = number(8); toks[at] = std::to_string(v[at]); break;  // the longest fast id
      default: break;
    }
    std::string arr = "[";
    for (std::size_t i = 0; i < v.size(); ++i) {
      arr += toks[i];
      if (i + 1 < v.size()) arr += i == at ? sep_at : (spaced ? ", " : ",");
    }
    arr += "]";
    const std::string model(rng() % 70, 'm');  // shifts the array against the windows
    const std::string body = R"({"model":")" + model + R"(","prompt":)" + arr + R"(,"max_tokens":8})";
    PromptScan sc;
    const auto err = scan_routed_request(body, bs, sc);
    if (!valid) {
      EXPECT_TRUE(err.has_value()) << body;
      ++refused;
      continue;
    }
    ASSERT_FALSE(err.has_value()) << err->message << "\n" << body;
    ++accepted;
    EXPECT_EQ(sc.kind, PromptKind::kTokenIds) << body;
    EXPECT_EQ(sc.n_units, v.size()) << body;
    EXPECT_EQ(sc.blocks, formula_blocks(model, v, bs)) << body;
  }
  EXPECT_GT(refused, 100);
  EXPECT_GT(accepted, 300);
}

TEST(Scan, ChainedAndModelSeeded) {
  auto a = scan_ok(R"({"model":"policy-v1","prompt":)" + ids(48) + "}");
  auto b = scan_ok(R"({"model":"policy-v2","prompt":)" + ids(48) + "}");
  auto c = scan_ok(R"({"model":"policy-v1","prompt":)" + ids(32) + "}");
  ASSERT_EQ(a.blocks.size(), 3u);
  for (std::size_t i = 0; i < 3; ++i) EXPECT_NE(a.blocks[i], b.blocks[i]);
  EXPECT_EQ(a.blocks[0], c.blocks[0]);
  EXPECT_EQ(a.blocks[1], c.blocks[1]);
  // Chaining: the same 2nd block after a different 1st block hashes differently.
  auto d = scan_ok(R"({"model":"policy-v1","prompt":)" + ids(16, 1000) + "}");
  EXPECT_NE(a.blocks[0], d.blocks[0]);
  EXPECT_EQ(a.model, "policy-v1");
  // Absent model == "" and text vs ids of the same bytes differ (kind byte).
  EXPECT_EQ(scan_ok(R"({"prompt":)" + ids(16) + "}").blocks[0],
            scan_ok(R"({"model":"","prompt":)" + ids(16) + "}").blocks[0]);
}

TEST(Scan, EscapedAndLiteralTextHashAlike) {
  std::string lit = std::string(60, 'a') + "\xc3\xa9" + "bb";                  // 64 bytes
  std::string esc = std::string(60, 'a') + "\\u00e9" + "bb";
  auto a = scan_ok(R"({"prompt":")" + lit + "\"}");
  auto b = scan_ok(R"({"prompt":")" + esc + "\"}");
  ASSERT_EQ(a.blocks.size(), 1u);
  EXPECT_EQ(a.blocks, b.blocks);
  // Surrogate pair == literal 4-byte UTF-8; \n and \/ escapes.
  auto c = scan_ok(R"({"prompt":")" + std::string(60, 'a') + "\\ud83d\\ude00\"}");
  auto d = scan_ok(R"({"prompt":")" + std::string(60, 'a') + "\xf0\x9f\x98\x80\"}");
  EXPECT_EQ(c.blocks, d.blocks);
  EXPECT_EQ(c.blocks.size(), 1u);
  auto e = scan_ok(R"({"prompt":")" + std::string(62, 'a') + "\\n\\/\"}");
  auto g = scan_ok(std::string(R"({"prompt":")") + std::string(62, 'a') + "\\n/\"}");
  EXPECT_EQ(e.blocks, g.blocks);
}

TEST(Scan, SourceRules) {
  // Batch -> first element.
  EXPECT_EQ(scan_ok(R"({"prompt":[)" + ids(32) + "," + ids(64) + "]}").blocks,
            scan_ok(R"({"prompt":)" + ids(32) + "}").blocks);
  // Strings array, messages, empty, null: zero blocks.
  EXPECT_TRUE(scan_ok(R"({"prompt":["aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"]})").blocks.empty());
  EXPECT_TRUE(scan_ok(R"({"messages":[{"role":"user","content":"hi"}]})").blocks.empty());
  EXPECT_TRUE(scan_ok(R"({"prompt":[]})").blocks.empty());
  // prompt: null beats messages (even a string messages).
  EXPECT_TRUE(scan_ok(R"({"prompt":null,"messages":")" + std::string(64, 'x') + "\"}").blocks.empty());
  EXPECT_EQ(scan_ok(R"({"messages":")" + std::string(64, 'x') + "\"}").blocks.size(), 1u);
  // Last duplicate key wins.
  EXPECT_EQ(scan_ok(R"({"prompt":)" + ids(16) + R"(,"prompt":)" + ids(32) + "}").blocks.size(), 2u);
  EXPECT_EQ(scan_ok(R"({"model":"a","model":"b","prompt":[]})").model, "b");
  // Escaped key names still match.
  EXPECT_EQ(scan_ok(R"({"mod\u0065l":"z"})").model, "z");
}

// `stream` labels the first-byte histogram: only a top-level true counts, the last one if repeated.
TEST(Scan, StreamIsTheTopLevelTrue) {
  EXPECT_TRUE(scan_ok(R"({"prompt":[1],"stream":true})").stream);
  EXPECT_TRUE(scan_ok(R"({"str\u0065am" : true})").stream);
  EXPECT_FALSE(scan_ok(R"({"prompt":[1]})").stream);
  EXPECT_FALSE(scan_ok(R"({"stream":false,"echo":true,"logprobs":true})").stream);
  EXPECT_FALSE(scan_ok(R"({"stream":"true"})").stream);
  EXPECT_FALSE(scan_ok(R"({"stream":1})").stream);
  EXPECT_FALSE(scan_ok(R"({"stream_options":{"stream":true},"prompt":"stream true"})").stream);
  EXPECT_FALSE(scan_ok(R"({"stream":true,"stream":null})").stream);
  EXPECT_TRUE(scan_ok(R"({"stream":false,"stream":true})").stream);
}

TEST(Scan, BadTypesAre400) {
  EXPECT_EQ(scan_err(R"({"model":5})")->param, "model");
  EXPECT_EQ(scan_err(R"({"prompt":5})")->param, "prompt");
  EXPECT_EQ(scan_err(R"({"prompt":true})")->param, "prompt");
  EXPECT_EQ(scan_err(R"({"prompt":{"a":1}})")->param, "prompt");
  EXPECT_EQ(scan_err(R"({"prompt":[1,2,"x"]})")->param, "prompt");
  EXPECT_EQ(scan_err(R"({"prompt":[1,2.5]})")->param, "prompt");
  EXPECT_EQ(scan_err(R"({"prompt":[1,99999999999999999999]})")->param, "prompt");
  EXPECT_TRUE(scan_err(R"({"prompt":[-9223372036854775808, 9223372036854775807]})") == std::nullopt);
  EXPECT_TRUE(scan_err("[1,2]").has_value());
  EXPECT_TRUE(scan_err("{\"a\":1").has_value());
  EXPECT_TRUE(scan_err("{\"a\":1} x").has_value());
  EXPECT_TRUE(scan_err("").has_value());
  EXPECT_TRUE(scan_err("{\"a\":\"\x01\"}").has_value());
  std::string deep = "{\"a\":" + std::string(70, '[') + std::string(70, ']') + "}";
  EXPECT_TRUE(scan_err(deep).has_value());
  std::string ok_depth = "{\"a\":" + std::string(60, '[') + std::string(60, ']') + "}";
  EXPECT_FALSE(scan_err(ok_depth).has_value());
}

TEST(Scan, LoraName) {
  std::string n;
  EXPECT_FALSE(scan_lora_name(R"({"lora_name":"policy-v3","lora_path":"/x"})", n));
  EXPECT_EQ(n, "policy-v3");
  EXPECT_TRUE(scan_lora_name(R"({"lora_name":3})", n));
  EXPECT_TRUE(scan_lora_name(R"({"lora_path":"/x"})", n));
  EXPECT_TRUE(scan_lora_name(R"(["lora_name"])", n));
}

// Random JSON-ish bodies and mutations of valid ones: the scanner agrees with nlohmann on
// validity (for objects within the depth bound) and never crashes or reads out of bounds.
TEST(ScanFuzz, AgreesWithReferenceParser) {
  std::mt19937_64 rng(777);
  const std::vector<std::string> seeds = {
      R"({"model":"policy-v1","prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17],"stream":true})",
      R"({"model":"m","prompt":"hello \u00e9 \ud83d\ude00 world","max_tokens":16})",
      R"({"messages":[{"role":"user","content":"2+2?"}],"temperature":0.5e-1,"n":1})",
      R"({"prompt":[[1,2,3],[4,5]],"model":null,"x":{"y":[true,false,null,-0.5E+3]}})"};
  const std::string alphabet = "{}[]\",:0123456789-+.eEtrufalsn \\u\x01\xff";
  int valid_seen = 0;
  for (int it = 0; it < LORASYNC_FUZZ_ITERS; ++it) {
    std::string body = seeds[rng() % seeds.size()];
    int n_mut = static_cast<int>(rng() % 4);
    for (int m = 0; m < n_mut && !body.empty(); ++m) {
      std::size_t pos = rng() % body.size();
      switch (rng() % 3) {
        case 0: body[pos] = alphabet[rng() % alphabet.size()]; break;
        case 1: body.erase(pos, 1 + rng() % 3); break;
        default: body.insert(pos, 1, alphabet[rng() % alphabet.size()]); break;
      }
    }
    if (rng() % 10 == 0) body = body.substr(0, rng() % (body.size() + 1));
    PromptScan s;
    auto err = scan_routed_request(body, 1 + rng() % 16, s);
    // nlohmann rejects lone surrogate escapes; Python's json (the reference) and we accept them.
    static const std::regex kSurrogate(R"(\\u[dD][89a-fA-F][0-9a-fA-F]{2})");
    bool ref_valid = nlohmann::json::accept(std::regex_replace(body, kSurrogate, "\\u0041"));
    bool ref_object = false, ref_stream = false;
    if (ref_valid) {
      const auto j = nlohmann::json::parse(std::regex_replace(body, kSurrogate, "\\u0041"));
      ref_object = j.is_object();
      ref_stream = ref_object && j.contains("stream") && j["stream"].is_boolean() && j["stream"].get<bool>();
    }
    if (!ref_object) {
      EXPECT_TRUE(err.has_value()) << body;
    } else {
      ++valid_seen;
      EXPECT_EQ(json_is_valid(body), true) << body;
      if (err) {
        EXPECT_FALSE(err->param.empty()) << body << " -> " << err->message;  // only type errors
      } else {
        EXPECT_EQ(s.stream, ref_stream) << body;
      }
    }
  }
  EXPECT_GT(valid_seen, 100);
}

// The cached-token count of an answer: the last complete one, whatever the split into pieces.
std::optional<std::uint64_t> cached_of(const std::vector<std::string>& pieces) {
  CachedTokensScanner c;
  for (const auto& p : pieces) c.feed(p);
  return c.value();
}

TEST(CachedTokensScanner, ReadsEitherKeyAndTheLastCountWins) {
  EXPECT_EQ(cached_of({R"({"usage":{"prompt_tokens":80,"cached_prompt_tokens":64}})"}), 64u);
  EXPECT_EQ(cached_of({R"({"usage":{"prompt_tokens_details":{"cached_tokens": 32}}})"}), 32u);
  EXPECT_EQ(cached_of({R"(data: {"cached_tokens":1}\n\ndata: {"cached_tokens":2}\n\n)"}), 2u);
  EXPECT_EQ(cached_of({R"({"usage":{"prompt_tokens":80}})"}), std::nullopt);
  EXPECT_EQ(cached_of({R"({"not_cached_tokens":5,"cached_token":6})"}), std::nullopt);
  // A count cut at the end of what has arrived is not taken until its delimiter arrives...
  EXPECT_EQ(cached_of({R"({"cached_tokens":12)"}), std::nullopt);
  EXPECT_EQ(cached_of({R"({"cached_tokens":12)", "34}"}), 1234u);
  // ...and a run of digits too long for a count is no count, nor one past more than 8 spaces
  // and colons (whole or split: what is read must fit the tail carried between pieces).
  EXPECT_EQ(cached_of({R"({"cached_tokens":123456789012345678901})"}), std::nullopt);
  const std::string spaced = R"({"cached_tokens":)" + std::string(50, ' ') + "7}";
  EXPECT_EQ(cached_of({spaced}), std::nullopt);
  EXPECT_EQ(cached_of({spaced.substr(0, 60), spaced.substr(60)}), std::nullopt);
  EXPECT_EQ(cached_of({R"({"cached_tokens":)" + std::string(7, ' ') + "7}"}), 7u);
}

TEST(CachedTokensScanner, PropertySplitAnywhereGivesTheWholeBodysValue) {
  std::mt19937 rng(7);
  const std::vector<std::string> keys = {"\"cached_prompt_tokens\"", "\"cached_tokens\"", "\"cached_\"", "\"prompt_tokens\""};
  for (int iter = 0; iter < 2000; ++iter) {
    // A body of JSON-like filler with keys and counts at random places.
    std::string body;
    std::optional<std::uint64_t> expect;
    const int parts = static_cast<int>(rng() % 8);
    for (int k = 0; k < parts; ++k) {
      body.append(rng() % 200, "x\",: {}"[rng() % 7]);
      const std::string& key = keys[rng() % keys.size()];
      const std::uint64_t v = rng() % 100000;
      const std::size_t before = rng() % 3, after = rng() % 2 ? rng() % 12 : 0;
      body += key + std::string(before, ' ') + ":" + std::string(after, ' ') + std::to_string(v) + ",";
      if ((key == keys[0] || key == keys[1]) && before + 1 + after <= 8) expect = v;
    }
    body += "}";
    ASSERT_EQ(cached_of({body}), expect) << body;
    // Split into random pieces, from 1 byte to longer than the carried tail.
    std::vector<std::string> pieces;
    for (std::size_t at = 0; at < body.size();) {
      const std::size_t n = std::min<std::size_t>(body.size() - at, 1 + rng() % (rng() % 2 ? 8 : 300));
      pieces.push_back(body.substr(at, n));
      at += n;
    }
    ASSERT_EQ(cached_of(pieces), expect) << body;
  }
}

}  // namespace
}  // namespace lorasync::proxy
