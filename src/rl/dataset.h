// rl/dataset.h: the trainer's (and `lorasync eval`'s) problem set: a JSONL file of maths problems,
// rendered into prompts and tokenized once at load (trainer.md §7 "Prompt" and "Dataset").
//
//   one JSON object per line:  {"problem": "...", "answer": "..." | ["...", ...], ...}
//   blank lines skipped; other fields ignored; the field names come from the options.
//
// A row is valid when it is a JSON object with a string problem and an answer that is a string, a
// number (the AMC set stores integers; kept as their JSON text) or a non-empty list of those.
// Anything else is an InvalidInput error naming the file setting, the path, the 1-based line and the
// field: "data.train_file x.jsonl line 7: missing field 'answer' (data.answer_key)". Valid rows are
// numbered 0, 1, ... in file order (the prompt index used by dispatch, checkpoints and groups.jsonl);
// a row whose prompt has more than max_prompt_tokens tokens is skipped and counted, and keeps its
// index, so indices are stable whatever the token limit.
//
// Prompt (`chatml`): <|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{problem}<|im_end|>\n
// <|im_start|>assistant\n (no system turn when the system prompt is empty); `qwen3` and `llama3`: the
// same two messages in Qwen3's or Llama 3's chat format (core/tokenizer/chat_template.h; Llama 3's
// begins with <|begin_of_text|>); `raw`: the problem alone.
// Tokenized with special tokens matched as single ids and no BOS (add_special_tokens = false).
//
// Thread-safety: pure functions; the tokenizer is only read.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "core/tokenizer/tokenizer.h"

namespace lorasync::rl {

struct DatasetOptions {
  std::string problem_key = "problem", answer_key = "answer";  // JSON field names
  std::string prompt_format = "chatml";  // "chatml" | "qwen3" | "llama3" | "raw"
  bool enable_thinking = true;           // qwen3: false pre-fills an empty <think> block
  std::string system_prompt = "Please reason step by step, and put your final answer within \\boxed{}.";
  std::int64_t max_prompt_tokens = 1024;  // longer prompts are skipped (counted)
  // How error messages name the settings at fault: the trainer's config keys by default; a CLI
  // passes its flags ("--data", "--answer-key", ...).
  std::string file_setting = "data.train_file";
  std::string problem_key_setting = "data.problem_key", answer_key_setting = "data.answer_key";
  std::string prompt_format_setting = "data.prompt_format";
  std::string max_prompt_tokens_setting = "data.max_prompt_tokens";
};

struct Problem {
  std::int64_t index = 0;                // 0-based order among valid rows (skipped long prompts keep
                                         // their index; gaps allowed)
  std::string problem;
  std::vector<std::string> answers;      // one or more acceptable answers
  std::vector<std::int64_t> prompt_ids;  // the rendered prompt, tokenized (special tokens as single
                                         // ids, no BOS)
};

struct Dataset {
  std::vector<Problem> problems;  // in index order
  std::int64_t n_rows = 0;        // valid rows (= highest index + 1)
  std::int64_t skipped_long = 0;  // prompts longer than max_prompt_tokens
  std::string file;               // the path loaded
};

// The problem with this index (problems are in index order), or null.
const Problem* find_problem(const Dataset& data, std::int64_t index);

// The prompt text of one problem. InvalidInput naming prompt_format_setting for an unknown format.
std::string render_prompt(const std::string& problem, const DatasetOptions& opt);

// Rows 0..n-1 holding only their index (no problem, no prompt): the task source of an environment
// that makes its own tasks (env.rows, docs/environments.md).
Dataset index_dataset(std::int64_t n);

// Reads, validates, renders and tokenizes the whole file. NotFound / Environment for the file,
// InvalidInput for a bad row (file, line, field), for an unknown prompt format or a
// max_prompt_tokens below 1, for a file without a valid row, and when every prompt is too long.
Dataset load_dataset(const std::filesystem::path& jsonl, const tok::Tokenizer& tokenizer,
                     const DatasetOptions& opt);

}  // namespace lorasync::rl
