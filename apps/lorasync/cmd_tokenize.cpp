// `lorasync tokenize`: encode text (or a JSONL file of {"text": ...} rows) to ids, or decode ids.
//   lorasync tokenize --tokenizer DIR --text "..."            -> {"ids": [...]}
//   lorasync tokenize --tokenizer DIR --input rows.jsonl      -> one {"ids": [...]} line per row
//   lorasync tokenize --tokenizer DIR --decode --ids 1,2,3    -> {"text": "..."}
#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>

#include "commands.h"
#include "core/tokenizer/tokenizer.h"
#include "util/error.h"
#include "util/strings.h"

namespace lorasync::cli {

namespace {

struct TokenizeOptions {
  std::string tokenizer;       // tokenizer.json or its directory
  std::string text;            // text to encode
  bool text_given = false;
  std::string input;           // JSONL file of {"text": ...} rows
  bool decode = false;         // decode --ids instead of encoding
  std::string ids;             // "1,2,3"
  bool no_special = false;     // do not parse special tokens in the text
  bool add_special = false;    // apply the post-processor / add_bos/add_eos
  bool skip_special = false;   // decode: drop special tokens
};

void print_line(const nlohmann::json& j) {
  std::string s = j.dump() + "\n";
  std::fwrite(s.data(), 1, s.size(), stdout);
}

int run(const TokenizeOptions& o) {
  auto tok = tok::Tokenizer::load(o.tokenizer);
  if (o.decode) {
    if (o.text_given || !o.input.empty()) throw_invalid("--decode takes --ids, not --text/--input");
    std::vector<std::int32_t> ids;
    for (std::int64_t v : parse_int_list(o.ids, "--ids")) {
      if (v < 0 || v > 0x7FFFFFFF) throw_invalid("--ids: {} is not a token id", v);
      ids.push_back(static_cast<std::int32_t>(v));
    }
    print_line({{"text", tok.decode(ids, o.skip_special)}});
    return 0;
  }
  tok::EncodeOptions eo;
  eo.parse_special = !o.no_special;
  eo.add_special_tokens = o.add_special;
  if (o.text_given == !o.input.empty()) throw_invalid("give exactly one of --text and --input");
  if (o.text_given) {
    print_line({{"ids", tok.encode(o.text, eo)}});
    return 0;
  }
  std::ifstream in(o.input, std::ios::binary);
  if (!in) throw_not_found("--input {} cannot be opened", o.input);
  std::string line;
  std::size_t line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (trim(line).empty()) continue;
    nlohmann::json row;
    try {
      row = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      throw_invalid("{}:{}: not valid JSON: {}", o.input, line_no, e.what());
    }
    if (!row.is_object() || !row.contains("text") || !row["text"].is_string())
      throw_invalid("{}:{}: expected {{\"text\": \"...\"}}", o.input, line_no);
    print_line({{"ids", tok.encode(row["text"].get<std::string>(), eo)}});
  }
  return 0;
}

}  // namespace

void register_tokenize(CLI::App& root, Registry& reg) {
  auto o = std::make_shared<TokenizeOptions>();
  auto* sub = root.add_subcommand("tokenize", "encode text to token ids or decode ids (JSON out)");
  sub->add_option("--tokenizer", o->tokenizer, "tokenizer.json or the directory holding it")
      ->required();
  sub->add_option("--text", o->text, "text to encode")->each([o](const std::string&) {
    o->text_given = true;
  });
  sub->add_option("--input", o->input, "JSONL file of {\"text\": ...} rows; one {\"ids\"} row each");
  sub->add_flag("--decode", o->decode, "decode --ids to text");
  sub->add_option("--ids", o->ids, "comma-separated ids for --decode");
  sub->add_flag("--no-special", o->no_special, "treat special tokens in the text as plain text");
  sub->add_flag("--add-special", o->add_special, "add the post-processor's / config's bos/eos");
  sub->add_flag("--skip-special", o->skip_special, "decode: leave special tokens out");
  reg.add(sub, [o] { return run(*o); });
}

}  // namespace lorasync::cli
