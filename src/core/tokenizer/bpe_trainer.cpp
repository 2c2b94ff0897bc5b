// core/tokenizer/bpe_trainer.cpp
#include "core/tokenizer/bpe_trainer.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <queue>
#include <unordered_map>

#include "core/tokenizer/added_vocab.h"
#include "core/tokenizer/byte_level.h"
#include "core/tokenizer/chat_template.h"
#include "core/tokenizer/pretokenizer.h"
#include "core/tokenizer/unicode.h"
#include "util/error.h"

namespace lorasync::tok {

namespace {

constexpr char kQwen2Regex[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

using Pair = std::uint64_t;
inline Pair make_pair_key(std::int32_t a, std::int32_t b) {
  return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32) |
         static_cast<std::uint32_t>(b);
}
inline std::int32_t left_of(Pair p) { return static_cast<std::int32_t>(p >> 32); }
inline std::int32_t right_of(Pair p) { return static_cast<std::int32_t>(p & 0xFFFFFFFFu); }

struct Word {
  std::vector<std::int32_t> syms;
  std::int64_t count = 0;
};

}  // namespace

TrainedBpe train_bpe(std::string_view corpus, const BpeTrainerOptions& opt) {
  const int n_special = static_cast<int>(opt.special_tokens.size());
  if (opt.vocab_size < 256 + n_special)
    throw_invalid("vocab_size {} cannot hold the 256 byte tokens and {} special tokens",
                  opt.vocab_size, n_special);
  if (std::size_t bad = validate_utf8(corpus); bad != std::string_view::npos)
    throw_invalid("corpus is not valid UTF-8 (byte offset {})", bad);
  for (std::size_t i = 0; i < opt.special_tokens.size(); ++i)
    if (opt.special_tokens[i].empty() ||
        validate_utf8(opt.special_tokens[i]) != std::string_view::npos)
      throw_invalid("special token {} is empty or not valid UTF-8", i);

  // 1. Words: the corpus without special tokens, NFC, split with the Qwen2 pattern.
  std::vector<AddedToken> specials;
  for (std::size_t i = 0; i < opt.special_tokens.size(); ++i)
    specials.push_back({opt.special_tokens[i], static_cast<std::int32_t>(i), true});
  TokenMatcher matcher(specials, opt.special_tokens);
  std::vector<TextSegment> segs;
  matcher.split(corpus, true, segs);
  std::unordered_map<std::string, std::int64_t> counts;
  std::vector<Span> spans;
  for (const TextSegment& seg : segs) {
    if (seg.id >= 0 || seg.end == seg.begin) continue;
    std::string text = nfc(corpus.substr(seg.begin, seg.end - seg.begin));
    spans.clear();
    scan_qwen2(text, spans);
    for (const Span& s : spans) ++counts[text.substr(s.begin, s.end - s.begin)];
  }
  std::vector<std::pair<std::string, std::int64_t>> sorted(counts.begin(), counts.end());
  std::sort(sorted.begin(), sorted.end());  // deterministic word order
  std::vector<Word> words;
  words.reserve(sorted.size());
  for (auto& [w, c] : sorted) {
    Word word;
    word.count = c;
    for (unsigned char b : w) word.syms.push_back(b);
    words.push_back(std::move(word));
  }

  // 2. Vocabulary (raw bytes per id) and pair statistics.
  std::vector<std::string> tokens;
  std::unordered_map<std::string, std::int32_t> token_ids;
  for (int b = 0; b < 256; ++b) {
    tokens.emplace_back(1, static_cast<char>(b));
    token_ids.emplace(tokens.back(), b);
  }
  std::unordered_map<Pair, std::int64_t> pair_count;
  std::unordered_map<Pair, std::vector<std::uint32_t>> pair_words;
  for (std::uint32_t wi = 0; wi < words.size(); ++wi) {
    const auto& s = words[wi].syms;
    for (std::size_t i = 0; i + 1 < s.size(); ++i) {
      Pair p = make_pair_key(s[i], s[i + 1]);
      pair_count[p] += words[wi].count;
      pair_words[p].push_back(wi);
    }
  }
  struct Entry {
    std::int64_t count;
    Pair pair;
  };
  auto worse = [&tokens](const Entry& x, const Entry& y) {  // true when x ranks below y
    if (x.count != y.count) return x.count < y.count;
    const std::string& xa = tokens[static_cast<std::size_t>(left_of(x.pair))];
    const std::string& ya = tokens[static_cast<std::size_t>(left_of(y.pair))];
    if (xa != ya) return xa > ya;
    return tokens[static_cast<std::size_t>(right_of(x.pair))] >
           tokens[static_cast<std::size_t>(right_of(y.pair))];
  };
  std::priority_queue<Entry, std::vector<Entry>, decltype(worse)> heap(worse);
  for (const auto& [p, c] : pair_count) heap.push({c, p});

  // 3. Merge loop.
  std::vector<std::pair<std::int32_t, std::int32_t>> merges;
  const int target = opt.vocab_size - n_special;
  std::vector<std::uint32_t> visited_stamp(words.size(), 0);
  std::uint32_t stamp = 0;
  std::unordered_map<Pair, std::int64_t> delta;
  while (static_cast<int>(tokens.size()) < target && !heap.empty()) {
    Entry top = heap.top();
    heap.pop();
    auto it = pair_count.find(top.pair);
    if (it == pair_count.end() || it->second != top.count) continue;  // stale
    if (top.count < opt.min_frequency || top.count <= 0) break;
    const std::int32_t a = left_of(top.pair), b = right_of(top.pair);
    std::string merged = tokens[static_cast<std::size_t>(a)] + tokens[static_cast<std::size_t>(b)];
    std::int32_t new_id;
    if (auto t = token_ids.find(merged); t != token_ids.end()) {
      new_id = t->second;
    } else {
      new_id = static_cast<std::int32_t>(tokens.size());
      tokens.push_back(merged);
      token_ids.emplace(merged, new_id);
    }
    merges.emplace_back(a, b);
    ++stamp;
    delta.clear();
    std::vector<std::uint32_t> where = std::move(pair_words[top.pair]);
    pair_words.erase(top.pair);
    for (std::uint32_t wi : where) {
      if (visited_stamp[wi] == stamp) continue;
      visited_stamp[wi] = stamp;
      Word& w = words[wi];
      auto& s = w.syms;
      bool has = false;
      for (std::size_t i = 0; i + 1 < s.size(); ++i)
        if (s[i] == a && s[i + 1] == b) has = true;
      if (!has) continue;
      for (std::size_t i = 0; i + 1 < s.size(); ++i) delta[make_pair_key(s[i], s[i + 1])] -= w.count;
      std::vector<std::int32_t> ns;
      ns.reserve(s.size());
      for (std::size_t i = 0; i < s.size();) {
        if (i + 1 < s.size() && s[i] == a && s[i + 1] == b) {
          ns.push_back(new_id);
          i += 2;
        } else {
          ns.push_back(s[i++]);
        }
      }
      s.swap(ns);
      for (std::size_t i = 0; i + 1 < s.size(); ++i) {
        Pair p = make_pair_key(s[i], s[i + 1]);
        delta[p] += w.count;
        if (s[i] == new_id || s[i + 1] == new_id) pair_words[p].push_back(wi);
      }
    }
    // Apply in a fixed order so the heap's contents do not depend on hash iteration order.
    std::vector<std::pair<Pair, std::int64_t>> changes(delta.begin(), delta.end());
    std::sort(changes.begin(), changes.end());
    for (const auto& [p, d] : changes) {
      if (d == 0) continue;
      std::int64_t& c = pair_count[p];
      c += d;
      if (c > 0) heap.push({c, p});
      else pair_count.erase(p);
    }
  }

  // 4. Files.
  using ojson = nlohmann::ordered_json;
  ojson vocab = ojson::object();
  for (std::size_t i = 0; i < tokens.size(); ++i) vocab[bytes_to_byte_level(tokens[i])] = i;
  ojson jmerges = ojson::array();
  for (const auto& [a, b] : merges)
    jmerges.push_back({bytes_to_byte_level(tokens[static_cast<std::size_t>(a)]),
                       bytes_to_byte_level(tokens[static_cast<std::size_t>(b)])});
  ojson added = ojson::array();
  ojson added_decoder = ojson::object();
  for (std::size_t i = 0; i < opt.special_tokens.size(); ++i) {
    const auto id = static_cast<std::int64_t>(tokens.size() + i);
    ojson t = {{"id", id},           {"content", opt.special_tokens[i]}, {"single_word", false},
               {"lstrip", false},    {"rstrip", false},                  {"normalized", false},
               {"special", true}};
    added.push_back(t);
    t.erase("id");
    added_decoder[std::to_string(id)] = t;
  }
  ojson byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false},
                      {"trim_offsets", false}, {"use_regex", false}};
  ojson tj = {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", added},
      {"normalizer", {{"type", "NFC"}}},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers",
         ojson::array({{{"type", "Split"},
                        {"pattern", {{"Regex", kQwen2Regex}}},
                        {"behavior", "Isolated"},
                        {"invert", false}},
                       byte_level})}}},
      {"post_processor", byte_level},
      {"decoder", byte_level},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"continuing_subword_prefix", ""},
        {"end_of_word_suffix", ""},
        {"fuse_unk", false},
        {"byte_fallback", false},
        {"ignore_merges", false},
        {"vocab", vocab},
        {"merges", jmerges}}}};

  auto listed = [&](const char* s) {
    return std::find(opt.special_tokens.begin(), opt.special_tokens.end(), s) !=
           opt.special_tokens.end();
  };
  std::string eos = opt.eos_token;
  if (eos.empty() && n_special > 0) eos = listed("<|im_end|>") ? "<|im_end|>" : opt.special_tokens[0];
  std::string pad = opt.pad_token;
  if (pad.empty()) pad = listed("<|endoftext|>") ? "<|endoftext|>" : eos;
  for (const std::string* s : {&eos, &pad})
    if (!s->empty() && !listed(s->c_str()))
      throw_invalid("eos/pad token {:?} is not one of the special tokens", *s);
  ojson cfg = {{"add_bos_token", false},
               {"add_eos_token", false},
               {"add_prefix_space", false},
               {"added_tokens_decoder", added_decoder},
               {"bos_token", nullptr},
               {"chat_template", std::string(kChatmlJinja)},
               {"clean_up_tokenization_spaces", false},
               {"eos_token", eos.empty() ? ojson(nullptr) : ojson(eos)},
               {"errors", "replace"},
               {"model_max_length", 32768},
               {"pad_token", pad.empty() ? ojson(nullptr) : ojson(pad)},
               {"split_special_tokens", false},
               {"tokenizer_class", "Qwen2Tokenizer"},
               {"unk_token", nullptr}};

  TrainedBpe out;
  out.tokenizer_json = tj.dump(2) + "\n";
  out.config_json = cfg.dump(2) + "\n";
  out.n_merges = static_cast<int>(merges.size());
  out.vocab_size = static_cast<int>(tokens.size()) + n_special;
  return out;
}

}  // namespace lorasync::tok
