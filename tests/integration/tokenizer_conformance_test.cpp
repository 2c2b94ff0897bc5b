// Conformance: lorasync's tokenizer against Hugging Face tokenizers (the Rust library from PyPI,
// in the project's .venv, run by scripts/tokenizer_ref.py) on
//   - a corpus of every problem in ../shared/data/*.jsonl plus edge cases (>= 2,000 strings),
//     with and without special-token parsing, with and without add_special_tokens;
//   - a sweep over every code point in small contexts (letter, space, apostrophe, digit,
//     newline, doubled), comparing NFC output and pre-tokenizer pieces with the reference's own
//     normalizer and pre-tokenizer: the proof that the hand-written scanner equals the regex;
//   - a tokenizer trained by train_bpe, on the same corpus.
// Ids must be identical and decode(encode(x)) == x. A missing .venv or package FAILs with a
// pointer to scripts/setup.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>

#include "core/tokenizer/bpe_trainer.h"
#include "core/tokenizer/byte_level.h"
#include "core/tokenizer/pretokenizer.h"
#include "core/tokenizer/tokenizer.h"
#include "core/tokenizer/unicode.h"
#include "util/error.h"
#include "util/files.h"

namespace lorasync::tok {
namespace {

using json = nlohmann::json;
using Ids = std::vector<std::int32_t>;

const std::string kShared = LORASYNC_SHARED_DIR;
const std::string kSource = LORASYNC_SOURCE_DIR;
const std::string kQwen = kShared + "/data/qwen2-tokenizer/tokenizer.json";
const std::string kPython = LORASYNC_PYTHON;  // the project's .venv interpreter

// Appends one figure to $LORASYNC_FIGURES (scripts/test prints the file after the run).
void figure(const std::string& name, double value, const json& details = json::object()) {
  json row = {{"conformance", name}, {"value", value}};
  row.update(details);
  std::printf("%s\n", row.dump().c_str());
  if (const char* path = std::getenv("LORASYNC_FIGURES")) {
    std::ofstream f(path, std::ios::app);
    f << row.dump() << "\n";
  }
}

std::string ref_command() { return "'" + kPython + "' '" + kSource + "/scripts/tokenizer_ref.py'"; }

std::vector<std::string> edge_cases() {
  std::vector<std::string> v = {
      "", " ", "  ", "   ", "\t", "\t\t x", "\r\n", "a\r\nb", "\n\n\n", " \n \n ", "x  \n  y",
      "abc   ", "   abc", "a \t b", "\r", "\r\r\n\n", " \r\n ", "line1\nline2\r\nline3\rline4",
      "1234567890123456789012345678901234567890", "3.14159265358979", "1,000,000", "x=12345y",
      "0x1F600 0b1010 1e-9 -42 +7", "٣٤٥ ١٢ ۱۲۳", "Ⅻ ½ ² ³ ①②",
      "I'm you're he'll she'd we've it's can't", "I'M YOU'RE HE'LL SHE'D WE'VE IT'S CAN'T",
      "It'S dOn'T wE'Ll", "'s'S'T'RE'VE'M'LL'D'", "'ſ 'ſt", "don’t it’s", "''' ''s 'x",
      "数学是研究数量、结构、变化以及空间等概念的一门学科。", "三角形ABC中，已知AB=3，求BC。",
      "強化学習では、エージェントが報酬を最大化します。", "カタカナ ひらがな 漢字",
      "수학 문제를 단계별로 풀고 답을 적으세요.", "Ｆｕｌｌｗｉｄｔｈ　ｔｅｘｔ！",
      "👨‍👩‍👧‍👦", "🏳️‍🌈", "👍🏽👍🏿", "🇺🇸🇯🇵🇫🇷", "1️⃣ #️⃣", "❤️‍🔥", "🧑🏿‍💻 coding", "😀😃😄😁",
      "e\u0301", "a\u0308\u0304", "A\u030A vs \u00C5 vs \u212B", "n\u0303o", "Tiếng Việt có dấu",
      "q\u0307\u0323", "\u1100\u1161\u11A8", "नमस्ते दुनिया", "مرحبا بالعالم", "שָׁלוֹם", "สวัสดีครับ",
      "Ελληνικά κείμενα", "Русский текст, Ёё", "ﬁ ﬂ ﬀ", "ǅ ǈ ǋ", "İstanbul ıi",
      "\u00a0nbsp\u00a0", "ideographic\u3000space", "em\u2003space", "nel\u0085char",
      "line\u2028sep", "zw\u200bsp", "\ufeffbom", "\u180e", "ctrl\x01\x02\x7f", std::string("nul\0x", 5),
      "int main() {\n    return 0;\n}\n", "def f(x):\n\tif x:\n\t\treturn x**2\n",
      "    indented\n        more\n", "for (int i = 0; i < n; ++i) { a[i] += b[i]; }",
      "{\"key\": [1, 2, 3], \"nested\": {\"a\": null}}", "$\\frac{1}{2} + \\sqrt{x^2+1}$",
      "\\begin{align} x &= 1 \\\\ y &= 2 \\end{align}", "https://example.com/a?b=c&d=e#f",
      "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "a<|endoftext|>b",
      "<|im_end|><|im_end|>", "<|im_start", "<|fim_prefix|>x<|fim_suffix|>y<|fim_middle|>",
      "<tool_call>{}</tool_call>", "<think>\nhmm\n</think>", " <|im_end|> ", "<<|im_end|>>",
      "<|endoftext|>", "<|box_start|>1<|box_end|>", "text<|im_end|>\n\n", "<|im_end", "|im_end|>",
      std::string(1000, 'a'), std::string(500, ' '), std::string(200, '\n'),
      "ab ab ab ab ab ab ab ab", "=\n=\n=\n=\n", "!!!???...,,,", "a-b_c.d/e\\f", "____init____",
  };
  std::string rep;
  for (int i = 0; i < 100; ++i) rep += "ab";
  v.push_back(rep);
  // Seeded random mixtures of the pieces above.
  std::mt19937 rng(2024);
  const std::size_t base = v.size();
  for (int i = 0; i < 400; ++i) {
    std::string s;
    int n = static_cast<int>(rng() % 5) + 2;
    for (int k = 0; k < n; ++k) {
      const std::string& p = v[rng() % base];
      s += p.substr(0, std::min<std::size_t>(p.size(), 80));
      if (rng() % 3 == 0) s += " ";
    }
    if (validate_utf8(s) == std::string_view::npos) v.push_back(s);
  }
  return v;
}

std::vector<std::string> corpus() {
  std::vector<std::string> v;
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(kShared + "/data"))
    if (e.path().extension() == ".jsonl") files.push_back(e.path());
  std::sort(files.begin(), files.end());
  for (const auto& f : files) {
    std::ifstream in(f);
    std::string line;
    while (std::getline(in, line))
      if (!line.empty()) v.push_back(json::parse(line)["problem"].get<std::string>());
  }
  for (auto& s : edge_cases()) v.push_back(std::move(s));
  return v;
}

void write_jsonl(const fs::path& path, const std::vector<std::string>& texts) {
  std::string rows;
  for (const auto& t : texts) rows += json({{"text", t}}).dump() + "\n";
  write_file_durable(path, rows);
}

struct RefOut {
  std::vector<Ids> ids;
  std::vector<std::string> text;
};

// Runs the reference; FAILs (not skips) when the .venv or the package is missing.
RefOut reference(const std::string& impl, const std::string& tokenizer, const fs::path& input,
                 const fs::path& dir, const std::string& flags) {
  RefOut r;
  const fs::path out = dir / ("out_" + impl + ".jsonl");
  std::error_code ec;
  fs::remove(out, ec);
  const std::string cmd = ref_command() + " --impl " + impl + " --tokenizer '" + tokenizer + "' --input '" + input.string() +
                          "' --output '" + out.string() + "' --decode --no-warmup " + flags +
                          " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) {
    ADD_FAILURE() << "cannot run " << kPython << ": run scripts/setup";
    return r;
  }
  std::string log;
  char buf[4096];
  while (std::size_t n = std::fread(buf, 1, sizeof buf, p)) log.append(buf, n);
  int rc = pclose(p);
  if (rc != 0) {
    ADD_FAILURE() << "the reference tokenizer (" << impl << ") did not run (exit " << rc
                  << "). Run scripts/setup to make the .venv with the pinned tokenizers.\n"
                  << log;
    return r;
  }
  std::ifstream in(out);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    auto j = json::parse(line);
    r.ids.push_back(j["ids"].get<Ids>());
    r.text.push_back(j["text"].get<std::string>());
  }
  return r;
}

// Compares ids with the reference; returns the number of mismatching strings.
std::size_t compare(const Tokenizer& tok, const std::vector<std::string>& texts, const RefOut& ref,
                    const EncodeOptions& opts, const std::string& what, bool require_roundtrip) {
  EXPECT_EQ(ref.ids.size(), texts.size()) << what;
  if (ref.ids.size() != texts.size()) return texts.size();
  std::size_t mismatches = 0, reported = 0;
  for (std::size_t i = 0; i < texts.size(); ++i) {
    Ids ours = tok.encode(texts[i], opts);
    if (ours != ref.ids[i]) {
      ++mismatches;
      if (reported++ < 5)
        ADD_FAILURE() << what << ": ids differ for " << json(texts[i]).dump().substr(0, 300)
                      << "\n ours " << json(ours).dump().substr(0, 300) << "\n  ref "
                      << json(ref.ids[i]).dump().substr(0, 300);
    }
    std::string back = tok.decode(ours);
    if (require_roundtrip) {
      // Both tokenizers normalise with NFC: the round trip gives back NFC(x), which is x for
      // every string already in NFC (all but the deliberately decomposed edge cases).
      EXPECT_EQ(back, nfc(texts[i])) << what << ": decode(encode(x)) != NFC(x)";
      if (nfc_quick_check(texts[i])) {
        EXPECT_EQ(back, texts[i]) << what << ": decode(encode(x)) != x";
      }
    }
    EXPECT_EQ(back, ref.text[i]) << what << ": decode differs from the reference";
  }
  return mismatches;
}

class Conformance : public ::testing::Test {
 protected:
  TempDir tmp{"lorasync-tok-conf"};
};

TEST_F(Conformance, QwenTokenizerMatchesTheRustReference) {
  const auto texts = corpus();
  ASSERT_GE(texts.size(), 2000u);
  const fs::path input = tmp.path() / "corpus.jsonl";
  write_jsonl(input, texts);
  const auto tok = Tokenizer::load(kQwen);
  EncodeOptions with, without, add;
  without.parse_special = false;
  add.add_special_tokens = true;
  auto r1 = reference("rust", kQwen, input, tmp.path(), "");
  const auto d1 = compare(tok, texts, r1, with, "rust, special tokens parsed", true);
  EXPECT_EQ(d1, 0u);
  auto r2 = reference("rust", kQwen, input, tmp.path(), "--no-special");
  const auto d2 = compare(tok, texts, r2, without, "rust, no special parsing", true);
  EXPECT_EQ(d2, 0u);
  auto r3 = reference("rust", kQwen, input, tmp.path(), "--add-special");
  const auto d3 = compare(tok, texts, r3, add, "rust, add_special_tokens", true);
  EXPECT_EQ(d3, 0u);
  figure("tokenizers_qwen2_identical_ids_share",
         1.0 - static_cast<double>(d1 + d2 + d3) / static_cast<double>(3 * texts.size()),
         {{"strings", texts.size()}, {"modes", 3}, {"mismatches", d1 + d2 + d3}});
  std::printf("conformance: %zu strings, ids identical to the Rust reference with and without "
              "special-token parsing\n", texts.size());
}

TEST_F(Conformance, CodePointSweepMatchesTheRustReference) {
  // Every code point c (surrogates excepted) in contexts that reach every scanner branch and NFC
  // composition; the reference's normalizer output and pre-tokenizer pieces are compared directly
  // (ids alone would hide a split that no merge crosses).
  std::vector<std::string> texts;
  std::string cur;
  int in_chunk = 0;
  for (std::uint32_t c = 1; c < 0x110000; ++c) {
    if (c >= 0xD800 && c <= 0xDFFF) continue;
    std::string ch;
    utf8_append(ch, c);
    cur += "a" + ch + " " + ch + ch + "'" + ch + "1" + ch + "\n" + ch + "  " + ch + "a ";
    if (++in_chunk == 512) {
      texts.push_back(std::move(cur));
      cur.clear();
      in_chunk = 0;
    }
  }
  if (!cur.empty()) texts.push_back(cur);
  const fs::path input = tmp.path() / "sweep.jsonl";
  write_jsonl(input, texts);
  const fs::path out = tmp.path() / "sweep_ref.jsonl";
  const std::string cmd = ref_command() + " --tokenizer '" + kQwen + "' --input '" + input.string() + "' --output '" + out.string() +
                          "' --pretokenize 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << "reference failed: run scripts/setup";
  std::ifstream in(out);
  std::string line;
  std::size_t row = 0, bad_norm = 0, bad_pieces = 0;
  std::vector<Span> spans;
  while (std::getline(in, line) && row < texts.size()) {
    auto ref = json::parse(line);
    const std::string& t = texts[row];
    if (nfc(t) != ref["normalized"].get<std::string>() && bad_norm++ < 3)
      ADD_FAILURE() << "NFC differs in sweep row " << row;
    spans.clear();
    scan_qwen2(t, spans);
    auto theirs = ref["pieces"].get<std::vector<std::string>>();
    bool same = spans.size() == theirs.size();
    for (std::size_t k = 0; same && k < spans.size(); ++k)
      same = bytes_to_byte_level(t.substr(spans[k].begin, spans[k].end - spans[k].begin)) == theirs[k];
    if (!same && bad_pieces++ < 3) {
      std::size_t k = 0;
      while (k < spans.size() && k < theirs.size() &&
             bytes_to_byte_level(t.substr(spans[k].begin, spans[k].end - spans[k].begin)) == theirs[k])
        ++k;
      ADD_FAILURE() << "pre-tokenizer pieces differ in sweep row " << row << " at piece " << k
                    << ": reference " << json(k < theirs.size() ? theirs[k] : "").dump();
    }
    ++row;
  }
  EXPECT_EQ(row, texts.size());
  EXPECT_EQ(bad_norm, 0u);
  EXPECT_EQ(bad_pieces, 0u);
  figure("tokenizers_code_point_sweep_identical_rows_share",
         static_cast<double>(row - std::max(bad_norm, bad_pieces)) / static_cast<double>(texts.size()),
         {{"rows", texts.size()}, {"code_points", 0x110000 - 1 - 2048}});
  std::printf("code point sweep: %zu code points in %zu rows; NFC and pre-tokenizer pieces "
              "identical in %zu rows (tables: %s)\n",
              static_cast<std::size_t>(0x110000 - 1 - 2048), texts.size(), row - std::max(bad_norm, bad_pieces),
              unicode_version());
}

TEST_F(Conformance, TrainedTokenizerMatchesTheRustReference) {
  std::string train_text = read_file(kShared + "/data/math_sanity_1k5.jsonl");
  BpeTrainerOptions o;
  o.vocab_size = 1024;
  o.special_tokens = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
  auto trained = train_bpe(train_text, o);
  ASSERT_EQ(trained.vocab_size, 1024);
  const fs::path dir = tmp.path() / "trained";
  fs::create_directories(dir);
  write_file_durable(dir / "tokenizer.json", trained.tokenizer_json);
  write_file_durable(dir / "tokenizer_config.json", trained.config_json);
  const auto tok = Tokenizer::load(dir);
  const auto texts = corpus();
  const fs::path input = tmp.path() / "corpus.jsonl";
  write_jsonl(input, texts);
  EncodeOptions with, without;
  without.parse_special = false;
  auto r1 = reference("rust", (dir / "tokenizer.json").string(), input, tmp.path(), "");
  EXPECT_EQ(compare(tok, texts, r1, with, "trained, special tokens parsed", true), 0u);
  auto r2 = reference("rust", (dir / "tokenizer.json").string(), input, tmp.path(), "--no-special");
  EXPECT_EQ(compare(tok, texts, r2, without, "trained, no special parsing", true), 0u);
}

}  // namespace
}  // namespace lorasync::tok
