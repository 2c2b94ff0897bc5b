// core/model/lora.h: LoRA adapters in the PEFT format, and how a batch applies them.
//
// For a targeted linear layer W (out x in): h = W x + s * B (A x), A [r, in], B [out, r],
// s = alpha / r (alpha / sqrt(r) with use_rslora). A is initialised like PEFT (Kaiming-uniform
// with a = sqrt(5), i.e. uniform in +-1/sqrt(in)), B is zero, so a new adapter reproduces the base
// model. Masters are fp32; the forward casts them to the compute dtype.
//
// PEFT files (adapter-protocol.md): adapter_config.json and adapter_model.safetensors with keys
//   base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_{A,B}.weight
//   base_model.model.model.layers.{i}.mlp.{gate,up,down}_proj.lora_{A,B}.weight
// Loading validates the config (LORA, no DoRA, no modules_to_save, no patterns, bias none) and
// every shape against the base model, with errors naming the key and the shapes.
//
// LoraBatch: which rows of a flat token batch use which adapter (none = base model). One forward
// applies every adapter of the batch: per adapter, gather its rows, two thin GEMMs, scatter-add;
// on CUDA without gradients, with our kernels, one launch per projection for every adapter (rows
// grouped in tiles of one adapter, lora_tiles).
//
// Thread-safety: a LoraAdapter is a value; concurrent reads are safe, writes need ownership.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace lorasync::io {
class SafetensorsFile;
}

#include "core/model/lora_config.h"
#include "core/model/model_config.h"

namespace lorasync::model {

class LoraAdapter {
 public:
  LoraAdapter() = default;

  // A fresh adapter: A Kaiming-uniform (seeded, generated on CPU so every device agrees), B zero.
  static LoraAdapter init(const LoraConfig& cfg, const ModelConfig& model, std::uint64_t seed,
                          c10::Device device);
  // Loads a PEFT directory, validated against `model`. max_rank > 0 refuses larger ranks.
  static LoraAdapter load_peft(const std::filesystem::path& dir, const ModelConfig& model,
                               c10::Device device, std::int64_t max_rank = 0);
  // The same from bytes already read (and hashed) by the caller; `label` names them in errors.
  static LoraAdapter from_peft(std::string_view config_json, std::span<const std::uint8_t> safetensors,
                               const std::string& label, const ModelConfig& model, c10::Device device,
                               std::int64_t max_rank = 0);
  // Writes adapter_config.json + adapter_model.safetensors (fp32). atomic=false writes in place
  // with fsync (for a staging directory that is renamed afterwards).
  void save_peft(const std::filesystem::path& dir, bool atomic = true) const;

  const LoraConfig& config() const { return cfg_; }
  std::int64_t n_layers() const { return static_cast<std::int64_t>(a_.size()); }
  // Undefined tensors for modules that are not targeted.
  const at::Tensor& A(std::int64_t layer, LoraModule m) const;
  const at::Tensor& B(std::int64_t layer, LoraModule m) const;
  at::Tensor& A(std::int64_t layer, LoraModule m);
  at::Tensor& B(std::int64_t layer, LoraModule m);

  std::vector<at::Tensor> parameters() const;  // A, B in (layer, module) order
  std::int64_t n_params() const;
  void set_requires_grad(bool on);
  LoraAdapter clone() const;  // deep copy, detached (snapshots)
  LoraAdapter to(c10::Device device) const;

 private:
  static LoraAdapter from_parts(std::string_view config_json, const std::string& cfg_label,
                                const io::SafetensorsFile& st, const std::string& st_label,
                                const std::string& dir_label, const ModelConfig& model, c10::Device device,
                                std::int64_t max_rank);
  LoraConfig cfg_;
  std::vector<std::array<at::Tensor, kNumLoraModules>> a_, b_;
};

// Which rows of a flat batch use which adapter.
struct LoraRows {
  const LoraAdapter* adapter = nullptr;
  at::Tensor rows;  // int64 row indices on the device; undefined = every row of the batch
};

class LoraBatch {
 public:
  LoraBatch() = default;
  // Every row uses `adapter`.
  static LoraBatch all(const LoraAdapter* adapter);
  // Row r uses adapters[slot_of_row[r]]; slot -1 = base model. Groups rows by adapter.
  static LoraBatch from_row_slots(const std::vector<const LoraAdapter*>& adapters,
                                  const std::vector<int>& slot_of_row, c10::Device device);
  // For a captured decode graph (decode_graphs.h): part p is parts[p] (every one non-null), rows
  // as the int32 tiles table on the device says (its content may change between replays), `rows`
  // rows in all. Applies only through the batched CUDA kernel (apply throws Unsupported where it
  // cannot run).
  static LoraBatch with_tiles(const std::vector<const LoraAdapter*>& parts, at::Tensor tiles, std::int64_t rows);
  bool empty() const { return parts_.empty(); }
  const std::vector<LoraRows>& parts() const { return parts_; }
  // The A and B factors every part's adapter has at `layer` (targeted modules only).
  std::vector<at::Tensor> parameters(std::int64_t layer) const;
  // y + the LoRA deltas of every adapter that targets `m` at `layer`, for input x [T, in].
  at::Tensor apply(const at::Tensor& x, at::Tensor y, std::int64_t layer, LoraModule m) const;
  // Whether apply runs the batched CUDA kernel (a from_row_slots batch on a CUDA device, with the
  // kernels, at most 32 adapters of rank <= 64).
  bool batched_kernel() const { return tiles_.defined(); }

 private:
  bool apply_batched(const at::Tensor& x, at::Tensor& y, std::int64_t layer, LoraModule m) const;
  std::vector<LoraRows> parts_;
  at::Tensor tiles_;  // int32 [n_tiles, 2 + tile_rows] on the device (lora_tiles), parts_ order
  std::int64_t rows_ = 0;
  bool tiles_only_ = false;  // with_tiles: no per-part rows, so only the batched kernel applies
};

// Whether from_row_slots may use the batched CUDA kernel (default true); process-wide, returns the
// previous setting (the tests and benches time both paths).
bool set_batched_lora_kernel(bool on);

// Rows grouped by adapter for the batched kernel: rows_of_part[p] are the rows of adapter p
// (ascending). Returns a flat [n_tiles, 2 + tile_rows] table: (part, count, rows..., zero padding),
// each tile up to tile_rows rows of one part, parts in increasing order, rows in their order.
std::vector<int> lora_tiles(const std::vector<std::vector<std::int64_t>>& rows_of_part, int tile_rows);

}  // namespace lorasync::model
