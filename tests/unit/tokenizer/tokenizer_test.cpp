// Unit tests of lorasync_tokenizer: each component on small hand-written tokenizers, plus the
// shipped Qwen2 tokenizer for the ChatML prompt and special ids.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <random>

#include <unistd.h>

#include "core/tokenizer/added_vocab.h"
#include "core/tokenizer/bpe.h"
#include "core/tokenizer/bpe_trainer.h"
#include "core/tokenizer/byte_level.h"
#include "core/tokenizer/chat_template.h"
#include "core/tokenizer/pretokenizer.h"
#include "core/tokenizer/tokenizer.h"
#include "core/tokenizer/unicode.h"
#include "util/error.h"
#include "util/files.h"

namespace lorasync::tok {
namespace {

using json = nlohmann::json;
using Ids = std::vector<std::int32_t>;

const std::string kQwenDir = std::string(LORASYNC_SHARED_DIR) + "/data/qwen2-tokenizer";

const Tokenizer& qwen() {
  static const Tokenizer t = Tokenizer::load(kQwenDir);
  return t;
}

// A tiny character-level BPE tokenizer (no byte level): vocab a b c d ab abc cd, merges as given.
json tiny(json merges) {
  return {{"model",
           {{"type", "BPE"},
            {"vocab", {{"a", 0}, {"b", 1}, {"c", 2}, {"d", 3}, {"ab", 4}, {"abc", 5}, {"cd", 6}}},
            {"merges", merges}}}};
}

std::string error_of(const std::string& text) {
  try {
    (void)Tokenizer::from_json(text);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// ---- BPE ----

TEST(Bpe, MergesInBothFormsGiveTheSameIds) {
  auto a = Tokenizer::from_json(tiny({"a b", "ab c", "c d"}).dump());
  auto b = Tokenizer::from_json(
      tiny(json::array({json::array({"a", "b"}), json::array({"ab", "c"}), json::array({"c", "d"})})).dump());
  EXPECT_EQ(a.encode("abcd"), (Ids{5, 3}));  // ab, abc, then d alone (c is taken)
  EXPECT_EQ(a.encode("abcd"), b.encode("abcd"));
  EXPECT_EQ(a.encode("cdab"), (Ids{6, 4}));
}

TEST(Bpe, LowerRankWinsAndTiesGoLeft) {
  // c d ranks before a b: "abcd" -> a b cd, then ab; abc cannot form since c is merged.
  auto t = Tokenizer::from_json(tiny({"c d", "a b", "ab c"}).dump());
  EXPECT_EQ(t.encode("abcd"), (Ids{4, 6}));
  auto u = Tokenizer::from_json(
      json{{"model", {{"vocab", {{"a", 0}, {"aa", 1}}}, {"merges", {"a a"}}}}}.dump());
  EXPECT_EQ(u.encode("aaa"), (Ids{1, 0}));  // leftmost pair first
  EXPECT_EQ(u.encode("aaaa"), (Ids{1, 1}));
}

TEST(Bpe, IgnoreMergesTakesWholeVocabularyWords) {
  json j = tiny({"a b"});
  j["model"]["vocab"]["abcd"] = 7;
  EXPECT_EQ(Tokenizer::from_json(j.dump()).encode("abcd"), (Ids{4, 2, 3}));
  j["model"]["ignore_merges"] = true;
  EXPECT_EQ(Tokenizer::from_json(j.dump()).encode("abcd"), (Ids{7}));
}

TEST(Bpe, UnknownCharactersUseUnkFuseUnkOrByteFallback) {
  json j = tiny({"a b"});
  j["model"]["vocab"]["<unk>"] = 7;
  j["model"]["unk_token"] = "<unk>";
  EXPECT_EQ(Tokenizer::from_json(j.dump()).encode("axyb"), (Ids{0, 7, 7, 1}));
  j["model"]["fuse_unk"] = true;
  EXPECT_EQ(Tokenizer::from_json(j.dump()).encode("axyb"), (Ids{0, 7, 1}));
  json k = tiny({"a b"});
  k["model"]["byte_fallback"] = true;
  k["model"]["vocab"]["<0xC3>"] = 8;
  k["model"]["vocab"]["<0xA9>"] = 9;
  EXPECT_EQ(Tokenizer::from_json(k.dump()).encode("ab\xC3\xA9"), (Ids{4, 8, 9}));
  // Without unk or fallback the reference drops unknown characters (then a b merge).
  EXPECT_EQ(Tokenizer::from_json(tiny({"a b"}).dump()).encode("axb"), (Ids{4}));
  EXPECT_EQ(Tokenizer::from_json(tiny({"a b"}).dump()).encode("axc"), (Ids{0, 2}));
}

TEST(Bpe, CachedAndUncachedAgreeOnRandomWords) {
  const auto& t = qwen();
  (void)t;
  std::unordered_map<std::string, std::int32_t> vocab;
  std::vector<std::pair<std::string, std::string>> merges;
  // A byte-level model built from scratch: 256 bytes and merges of random pairs.
  for (int b = 0; b < 256; ++b) {
    std::string s;
    utf8_append(s, byte_to_char(static_cast<std::uint8_t>(b)));
    vocab[s] = b;
  }
  std::mt19937 rng(7);
  std::vector<std::string> toks;
  for (auto& [s, id] : vocab) toks.push_back(s);
  std::sort(toks.begin(), toks.end());
  for (int i = 0; i < 400; ++i) {
    std::string a = toks[rng() % 40 + 60], b = toks[rng() % toks.size() % 80 + 40];
    if (vocab.count(a + b)) continue;
    vocab[a + b] = static_cast<std::int32_t>(vocab.size());
    merges.emplace_back(a, b);
    toks.push_back(a + b);
  }
  BpeOptions o;
  o.byte_level_input = true;
  BpeModel m(vocab, merges, o);
  for (int i = 0; i < 500; ++i) {
    std::string w;
    int n = static_cast<int>(rng() % 40) + 1;
    for (int k = 0; k < n; ++k) w.push_back(static_cast<char>('!' + 60 + rng() % 40));
    Ids a, b;
    m.encode_piece(w, a);
    m.encode_piece_uncached(w, b);
    m.encode_piece(w, a);  // second call hits the cache
    Ids bb = b;
    bb.insert(bb.end(), b.begin(), b.end());
    EXPECT_EQ(a, bb) << w;
  }
}

// ---- byte level ----

TEST(ByteLevel, MappingIsGpt2s) {
  EXPECT_EQ(byte_to_char(' '), 0x120u);  // 'Ġ'
  EXPECT_EQ(byte_to_char('\n'), 0x10Au); // 'Ċ'
  EXPECT_EQ(byte_to_char('a'), static_cast<std::uint32_t>('a'));
  EXPECT_EQ(byte_to_char(0xAD), 0x143u);
  for (int b = 0; b < 256; ++b) EXPECT_EQ(char_to_byte(byte_to_char(static_cast<std::uint8_t>(b))), b);
  EXPECT_EQ(char_to_byte('A'), 'A');
  EXPECT_EQ(char_to_byte(0x4E00), -1);
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  EXPECT_EQ(byte_level_to_bytes(bytes_to_byte_level(all)), all);
  EXPECT_FALSE(byte_level_to_bytes("\xE4\xB8\x80").has_value());
}

TEST(ByteLevel, QwenDecodesPartialTokensAndRoundTrips) {
  const auto& t = qwen();
  EXPECT_EQ(t.token_bytes(220), " ");
  EXPECT_EQ(t.token_bytes(198), "\n");
  for (std::string s : {"", " ", "héllo wörld", "👨‍👩‍👧 family", "x\r\n\r\n  y", "日本語のテキスト"})
    EXPECT_EQ(t.decode(t.encode(s)), s);
  // A token holding part of a UTF-8 character decodes alone to U+FFFD.
  std::int32_t partial = -1;
  for (std::int32_t id = 0; id < t.vocab_size() && partial < 0; ++id)
    if (validate_utf8(t.token_bytes(id)) != std::string_view::npos) partial = id;
  ASSERT_GE(partial, 0);
  EXPECT_NE(t.decode(Ids{partial}).find("\xEF\xBF\xBD"), std::string::npos);
}

// ---- pre-tokenizer ----

std::vector<std::string> split_all(std::string_view s, const SplitPattern& p, SplitBehavior b,
                                   bool invert = false) {
  std::vector<Span> scratch;
  std::vector<std::string_view> out;
  split_pieces(s, p, b, invert, scratch, out);
  return {out.begin(), out.end()};
}

TEST(PreTokenizer, SplitBehavioursMatchTheReferenceDocs) {
  auto dash = SplitPattern::literal("-");
  const std::string s = "the-final--countdown";
  using V = std::vector<std::string>;
  EXPECT_EQ(split_all(s, dash, SplitBehavior::kRemoved), (V{"the", "final", "countdown"}));
  EXPECT_EQ(split_all(s, dash, SplitBehavior::kIsolated),
            (V{"the", "-", "final", "-", "-", "countdown"}));
  EXPECT_EQ(split_all(s, dash, SplitBehavior::kMergedWithPrevious),
            (V{"the-", "final-", "-", "countdown"}));
  EXPECT_EQ(split_all(s, dash, SplitBehavior::kMergedWithNext),
            (V{"the", "-final", "-", "-countdown"}));
  EXPECT_EQ(split_all(s, dash, SplitBehavior::kContiguous), (V{"the", "-", "final", "--", "countdown"}));
  EXPECT_EQ(split_all(s, dash, SplitBehavior::kRemoved, true), (V{"-", "-", "-"}));
  auto re = SplitPattern::regex("\\p{N}+");
  EXPECT_EQ(split_all("ab12cd345", re, SplitBehavior::kIsolated), (V{"ab", "12", "cd", "345"}));
  EXPECT_THROW(SplitPattern::regex("(unclosed"), Error);
}

std::vector<std::string> qwen_pieces(std::string_view s) {
  std::vector<Span> spans;
  scan_qwen2(s, spans);
  std::vector<std::string> out;
  for (auto sp : spans) out.emplace_back(s.substr(sp.begin, sp.end - sp.begin));
  return out;
}

TEST(PreTokenizer, Qwen2ScannerFollowsTheRegexAlternatives) {
  using V = std::vector<std::string>;
  EXPECT_EQ(qwen_pieces("Hello world"), (V{"Hello", " world"}));
  EXPECT_EQ(qwen_pieces("I'M can'T we'Ll"), (V{"I", "'M", " can", "'T", " we", "'Ll"}));
  EXPECT_EQ(qwen_pieces("12345"), (V{"1", "2", "3", "4", "5"}));
  EXPECT_EQ(qwen_pieces("a  b"), (V{"a", " ", " b"}));
  EXPECT_EQ(qwen_pieces("a \n\n  b"), (V{"a", " \n\n", " ", " b"}));
  EXPECT_EQ(qwen_pieces("x+= y;\n"), (V{"x", "+=", " y", ";\n"}));
  EXPECT_EQ(qwen_pieces("end   "), (V{"end", "   "}));
  EXPECT_EQ(qwen_pieces("\t\tx"), (V{"\t", "\tx"}));
  EXPECT_EQ(qwen_pieces("你好，世界"), (V{"你好", "，世界"}));
  // Compare with PCRE2 running the same pattern on ASCII, where PCRE2's \s equals White_Space.
  auto pcre = SplitPattern::regex(
      "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
      "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+x");  // (different text: forces the PCRE2 path)
  (void)pcre;
}

TEST(PreTokenizer, ScannersAgreeWithPcre2OnRandomAscii) {
  // The same patterns with a no-op group appended run through PCRE2 instead of the scanners.
  auto q = SplitPattern::regex(
      "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
      "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+(?:)");
  auto g = SplitPattern::regex(
      "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+(?:)");
  ASSERT_EQ(q.kind(), SplitPattern::Kind::kRegex);
  const char alphabet[] = "aZ9 '\t\r\nsStTmMdDlLrReEvV.,;!-_()\"\x0b\x0c";
  std::mt19937 rng(11);
  for (int i = 0; i < 3000; ++i) {
    std::string s;
    int n = static_cast<int>(rng() % 24);
    for (int k = 0; k < n; ++k) s.push_back(alphabet[rng() % (sizeof alphabet - 1)]);
    std::vector<Span> a, b, c, d;
    scan_qwen2(s, a);
    q.find_matches(s, b);
    ASSERT_EQ(a.size(), b.size()) << "qwen2 on " << json(s).dump();
    for (std::size_t k = 0; k < a.size(); ++k)
      ASSERT_TRUE(a[k].begin == b[k].begin && a[k].end == b[k].end) << json(s).dump();
    scan_gpt2(s, c);
    g.find_matches(s, d);
    ASSERT_EQ(c.size(), d.size()) << "gpt2 on " << json(s).dump();
    for (std::size_t k = 0; k < c.size(); ++k)
      ASSERT_TRUE(c[k].begin == d[k].begin && c[k].end == d[k].end) << json(s).dump();
  }
}

TEST(PreTokenizer, ByteLevelAddPrefixSpaceAndRegex) {
  json j = tiny({"a b"});
  j["model"]["vocab"] = json::object();
  for (int b = 0; b < 256; ++b) {
    std::string s;
    utf8_append(s, byte_to_char(static_cast<std::uint8_t>(b)));
    j["model"]["vocab"][s] = b;
  }
  j["model"]["merges"] = json::array();
  j["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"use_regex", true}};
  j["decoder"] = {{"type", "ByteLevel"}};
  auto t = Tokenizer::from_json(j.dump());
  EXPECT_EQ(t.encode("hi"), (Ids{' ', 'h', 'i'}));
  EXPECT_EQ(t.encode(" hi"), (Ids{' ', 'h', 'i'}));
  EXPECT_EQ(t.decode(t.encode("hi")), " hi");
}

// ---- added tokens ----

json with_added(json added) {
  json j = tiny({"a b"});
  j["added_tokens"] = std::move(added);
  return j;
}

json added_token(std::int32_t id, const std::string& content, json flags = json::object()) {
  json t = {{"id", id}, {"content", content}, {"single_word", false}, {"lstrip", false},
            {"rstrip", false}, {"normalized", false}, {"special", true}};
  for (auto& [k, v] : flags.items()) t[k] = v;
  return t;
}

TEST(AddedTokens, LongestFirstAndSpecialParsing) {
  auto t = Tokenizer::from_json(
      with_added({added_token(10, "<x>"), added_token(11, "<x>>"), added_token(12, "dd", {{"special", false}})})
          .dump());
  EXPECT_EQ(t.encode("a<x>>b"), (Ids{0, 11, 1}));
  EXPECT_EQ(t.encode("a<x>b"), (Ids{0, 10, 1}));
  EXPECT_EQ(t.encode("cddc"), (Ids{2, 12, 2}));
  EXPECT_TRUE(t.is_special(10));
  EXPECT_FALSE(t.is_special(12));
  EncodeOptions no;
  no.parse_special = false;
  // '<', 'x', '>' are not in the tiny vocab: dropped (a b then merge); "dd" still matches.
  EXPECT_EQ(t.encode("a<x>b", no), (Ids{4}));
  EXPECT_EQ(t.encode("cddc", no), (Ids{2, 12, 2}));
  // No decoder: the reference joins tokens with spaces.
  EXPECT_EQ(t.decode(Ids{0, 10, 1}), "a <x> b");
  EXPECT_EQ(t.decode(Ids{0, 10, 1}, true), "a b");
}

TEST(AddedTokens, LstripRstripSingleWord) {
  json j = with_added({added_token(10, "X", {{"lstrip", true}}), added_token(11, "Y", {{"rstrip", true}}),
                       added_token(12, "W", {{"single_word", true}})});
  j["model"]["vocab"][" "] = 20;
  auto t = Tokenizer::from_json(j.dump());
  EXPECT_EQ(t.encode("a  X b"), (Ids{0, 10, 20, 1}));
  EXPECT_EQ(t.encode("a Y  b"), (Ids{0, 20, 11, 1}));
  EXPECT_EQ(t.encode("a W b"), (Ids{0, 20, 12, 20, 1}));
  EXPECT_EQ(t.encode("aWc"), (Ids{0, 2}));  // not a single word: 'W' is plain text (unknown, dropped)
}

TEST(AddedTokens, NormalizedTokensMatchAfterNfc) {
  json j = with_added({added_token(10, "e\xCC\x81", {{"normalized", true}, {"special", false}})});
  j["normalizer"] = {{"type", "NFC"}};
  auto t = Tokenizer::from_json(j.dump());
  // "é" precomposed and decomposed both normalise to the token's NFC form.
  EXPECT_EQ(t.encode("a\xC3\xA9"), (Ids{0, 10}));
  EXPECT_EQ(t.encode("ae\xCC\x81"), (Ids{0, 10}));
}

// ---- NFC ----

TEST(Nfc, ComposesReordersAndHandlesHangulAndSingletons) {
  EXPECT_EQ(nfc("e\xCC\x81"), "\xC3\xA9");                   // e + acute -> é
  EXPECT_EQ(nfc("\xE2\x84\xAB"), "\xC3\x85");                // Angstrom sign -> Å
  EXPECT_EQ(nfc("\xE1\x84\x92\xE1\x85\xA1\xE1\x86\xAB"), "\xED\x95\x9C");  // jamo -> 한
  // q + dot below (220) + dot above (230) in either order -> the same canonical order.
  EXPECT_EQ(nfc("q\xCC\x87\xCC\xA3"), "q\xCC\xA3\xCC\x87");
  // a + ring + acute: ring composes (å), acute stays.
  EXPECT_EQ(nfc("a\xCC\x8A\xCC\x81"), "\xC7\xBB");
  EXPECT_EQ(nfc("plain ascii"), "plain ascii");
  EXPECT_TRUE(nfc_quick_check("日本語 text"));
  EXPECT_FALSE(nfc_quick_check("e\xCC\x81"));
  // Composition exclusions stay decomposed (U+0958 DEVANAGARI QA).
  EXPECT_EQ(nfc("\xE0\xA4\x95\xE0\xA4\xBC"), "\xE0\xA4\x95\xE0\xA4\xBC");
}

TEST(Utf8, LossyReplacesMaximalSubparts) {
  EXPECT_EQ(utf8_lossy("a\xFF" "b"), "a\xEF\xBF\xBD" "b");
  EXPECT_EQ(utf8_lossy("\xE4\xBD"), "\xEF\xBF\xBD");          // truncated: one replacement
  EXPECT_EQ(utf8_lossy("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // surrogate
  EXPECT_EQ(validate_utf8("ok \xC3\xA9"), std::string_view::npos);
  EXPECT_EQ(validate_utf8("ok \xC3"), 3u);
}

// ---- incremental decoding ----

TEST(IncrementalDecoder, NeverEmitsBrokenUtf8AndMatchesDecode) {
  const auto& t = qwen();
  for (std::string s : {"👨‍👩‍👧 emoji 🇯🇵🏳️‍🌈", "日本語と한국어と中文", "mixed é ü ß 𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "plain"}) {
    Ids ids = t.encode(s);
    IncrementalDecoder dec(t);
    std::string out;
    bool saw_pending = false;
    for (auto id : ids) {
      std::string piece = dec.push(id);
      EXPECT_EQ(validate_utf8(piece), std::string_view::npos);
      saw_pending |= dec.n_pending() > 0;
      out += piece;
    }
    out += dec.flush();
    EXPECT_EQ(out, s);
    EXPECT_EQ(out, t.decode(ids));
    if (s.find("👨") != std::string::npos) {
      EXPECT_TRUE(saw_pending) << "emoji tokens split bytes";
    }
  }
  // A truncated character at the end of the stream becomes U+FFFD on flush, as decode does.
  std::int32_t partial_id = -1;
  for (std::int32_t id = 0; id < t.vocab_size() && partial_id < 0; ++id)
    if (validate_utf8(t.token_bytes(id)) != std::string_view::npos) partial_id = id;
  Ids partial{partial_id};
  IncrementalDecoder dec(t);
  std::string out = dec.push(partial_id);
  out += dec.flush();
  EXPECT_EQ(out, t.decode(partial));
  EXPECT_THROW(dec.push(t.vocab_size() + 5), Error);
}

// ---- chat template ----

TEST(ChatTemplate, Qwen3KeepsThinkingOnlyAfterTheLastUserMessage) {
  // Qwen3's template: an assistant turn's <think> block is split off; turns before the last user
  // message lose it, the turns after keep it, and the last turn always gets a block.
  std::vector<ChatMessage> msgs = {{"system", "S"},
                                   {"user", "Q1"},
                                   {"assistant", "<think>\nold reasoning\n</think>\n\nA1"},
                                   {"user", "Q2"},
                                   {"assistant", "<think>\nnew\n</think>\n\nA2"}};
  EXPECT_EQ(render_chat(ChatFormat::kQwen3, msgs, {.add_generation_prompt = false}),
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n"
            "<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n<think>\nnew\n</think>\n\nA2<|im_end|>\n");
  // The last assistant turn without a block gets an empty one; a generation prompt with thinking
  // off pre-fills an empty block.
  std::vector<ChatMessage> two = {{"user", "Q"}, {"assistant", "A"}};
  EXPECT_EQ(render_chat(ChatFormat::kQwen3, two, {.add_generation_prompt = false}),
            "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nA<|im_end|>\n");
  std::vector<ChatMessage> one = {{"user", "Q"}};
  EXPECT_EQ(render_chat(ChatFormat::kQwen3, one, {.enable_thinking = false}),
            "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
  EXPECT_EQ(render_chat(ChatFormat::kQwen3, one), "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n");
}

TEST(ChatTemplate, Llama3HeadersTrimContentAndStopAtEotId) {
  std::vector<ChatMessage> msgs = {{"system", " S "}, {"user", "U\n"}, {"assistant", "A"}};
  EXPECT_EQ(render_chat(ChatFormat::kLlama3, msgs),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nU<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nA<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
  EXPECT_EQ(chat_stop_tokens(ChatFormat::kLlama3)[0], "<|eot_id|>");
  EXPECT_EQ(chat_stop_tokens(ChatFormat::kQwen3)[0], "<|im_end|>");
  std::vector<ChatMessage> bad = {{"tool", "x"}};
  EXPECT_THROW((void)render_chat(ChatFormat::kLlama3, bad), Error);
}

TEST(ChatTemplate, TheFormatIsDetectedFromTheTokenizersTemplate) {
  EXPECT_EQ(detect_chat_format(""), ChatFormat::kChatml);
  EXPECT_EQ(detect_chat_format(kChatmlJinja), ChatFormat::kChatml);
  EXPECT_EQ(detect_chat_format("{{'<|im_start|>'}}{% if x %}<think>\n\n</think>{% endif %}"), ChatFormat::kQwen3);
  EXPECT_EQ(detect_chat_format("{{ '<|start_header_id|>' + message['role'] }}"), ChatFormat::kLlama3);
  EXPECT_EQ(parse_chat_format("llama3", "x"), ChatFormat::kLlama3);
  try {
    (void)parse_chat_format("vicuna", "data.prompt_format");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("data.prompt_format"), std::string::npos);
  }
  // From a directory: a list of named templates picks "default"; no file means chatml.
  const auto dir = std::filesystem::temp_directory_path() / ("chatfmt-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  EXPECT_EQ(chat_format_of_dir(dir.string()), ChatFormat::kChatml);
  {
    std::ofstream f(dir / "tokenizer_config.json");
    f << R"({"chat_template": [{"name": "tool_use", "template": "<|im_start|>"},
             {"name": "default", "template": "<|start_header_id|>"}]})";
  }
  EXPECT_EQ(chat_format_of_dir(dir.string()), ChatFormat::kLlama3);
  {
    std::ofstream f(dir / "tokenizer_config.json");
    f << "{not json";
  }
  EXPECT_THROW((void)chat_format_of_dir(dir.string()), Error);
  std::filesystem::remove_all(dir);
}

TEST(ChatTemplate, ChatMlMatchesQwensTemplate) {
  std::vector<ChatMessage> msgs = {{"system", "S"}, {"user", "U"}, {"assistant", "A"}};
  EXPECT_EQ(render_chatml(msgs, false),
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n");
  EXPECT_EQ(chatml_prompt("sys", "What is 1+1?"),
            "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\nWhat is 1+1?<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(chatml_prompt("", "q"), "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n");
  std::vector<ChatMessage> bad = {{"user", "x"}, {"robot", "y"}};
  try {
    (void)render_chatml(bad, true);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("messages[1].role"), std::string::npos);
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput);
  }
  const auto& t = qwen();
  Ids ids = t.encode(chatml_prompt("sys", "hi"));
  EXPECT_EQ(ids.front(), 151644);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), 151645), 2);
  EXPECT_EQ(t.special_tokens().eos, 151645);
  EXPECT_EQ(t.special_tokens().pad, 151643);
  EXPECT_FALSE(t.special_tokens().bos.has_value());
  EXPECT_FALSE(t.special_tokens().add_bos);
}

// ---- loader errors ----

TEST(Loader, ErrorsNameTheField) {
  EXPECT_NE(error_of("{not json").find("not valid JSON"), std::string::npos);
  EXPECT_NE(error_of("{}").find("model: missing"), std::string::npos);
  EXPECT_NE(error_of(tiny({"a b", "ab"}).dump()).find("model.merges[1]"), std::string::npos);
  EXPECT_NE(error_of(tiny({"a b", 7}).dump()).find("model.merges[1]"), std::string::npos);
  EXPECT_NE(error_of(tiny({"a x"}).dump()).find("model.merges[0]"), std::string::npos);
  json j = tiny({"a b"});
  j["model"]["vocab"]["e"] = "five";
  EXPECT_NE(error_of(j.dump()).find("model.vocab[\"e\"]"), std::string::npos);
  j = tiny({"a b"});
  j["pre_tokenizer"] = {{"type", "Whitespace"}};
  EXPECT_NE(error_of(j.dump()).find("pre_tokenizer.type"), std::string::npos);
  j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "(("}}}, {"behavior", "Isolated"}};
  EXPECT_NE(error_of(j.dump()).find("pre_tokenizer.pattern.Regex"), std::string::npos);
  j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"String", "-"}}}, {"behavior", "Sideways"}};
  EXPECT_NE(error_of(j.dump()).find("pre_tokenizer.behavior"), std::string::npos);
  j = tiny({"a b"});
  j["added_tokens"] = {{{"content", "x"}}};
  EXPECT_NE(error_of(j.dump()).find("added_tokens[0].id"), std::string::npos);
  j = tiny({"a b"});
  j["normalizer"] = {{"type", "Lowercase"}};
  EXPECT_NE(error_of(j.dump()).find("normalizer.type"), std::string::npos);
  EXPECT_THROW(Tokenizer::load("/nonexistent/tokenizer.json"), Error);
  // tokenizer_config naming a token that does not exist.
  try {
    (void)Tokenizer::from_json(tiny({"a b"}).dump(), R"({"eos_token": "<nope>"})");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("eos_token"), std::string::npos);
  }
}

TEST(Tokenizer, RejectsInvalidUtf8AndUnknownIds) {
  const auto& t = qwen();
  try {
    (void)t.encode("ok\xC3(");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("offset 2"), std::string::npos);
  }
  EXPECT_THROW((void)t.decode(Ids{-1}), Error);
  EXPECT_THROW((void)t.decode(Ids{t.vocab_size()}), Error);
}

TEST(Tokenizer, BatchEncodingMatchesSingle) {
  const auto& t = qwen();
  std::vector<std::string> texts;
  for (int i = 0; i < 64; ++i) texts.push_back("Problem " + std::to_string(i * 7919) + ": x^2 = " + std::to_string(i));
  auto seq = t.encode_batch(texts);
  auto par = t.encode_batch(texts, {}, 3);
  ASSERT_EQ(seq.size(), texts.size());
  EXPECT_EQ(seq, par);
  for (std::size_t i = 0; i < texts.size(); ++i) EXPECT_EQ(seq[i], t.encode(texts[i]));
}

TEST(Tokenizer, TemplatePostProcessorAddsTokens) {
  json j = tiny({"a b"});
  j["model"]["vocab"]["<s>"] = 9;
  j["post_processor"] = {{"type", "TemplateProcessing"},
                         {"single", {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                                     {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
                         {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {9}}, {"tokens", {"<s>"}}}}}}};
  auto t = Tokenizer::from_json(j.dump());
  EncodeOptions o;
  o.add_special_tokens = true;
  EXPECT_EQ(t.encode("ab", o), (Ids{9, 4}));
  EXPECT_EQ(t.encode("ab"), (Ids{4}));
}

// ---- trainer ----

TEST(Trainer, DeterministicLoadsAndRoundTrips) {
  std::string corpus;
  {
    std::string data = read_file(std::string(LORASYNC_SHARED_DIR) + "/data/eval_math500.jsonl");
    corpus = data.substr(0, 60000);
    corpus = corpus.substr(0, corpus.rfind('\n') + 1);
  }
  corpus += "日本語 テキスト 👍\n";
  BpeTrainerOptions o;
  o.vocab_size = 300;
  o.special_tokens = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
  auto a = train_bpe(corpus, o);
  auto b = train_bpe(corpus, o);
  EXPECT_EQ(a.tokenizer_json, b.tokenizer_json);
  EXPECT_EQ(a.config_json, b.config_json);
  EXPECT_EQ(a.vocab_size, 300);
  EXPECT_EQ(a.n_merges, 300 - 256 - 3);
  auto t = Tokenizer::from_json(a.tokenizer_json, a.config_json);
  EXPECT_EQ(t.vocab_size(), 300);
  EXPECT_EQ(t.special_tokens().eos, 299);
  EXPECT_EQ(t.special_tokens().pad, 297);
  for (std::string s : {std::string("The answer is 42."), corpus, std::string("unseen ✓ ü")}) {
    Ids ids = t.encode(s);
    EXPECT_EQ(t.decode(ids), s);
  }
  EXPECT_LT(static_cast<double>(t.encode(corpus).size()), 0.8 * static_cast<double>(corpus.size()))
      << "learned merges compress the training text";
  Ids ids = t.encode("<|im_start|>user");
  EXPECT_EQ(ids.front(), 298);
  BpeTrainerOptions tiny_vocab;
  tiny_vocab.vocab_size = 100;
  EXPECT_THROW(train_bpe(corpus, tiny_vocab), Error);
}

// Found by the tokenizer_json fuzz target: a number past double range made nlohmann throw
// out_of_range, which escaped instead of the InvalidInput every bad file gets.
TEST(TokenizerLoad, NumbersPastDoubleRangeAreInvalidInput) {
  for (const char* text : {"99E777777778", R"({"model": {"type": "BPE", "vocab": {"a": 1e999}}})"}) {
    try {
      (void)Tokenizer::from_json(text);
      ADD_FAILURE() << text << " loaded";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput) << e.what();
      EXPECT_NE(std::string(e.what()).find("not valid JSON"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace lorasync::tok
