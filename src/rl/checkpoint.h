// rl/checkpoint.h: trainer checkpoints (trainer.md §5), written like adapter publishing:
// checkpoints/.staging-step-N-<random>/ holds adapter/ (PEFT, fp32), optimizer.safetensors (Adam
// moments), versions.safetensors (fp32 LoRA tensors of every version in the staleness window),
// queue.safetensors + queue.json (groups not consumed by a completed step: token ids int32 and
// behaviour logprobs float32 stored raw, so the round trip is bit-exact), state.json (format,
// step, cursor, version table, counters, metrics offsets, configuration ...) and, written last,
// manifest.json (format lorasync-checkpoint/1, every file with bytes and SHA-256). The directory
// is then renamed to step-<6 digits>, the parent fsynced, and `latest` rewritten atomically.
// A checkpoint is complete only if its manifest is present and every file matches it.
// Thread-safety: functions; the caller owns the data.
#pragma once

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <vector>

#include "core/model/lora.h"
#include "rl/pipeline.h"

namespace lorasync::rl {

struct CheckpointData {
  std::int64_t step = 0;
  nlohmann::json state;                      // state.json (trainer scalars, cursor, tables, config)
  const model::LoraAdapter* adapter = nullptr;  // write side
  std::filesystem::path adapter_dir;         // read side: <ckpt>/adapter
  std::vector<at::Tensor> exp_avg, exp_avg_sq;
  std::map<std::int64_t, std::vector<at::Tensor>> version_tensors;  // version -> LoRA parameters
  std::vector<Group> groups;                 // the queue as captured
};

// Writes checkpoints/step-<N>, updates `latest`, keeps the newest `keep` plus `also_keep`.
std::filesystem::path write_checkpoint(const std::filesystem::path& checkpoints_dir, const CheckpointData& data,
                                       std::int64_t keep, std::optional<std::int64_t> also_keep = std::nullopt);
// Complete (manifest matches every file) or not.
bool checkpoint_complete(const std::filesystem::path& dir, std::string* why = nullptr);
// `latest` when complete, else the newest complete step-*; nullopt when none.
std::optional<std::filesystem::path> find_resume_checkpoint(const std::filesystem::path& checkpoints_dir);
// Reads everything but the adapter (loaded by the caller from adapter_dir). Checks the files
// against the manifest first unless the caller already did (checkpoint_complete).
CheckpointData read_checkpoint(const std::filesystem::path& dir, bool verified = false);
// Removes .staging-* leftovers; returns how many.
int remove_checkpoint_staging(const std::filesystem::path& checkpoints_dir);

// JSON <-> pipeline pieces (also used by tests).
nlohmann::json cursor_to_json(const Cursor& c);
Cursor cursor_from_json(const nlohmann::json& j);

}  // namespace lorasync::rl
