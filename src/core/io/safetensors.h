// core/io/safetensors.h: the safetensors format: mmap reader and writer.
//
// Layout: u64 little-endian header length N, N bytes of JSON header
//   {"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"format": "pt"}}
// then the raw little-endian tensor bytes; offsets are relative to the byte after the header.
//
// The reader treats the file as untrusted: the header length is bounded (<= 100 MB and <= file),
// the header must be one JSON object without duplicate names, every dtype known, every shape
// non-negative with a product that fits, dtype size x numel == end - begin, offsets inside the
// data and no two tensors overlapping. Errors are InvalidInput naming the file, the tensor and
// the values. Tensors are views into the mapping (no copy); the file object must outlive them.
//
// Thread-safety: a SafetensorsFile is immutable after construction (safe to share).
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "util/files.h"

namespace lorasync::io {

enum class DType : std::uint8_t { kF64, kF32, kF16, kBF16, kI64, kI32, kI16, kI8, kU8, kBool };

// "F32" etc. (safetensors names). parse_dtype returns nullopt for an unknown name.
std::string_view dtype_name(DType d);
std::optional<DType> parse_dtype(std::string_view name);
std::size_t dtype_size(DType d);

struct TensorView {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<std::int64_t> shape;
  const std::uint8_t* data = nullptr;  // points into the mapping
  std::size_t nbytes = 0;
  std::int64_t numel() const;
};

class SafetensorsFile {
 public:
  // Maps and validates `path`. Throws NotFound, Environment or InvalidInput (see above).
  explicit SafetensorsFile(const std::filesystem::path& path);

  // Validates an in-memory image (used by the fuzz test; `label` names it in errors).
  // The bytes must outlive the object.
  static std::unique_ptr<SafetensorsFile> from_bytes(std::span<const std::uint8_t> bytes,
                                                     std::string label);

  const std::vector<TensorView>& tensors() const { return tensors_; }
  const TensorView* find(std::string_view name) const;
  const TensorView& get(std::string_view name) const;  // InvalidInput if missing
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& label() const { return label_; }

 private:
  SafetensorsFile() = default;
  void parse(std::span<const std::uint8_t> bytes);

  std::string label_;
  std::unique_ptr<MappedFile> mapping_;
  std::vector<TensorView> tensors_;
  std::unordered_map<std::string, std::size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// One tensor to write: bytes are little-endian, row-major, `dtype_size * numel` long.
struct TensorToWrite {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<std::int64_t> shape;
  std::span<const std::uint8_t> bytes;
};

// Writes a safetensors file. atomic=true: temp file + fsync + rename (+ fsync dir);
// atomic=false: written in place and fsynced (inside a staging directory that is renamed later).
// Names must be unique; InvalidInput otherwise. Tensors are laid out in name order.
void write_safetensors(const std::filesystem::path& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata = {{"format", "pt"}},
                       bool atomic = true);

// The same image in memory (messages between processes: a format with a validating reader).
std::string safetensors_bytes(const std::vector<TensorToWrite>& tensors,
                              const std::map<std::string, std::string>& metadata = {{"format", "pt"}});

}  // namespace lorasync::io
