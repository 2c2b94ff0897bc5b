// apps/lorasync/commands.h: how subcommands plug into the one `lorasync` binary.
//
// Each cmd_*.cpp defines a register_* function that adds its CLI11 subcommand (with its options
// bound to a struct it owns) and records the function to run when that subcommand is chosen.
// Subcommands stay thin: they parse flags, call the libraries, print results.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <utility>
#include <vector>

namespace lorasync::cli {

using Runner = std::function<int()>;

class Registry {
 public:
  void add(CLI::App* sub, Runner run) { entries_.emplace_back(sub, std::move(run)); }
  const std::vector<std::pair<CLI::App*, Runner>>& entries() const { return entries_; }

 private:
  std::vector<std::pair<CLI::App*, Runner>> entries_;
};

// Top-level subcommands.
void register_init_model(CLI::App& root, Registry& reg);
void register_logprobs(CLI::App& root, Registry& reg);
void register_generate(CLI::App& root, Registry& reg);
void register_serve(CLI::App& root, Registry& reg);
void register_init_adapter(CLI::App& root, Registry& reg);
void register_grade(CLI::App& root, Registry& reg);
void register_tokenize(CLI::App& root, Registry& reg);
void register_train_tokenizer(CLI::App& root, Registry& reg);
void register_proxy(CLI::App& root, Registry& reg);  // also the hidden stub-replica
void register_train(CLI::App& root, Registry& reg);
void register_eval(CLI::App& root, Registry& reg);
void register_report(CLI::App& root, Registry& reg);
void register_demo(CLI::App& root, Registry& reg);
void register_make_demo_model(CLI::App& root, Registry& reg);

// `lorasync bench <name>`; `bench` is the parent subcommand.
void register_bench_gemm(CLI::App& bench, Registry& reg);
void register_bench_forward(CLI::App& bench, Registry& reg);
void register_bench_serve(CLI::App& bench, Registry& reg);
void register_bench_train(CLI::App& bench, Registry& reg);
void register_bench_grade(CLI::App& bench, Registry& reg);
void register_bench_tokenizer(CLI::App& bench, Registry& reg);
void register_bench_proxy(CLI::App& bench, Registry& reg);
void register_bench_startup(CLI::App& bench, Registry& reg);
void register_bench_sync(CLI::App& bench, Registry& reg);
void register_bench_e2e(CLI::App& bench, Registry& reg);
void register_bench_episodes(CLI::App& bench, Registry& reg);
void register_bench_reward(CLI::App& bench, Registry& reg);

}  // namespace lorasync::cli
