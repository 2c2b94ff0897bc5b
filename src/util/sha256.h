// util/sha256.h: SHA-256 (OpenSSL) for manifests, adapter identities and model hashes.
// Thread-safety: all functions are thread-safe; a Sha256 object is single-threaded.
#pragma once

#include <filesystem>
#include <memory>
#include <string>
#include <string_view>

namespace lorasync {

class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;
  void update(const void* data, std::size_t n);
  void update(std::string_view s) { update(s.data(), s.size()); }
  std::string hex_digest();  // finishes the hash; lowercase hex, 64 characters

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

std::string sha256_hex(std::string_view data);
// Streams a file through SHA-256 (no full read into memory).
std::string sha256_file(const std::filesystem::path& path);

}  // namespace lorasync
