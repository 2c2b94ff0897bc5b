// train_baseline_proc.h: what `bench train --baseline pytorch` shares with bench/train_baseline.py:
// the rows file (the exact samples and packing both sides train, with a checksum both compute) and
// the baseline's process, driven line by line so that its steps alternate with ours.
// Thread-safety: not thread-safe; one BaselineProcess per bench run.
#pragma once

#include <sys/types.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "rl/packed_forward.h"
#include "util/files.h"

namespace lorasync::cli {

using TrainRows = std::vector<std::vector<rl::PackedSample>>;

// FNV-1a over 64-bit values: the row count, then per row its sample count, per sample its prompt
// and completion lengths and their token ids; 16 hex digits. train_baseline.py's rows_checksum
// computes the same.
std::string rows_checksum(const TrainRows& rows);

// Prompt + completion tokens of the rows (what tokens/s counts) and their completion tokens.
std::pair<std::int64_t, std::int64_t> rows_token_counts(const TrainRows& rows);

// {"rows": [[{"prompt", "completion"}, ...], ...], "denominator", "checksum", "tokens_per_step",
// "completion_tokens_per_step"}: train_baseline.py --rows reads it and refuses a wrong checksum.
void write_rows_file(const fs::path& path, const TrainRows& rows, double denominator);

// Environment settings for the baseline's allocator, by name (`--baseline-malloc`):
//   default      glibc as shipped (large blocks mmapped, and unmapped on free)
//   glibc-tuned  ours' mallopt (util/process.cpp): mmap threshold 32 MiB, trim 1 GiB, top pad 64 MiB
//   glibc-nommap no mmap at all (MALLOC_MMAP_MAX_=0), no trimming, top pad 64 MiB: freed blocks,
//                the LM head's logits chunks included, stay mapped and are reused
//   mimalloc     LD_PRELOAD of the system's libmimalloc, its purge delay off
std::vector<std::string> baseline_malloc_env(const std::string& name);
const std::vector<std::string>& baseline_malloc_names();

// The baseline run in --serve mode: started with argv and the environment plus `extra_env`
// ("K=V"), its stdout read a JSON line at a time, its stderr left on ours.
class BaselineProcess {
 public:
  BaselineProcess(const std::vector<std::string>& argv, const std::vector<std::string>& extra_env);
  ~BaselineProcess();
  BaselineProcess(const BaselineProcess&) = delete;
  BaselineProcess& operator=(const BaselineProcess&) = delete;

  // The next JSON line (the ready line first); throws if the process ends or prints other text
  // only.
  nlohmann::json read_json();
  // Sends a command line and returns the answer.
  nlohmann::json request(const std::string& line);
  // Sends `quit`, returns the last line (peak RSS) and waits for the exit.
  nlohmann::json quit();

 private:
  pid_t pid_ = -1;
  FILE* to_ = nullptr;    // its stdin
  FILE* from_ = nullptr;  // its stdout
  std::string text_;      // what it printed, for errors
};

}  // namespace lorasync::cli
