// rl/dataset.cpp: JSONL problem sets. The whole file is validated before anything is tokenized, so
// a bad row late in a large file fails fast; rows are tokenized one at a time so a tokenizer error
// (invalid UTF-8 cannot get past the JSON parser, but the tokenizer is the last word) still names
// the line.
#include "rl/dataset.h"

#include <algorithm>

#include <nlohmann/json.hpp>

#include <string_view>

#include "core/tokenizer/chat_template.h"
#include "util/error.h"
#include "util/files.h"

namespace lorasync::rl {

namespace {

using nlohmann::json;

struct Row {
  std::int64_t line = 0;  // 1-based
  std::string problem;
  std::vector<std::string> answers;
};

bool is_blank(std::string_view s) {
  for (char c : s)
    if (c != ' ' && c != '\t' && c != '\r' && c != '\n' && c != '\f' && c != '\v') return false;
  return true;
}

// A JSON value's short description for messages ("a number", "null").
const char* type_name(const json& v) {
  switch (v.type()) {
    case json::value_t::null: return "null";
    case json::value_t::object: return "an object";
    case json::value_t::array: return "a list";
    case json::value_t::string: return "a string";
    case json::value_t::boolean: return "a boolean";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned:
    case json::value_t::number_float: return "a number";
    default: return "an unsupported value";
  }
}

// An acceptable answer: a string, or a number kept as its JSON text (the AMC set stores ints).
bool answer_text(const json& v, std::string& out) {
  if (v.is_string()) {
    out = v.get<std::string>();
    return true;
  }
  if (v.is_number_integer()) {
    out = v.is_number_unsigned() ? std::to_string(v.get<std::uint64_t>())
                                 : std::to_string(v.get<std::int64_t>());
    return true;
  }
  if (v.is_number_float()) {
    out = v.dump();
    return true;
  }
  return false;
}

Row parse_row(std::string_view line_text, std::int64_t line, const std::string& where,
              const DatasetOptions& opt) {
  json j;
  try {
    j = json::parse(line_text);
  } catch (const json::exception& e) {
    throw_invalid("{} line {}: not valid JSON ({})", where, line, e.what());
  }
  if (!j.is_object())
    throw_invalid("{} line {}: expected a JSON object, got {}", where, line, type_name(j));
  Row r;
  r.line = line;
  auto p = j.find(opt.problem_key);
  if (p == j.end())
    throw_invalid("{} line {}: missing field '{}' ({})", where, line, opt.problem_key,
                  opt.problem_key_setting);
  if (!p->is_string())
    throw_invalid("{} line {}: field '{}' must be a string, got {}", where, line, opt.problem_key,
                  type_name(*p));
  r.problem = p->get<std::string>();
  auto a = j.find(opt.answer_key);
  if (a == j.end())
    throw_invalid("{} line {}: missing field '{}' ({})", where, line, opt.answer_key,
                  opt.answer_key_setting);
  std::string text;
  if (a->is_array()) {
    if (a->empty())
      throw_invalid("{} line {}: field '{}' is an empty list (at least one answer is needed)", where,
                    line, opt.answer_key);
    for (std::size_t i = 0; i < a->size(); ++i) {
      if (!answer_text((*a)[i], text))
        throw_invalid("{} line {}: field '{}'[{}] must be a string, got {}", where, line,
                      opt.answer_key, i, type_name((*a)[i]));
      r.answers.push_back(std::move(text));
    }
  } else if (answer_text(*a, text)) {
    r.answers.push_back(std::move(text));
  } else {
    throw_invalid("{} line {}: field '{}' must be a string or a list of strings, got {}", where,
                  line, opt.answer_key, type_name(*a));
  }
  return r;
}

}  // namespace

std::string render_prompt(const std::string& problem, const DatasetOptions& opt) {
  if (opt.prompt_format == "raw") return problem;
  if (opt.prompt_format != "chatml" && opt.prompt_format != "qwen3" && opt.prompt_format != "llama3")
    throw_invalid("{} = {:?} is not one of chatml, qwen3, llama3, raw", opt.prompt_format_setting, opt.prompt_format);
  std::vector<tok::ChatMessage> msgs;
  if (!opt.system_prompt.empty()) msgs.push_back({"system", opt.system_prompt});
  msgs.push_back({"user", problem});
  tok::ChatOptions co;
  co.enable_thinking = opt.enable_thinking;
  return tok::render_chat(tok::parse_chat_format(opt.prompt_format, opt.prompt_format_setting), msgs, co);
}

Dataset index_dataset(std::int64_t n) {
  Dataset d;
  d.file = "env.rows";
  d.n_rows = n;
  d.problems.reserve(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) d.problems.push_back({i, "", {}, {}});
  return d;
}

Dataset load_dataset(const std::filesystem::path& jsonl, const tok::Tokenizer& tokenizer,
                     const DatasetOptions& opt) {
  render_prompt("", opt);  // an unknown format throws here, before the file is read
  if (opt.max_prompt_tokens < 1)
    throw_invalid("{} must be at least 1, got {}", opt.max_prompt_tokens_setting,
                  opt.max_prompt_tokens);
  const std::string where = opt.file_setting + " " + jsonl.string();
  const std::string text = read_file(jsonl);

  std::vector<Row> rows;
  std::int64_t line = 0;
  std::size_t pos = 0;
  while (pos < text.size()) {
    std::size_t nl = text.find('\n', pos);
    if (nl == std::string::npos) nl = text.size();
    std::string_view l(text.data() + pos, nl - pos);
    pos = nl + 1;
    ++line;
    if (is_blank(l)) continue;
    rows.push_back(parse_row(l, line, where, opt));
  }
  if (rows.empty()) throw_invalid("{}: no rows (the file is empty or blank)", where);

  Dataset d;
  d.file = jsonl.string();
  d.n_rows = static_cast<std::int64_t>(rows.size());
  d.problems.reserve(rows.size());
  tok::EncodeOptions eo;
  eo.parse_special = true;       // <|im_start|> etc. as single ids
  eo.add_special_tokens = false; // no BOS
  std::vector<std::int32_t> ids;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    Row& r = rows[i];
    const std::string prompt = render_prompt(r.problem, opt);
    ids.clear();
    try {
      tokenizer.encode_into(prompt, ids, eo);
    } catch (const Error& e) {
      throw_invalid("{} line {}: field '{}' cannot be tokenized: {}", where, r.line, opt.problem_key,
                    e.what());
    }
    if (static_cast<std::int64_t>(ids.size()) > opt.max_prompt_tokens) {
      ++d.skipped_long;
      continue;
    }
    Problem p;
    p.index = static_cast<std::int64_t>(i);
    p.problem = std::move(r.problem);
    p.answers = std::move(r.answers);
    p.prompt_ids.assign(ids.begin(), ids.end());
    d.problems.push_back(std::move(p));
  }
  if (d.problems.empty())
    throw_invalid("{}: all {} prompts are longer than {} = {} tokens", where, d.n_rows,
                  opt.max_prompt_tokens_setting, opt.max_prompt_tokens);
  return d;
}

const Problem* find_problem(const Dataset& data, std::int64_t index) {
  auto it = std::lower_bound(data.problems.begin(), data.problems.end(), index,
                             [](const Problem& p, std::int64_t i) { return p.index < i; });
  return it != data.problems.end() && it->index == index ? &*it : nullptr;
}

}  // namespace lorasync::rl
