// core/io/checkpoint_dir.h: the weights of a Hugging Face model directory, one file or sharded.
//
// open_weights(dir) reads `model.safetensors`, or `model.safetensors.index.json` and every shard
// its weight_map names (each tensor must be in the file the index says, exactly once). Tensors are
// mmap views; the WeightSet owns the mappings.
// write_weights(dir, tensors, max_shard_bytes) writes one file, or shards named
// model-00001-of-0000N.safetensors plus the index when the total exceeds max_shard_bytes.
// Thread-safety: a WeightSet is immutable after construction.
#pragma once

#include <filesystem>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/io/safetensors.h"

namespace lorasync::io {

class WeightSet {
 public:
  const TensorView* find(const std::string& name) const;
  const TensorView& get(const std::string& name) const;  // InvalidInput naming dir and tensor
  std::vector<std::string> names() const;
  std::size_t size() const { return by_name_.size(); }
  const std::filesystem::path& dir() const { return dir_; }
  std::size_t n_files() const { return files_.size(); }

 private:
  friend WeightSet open_weights(const std::filesystem::path& dir);
  std::filesystem::path dir_;
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::unordered_map<std::string, const TensorView*> by_name_;
};

WeightSet open_weights(const std::filesystem::path& dir);

// Identity of a model directory: SHA-256 over config.json and every weight file's header (names,
// dtypes, shapes, offsets), cheap to compute and changed by any change of architecture or layout.
// (A change of weight values under the same layout is caught by the adapters' base_model check of
// the name, not by this hash.)
std::string model_identity_sha256(const std::filesystem::path& dir);

// Returns the number of files written (1 = unsharded).
int write_weights(const std::filesystem::path& dir, const std::vector<TensorToWrite>& tensors,
                  std::uint64_t max_shard_bytes);

}  // namespace lorasync::io
