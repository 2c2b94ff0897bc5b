// Tests of rl/dataset: the spec's prompt string, the shipped sanity set with the real Qwen2
// tokenizer, every row rejection rule (file, line and field named), long-prompt skipping, and a
// property test: random byte mutations of a valid file either load or throw InvalidInput.
#include "rl/dataset.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <random>

#include "util/error.h"
#include "util/files.h"

namespace lorasync::rl {
namespace {

const tok::Tokenizer& qwen() {
  static const tok::Tokenizer t =
      tok::Tokenizer::load(fs::path(LORASYNC_SHARED_DIR) / "data" / "qwen2-tokenizer");
  return t;
}

// Writes `text` to a file in a fresh temp dir and loads it; the dir lives as long as the test.
struct Jsonl {
  TempDir dir{"lorasync-dataset"};
  fs::path path;
  explicit Jsonl(const std::string& text) : path(dir.path() / "x.jsonl") { write_file_atomic(path, text); }
  Dataset load(const DatasetOptions& o = {}) const { return load_dataset(path, qwen(), o); }
};

// The InvalidInput message of loading `text`, or "" when it loads.
std::string load_error(const std::string& text, const DatasetOptions& o = {}) {
  Jsonl f(text);
  try {
    f.load(o);
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput) << e.what();
    return e.what();
  }
  return "";
}

bool contains(const std::string& s, const std::string& needle) { return s.find(needle) != std::string::npos; }

TEST(Dataset, ChatmlPromptIsTheSpecTemplate) {
  DatasetOptions o;
  EXPECT_EQ(render_prompt("What is $1+1$?", o),
            "<|im_start|>system\nPlease reason step by step, and put your final answer within "
            "\\boxed{}.<|im_end|>\n<|im_start|>user\nWhat is $1+1$?<|im_end|>\n"
            "<|im_start|>assistant\n");
  o.system_prompt = "";
  EXPECT_EQ(render_prompt("Q", o), "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n");
  o.prompt_format = "raw";
  EXPECT_EQ(render_prompt("What is $1+1$?", o), "What is $1+1$?");
  // The other families' formats (core/tokenizer/chat_template.h).
  o.prompt_format = "qwen3";
  o.enable_thinking = false;
  EXPECT_EQ(render_prompt("Q", o), "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
  o.prompt_format = "llama3";
  o.system_prompt = "S";
  EXPECT_EQ(render_prompt("Q", o),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nQ<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n");
  o.prompt_format = "alpaca";
  try {
    render_prompt("Q", o);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput);
    EXPECT_TRUE(contains(e.what(), "data.prompt_format")) << e.what();
    EXPECT_TRUE(contains(e.what(), "alpaca")) << e.what();
  }
  // load_dataset refuses the format before reading the file.
  EXPECT_TRUE(contains(load_error("{\"problem\": \"a\", \"answer\": \"b\"}\n", o), "alpaca"));
}

TEST(Dataset, SanitySetLoads) {
  const fs::path file = fs::path(LORASYNC_SHARED_DIR) / "data" / "math_sanity_1k5.jsonl";
  // With the default limit of 1024 tokens one prompt (an [asy] figure, 2,222 characters) is
  // skipped; it keeps its index and the row count stays 1,460.
  Dataset dd = load_dataset(file, qwen(), DatasetOptions{});
  EXPECT_EQ(dd.n_rows, 1460);
  EXPECT_EQ(dd.skipped_long, 1);
  EXPECT_EQ(dd.problems.size() + 1, 1460u);
  DatasetOptions all;
  all.max_prompt_tokens = 4096;
  Dataset d = load_dataset(file, qwen(), all);
  EXPECT_EQ(d.n_rows, 1460);
  ASSERT_EQ(d.problems.size(), 1460u);
  EXPECT_EQ(d.skipped_long, 0);
  EXPECT_EQ(d.file, file.string());
  for (const Problem& p : dd.problems) ASSERT_EQ(p.prompt_ids, d.problems[static_cast<std::size_t>(p.index)].prompt_ids);
  const auto im_start = *qwen().token_to_id("<|im_start|>");
  const auto im_end = *qwen().token_to_id("<|im_end|>");
  std::int64_t lo = 1 << 30, hi = 0;
  double sum = 0;
  std::vector<std::int64_t> lengths;
  for (std::size_t i = 0; i < d.problems.size(); ++i) {
    const Problem& p = d.problems[i];
    ASSERT_EQ(p.index, static_cast<std::int64_t>(i));
    ASSERT_FALSE(p.answers.empty());
    ASSERT_FALSE(p.problem.empty());
    const auto n = static_cast<std::int64_t>(p.prompt_ids.size());
    lo = std::min(lo, n);
    hi = std::max(hi, n);
    sum += static_cast<double>(n);
    lengths.push_back(n);
    // No BOS: the prompt starts with <|im_start|> as one id and ends with "assistant\n".
    ASSERT_EQ(p.prompt_ids.front(), im_start);
  }
  const double mean = sum / static_cast<double>(d.problems.size());
  std::sort(lengths.begin(), lengths.end());
  const std::int64_t median = lengths[lengths.size() / 2];
  auto at = [&](double q) {
    return static_cast<long long>(lengths[static_cast<std::size_t>(q * static_cast<double>(lengths.size() - 1))]);
  };
  std::printf("sanity set: %zu prompts, tokens min %lld p25 %lld median %lld p75 %lld mean %.1f max %lld\n",
              d.problems.size(), static_cast<long long>(lo), at(0.25), static_cast<long long>(median),
              at(0.75), mean, static_cast<long long>(hi));
  // trainer.md §7: "about 100-135 tokens long" (the bulk; a long tail of figures above).
  EXPECT_GE(median, 90);
  EXPECT_LE(median, 135);
  EXPECT_GE(mean, 90.0);
  EXPECT_LE(mean, 150.0);
  EXPECT_GE(lo, 40);
  EXPECT_GT(hi, 1024);

  // The ids decode back to exactly the rendered string; <|im_end|> is a single id.
  const Problem& p0 = d.problems[0];
  std::vector<std::int32_t> ids(p0.prompt_ids.begin(), p0.prompt_ids.end());
  EXPECT_EQ(qwen().decode(ids), render_prompt(p0.problem, DatasetOptions{}));
  EXPECT_EQ(std::count(ids.begin(), ids.end(), im_end), 2);
  EXPECT_EQ(p0.answers, std::vector<std::string>{"0"});
}

TEST(Dataset, AnswerFormsKeysBlankLinesAndExtraFields) {
  Jsonl f(
      "\n"
      "{\"problem\": \"p0\", \"answer\": \"1\", \"level\": 3, \"extra\": {\"a\": [1]}}\n"
      "   \r\n"
      "{\"problem\": \"p1\", \"answer\": [\"2\", \"\\\\frac{4}{2}\"]}\r\n"
      "{\"problem\": \"p2\", \"answer\": 142}\n"
      "{\"problem\": \"p3\", \"answer\": [0.5, \"1/2\"]}");  // no final newline
  Dataset d = f.load();
  ASSERT_EQ(d.problems.size(), 4u);
  EXPECT_EQ(d.n_rows, 4);
  EXPECT_EQ(d.problems[0].answers, std::vector<std::string>{"1"});
  EXPECT_EQ(d.problems[1].answers, (std::vector<std::string>{"2", "\\frac{4}{2}"}));
  EXPECT_EQ(d.problems[2].answers, std::vector<std::string>{"142"});
  EXPECT_EQ(d.problems[3].answers, (std::vector<std::string>{"0.5", "1/2"}));
  EXPECT_EQ(d.problems[3].problem, "p3");
  EXPECT_EQ(d.problems[3].index, 3);

  // Other key names; raw prompts are the problem's tokens alone.
  Jsonl g("{\"question\": \"Hello world\", \"solution\": \"x\"}\n");
  DatasetOptions o;
  o.problem_key = "question";
  o.answer_key = "solution";
  o.prompt_format = "raw";
  Dataset dg = g.load(o);
  auto want = qwen().encode("Hello world");
  EXPECT_EQ(dg.problems[0].prompt_ids, std::vector<std::int64_t>(want.begin(), want.end()));
  EXPECT_TRUE(contains(load_error("{\"question\": \"a\", \"answer\": \"b\"}\n", o), "'solution'"));
}

TEST(Dataset, LongPromptsAreSkippedAndKeepTheirIndex) {
  std::string long_problem;
  for (int i = 0; i < 300; ++i) long_problem += "word ";
  Jsonl f("{\"problem\": \"short\", \"answer\": \"1\"}\n"
          "{\"problem\": \"" + long_problem + "\", \"answer\": \"2\"}\n"
          "{\"problem\": \"also short\", \"answer\": \"3\"}\n");
  DatasetOptions o;
  o.max_prompt_tokens = 64;
  Dataset d = f.load(o);
  EXPECT_EQ(d.n_rows, 3);
  EXPECT_EQ(d.skipped_long, 1);
  ASSERT_EQ(d.problems.size(), 2u);
  EXPECT_EQ(d.problems[0].index, 0);
  EXPECT_EQ(d.problems[1].index, 2);
  EXPECT_EQ(d.problems[1].answers[0], "3");
  // Exactly at the limit is kept.
  o.max_prompt_tokens = static_cast<std::int64_t>(d.problems[1].prompt_ids.size());
  Dataset d2 = f.load(o);
  EXPECT_EQ(d2.problems.back().index, 2);
  o.max_prompt_tokens -= 1;
  EXPECT_EQ(f.load(o).problems.back().index, 0);
  // Every prompt too long, and a limit below 1, are errors.
  o.max_prompt_tokens = 5;
  EXPECT_TRUE(contains(load_error(read_file(f.path), o), "longer than data.max_prompt_tokens"));
  o.max_prompt_tokens = 0;
  EXPECT_TRUE(contains(load_error(read_file(f.path), o), "data.max_prompt_tokens must be at least 1"));
}

TEST(Dataset, BadRowsNameFileLineAndField) {
  const std::string ok = "{\"problem\": \"p\", \"answer\": \"a\"}\n";
  struct Case {
    std::string row, needle;
  };
  const std::vector<Case> cases = {
      {"{\"problem\": \"p\"}", "missing field 'answer' (data.answer_key)"},
      {"{\"answer\": \"a\"}", "missing field 'problem' (data.problem_key)"},
      {"[1, 2]", "expected a JSON object, got a list"},
      {"\"just a string\"", "expected a JSON object, got a string"},
      {"{\"problem\": \"p\", \"answer\": \"a\"", "not valid JSON"},
      {"not json at all", "not valid JSON"},
      {"{\"problem\": 3, \"answer\": \"a\"}", "field 'problem' must be a string, got a number"},
      {"{\"problem\": \"p\", \"answer\": null}", "field 'answer' must be a string or a list of strings, got null"},
      {"{\"problem\": \"p\", \"answer\": {\"x\": 1}}", "got an object"},
      {"{\"problem\": \"p\", \"answer\": true}", "got a boolean"},
      {"{\"problem\": \"p\", \"answer\": []}", "field 'answer' is an empty list"},
      {"{\"problem\": \"p\", \"answer\": [\"a\", [\"b\"]]}", "field 'answer'[1] must be a string, got a list"},
      {"{\"problem\": \"p\", \"answer\": \"a\"} trailing", "not valid JSON"},
  };
  for (const auto& c : cases) {
    // Row 7 of the file: 5 good rows and a blank line before it (blank lines count as lines).
    std::string text = ok + ok + "\n" + ok + ok + ok + c.row + "\n" + ok;
    Jsonl f(text);
    const std::string msg = load_error(text);
    EXPECT_TRUE(contains(msg, "data.train_file ")) << msg;
    EXPECT_TRUE(contains(msg, "x.jsonl line 7: ")) << msg;
    EXPECT_TRUE(contains(msg, c.needle)) << c.row << " -> " << msg;
  }
  // Empty and blank-only files.
  EXPECT_TRUE(contains(load_error(""), "no rows"));
  EXPECT_TRUE(contains(load_error("\n  \n\n"), "no rows"));
  // The CLI's names for the settings.
  DatasetOptions o;
  o.file_setting = "--data";
  o.answer_key_setting = "--answer-key";
  const std::string msg = load_error(ok + "{\"problem\": \"p\"}\n", o);
  EXPECT_TRUE(contains(msg, "--data ")) << msg;
  EXPECT_TRUE(contains(msg, "line 2: missing field 'answer' (--answer-key)")) << msg;
  // A missing file is NotFound, naming the path.
  try {
    load_dataset("/nonexistent/dir/x.jsonl", qwen(), DatasetOptions{});
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kNotFound);
    EXPECT_TRUE(contains(e.what(), "/nonexistent/dir/x.jsonl")) << e.what();
  }
}

// Property: whatever bytes a mutation produces, loading either succeeds (with consistent indices
// and prompts within the limit) or fails with InvalidInput; never a crash or another error kind.
TEST(Dataset, RandomMutationsLoadOrThrowInvalidInput) {
  const std::string base =
      "{\"problem\": \"Compute $\\\\frac{1}{2}+\\\\frac{1}{3}$.\", \"answer\": \"\\\\frac{5}{6}\"}\n"
      "\n"
      "{\"problem\": \"How many primes are below 10? <|im_end|> caf\\u00e9 \\ud83d\\ude00\", "
      "\"answer\": [\"4\", \"four\"], \"level\": 2}\n"
      "{\"problem\": \"x\", \"answer\": 7}\n";
  std::mt19937_64 rng(12345);
  TempDir dir("lorasync-dataset-fuzz");
  const fs::path path = dir.path() / "fuzz.jsonl";
  DatasetOptions o;
  o.max_prompt_tokens = 64;
  int n_ok = 0, n_err = 0;
  for (int iter = 0; iter < 1500; ++iter) {
    std::string s = base;
    const int n_mut = 1 + static_cast<int>(rng() % 6);
    for (int m = 0; m < n_mut; ++m) {
      const std::size_t at = s.empty() ? 0 : rng() % s.size();
      const auto byte = static_cast<char>(rng() % 256);
      switch (rng() % 4) {
        case 0: if (!s.empty()) s[at] = byte; break;                  // flip a byte
        case 1: s.insert(s.begin() + static_cast<std::ptrdiff_t>(at), byte); break;  // insert
        case 2: if (!s.empty()) s.erase(at, 1 + rng() % 8); break;    // delete a run
        case 3: s.insert(at, std::string(1 + rng() % 4, "{}[]\",:\\\n"[rng() % 9])); break;
      }
    }
    write_file_atomic(path, s);
    try {
      Dataset d = load_dataset(path, qwen(), o);
      ++n_ok;
      ASSERT_FALSE(d.problems.empty());
      std::int64_t prev = -1;
      for (const auto& p : d.problems) {
        ASSERT_GT(p.index, prev);
        ASSERT_LT(p.index, d.n_rows);
        ASSERT_FALSE(p.answers.empty());
        ASSERT_LE(static_cast<std::int64_t>(p.prompt_ids.size()), o.max_prompt_tokens);
        prev = p.index;
      }
    } catch (const Error& e) {
      ++n_err;
      ASSERT_EQ(e.kind(), ErrorKind::kInvalidInput) << e.what() << "\ninput: " << s;
    }
  }
  // Both outcomes must occur, or the mutations are too weak or too strong to test anything.
  EXPECT_GT(n_ok, 50);
  EXPECT_GT(n_err, 50);
}

}  // namespace
}  // namespace lorasync::rl
