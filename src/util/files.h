// util/files.h: file primitives with the project's durability rules.
//
// Writes that matter go through write_file_atomic (temp file in the same directory, fsync, rename,
// fsync of the directory), so a crash leaves the old file or the new one, never a torn one.
// MappedFile maps a file read-only (safetensors weights are used in place).
// Thread-safety: all functions are thread-safe; a MappedFile is immutable after construction.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

namespace lorasync {

namespace fs = std::filesystem;

// Whole file as bytes. NotFound if missing, Environment on other I/O errors (path in message).
std::string read_file(const fs::path& path);

// Atomically replaces `path` with `data` (temp + fsync + rename + fsync(dir)).
void write_file_atomic(const fs::path& path, std::string_view data);

// Writes `data` to a new file and fsyncs it (no rename; for files inside a staging directory).
void write_file_durable(const fs::path& path, std::string_view data);

// fsync of a file or a directory by path. Environment error on failure.
void fsync_path(const fs::path& path, bool is_directory);

// Renames a directory into place and fsyncs the parent (the publish step of a staging directory).
void rename_and_sync(const fs::path& from, const fs::path& to);

// n random bytes in hex (a per-thread Mersenne Twister seeded from std::random_device: names and
// ids, not keys), for staging names and ids.
std::string random_hex(std::size_t n_bytes);
// The same into out[0, 2 * n_bytes) (no allocation).
void random_hex(std::size_t n_bytes, char* out);

// Read-only memory map of a whole file.
class MappedFile {
 public:
  explicit MappedFile(const fs::path& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::uint8_t* data() const { return data_; }
  std::size_t size() const { return size_; }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
  const std::uint8_t* data_ = nullptr;
  std::size_t size_ = 0;
};

// A fresh directory under the system temp dir, removed with its contents on destruction.
class TempDir {
 public:
  explicit TempDir(std::string_view prefix = "lorasync");
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

}  // namespace lorasync
