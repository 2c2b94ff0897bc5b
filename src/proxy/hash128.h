// proxy/hash128.h: the 128-bit block hash of the router (proxy.md §3.2).
//
// H is XXH3-128 with a secret derived from a key drawn from the OS at start-up (a client cannot
// compute hashes to craft colliding prompts that steer or poison the ownership table; XXH3 is not
// a proven PRF as SipHash is, see hash128.cpp); tests may fix it.
// Hashes never leave the process, so routing decisions do not depend on which key or hash is used.
// Thread-safety: hash128() is thread-safe; set_hash_key() must run before any hashing starts.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace lorasync::proxy {

struct Hash128 {
  std::uint64_t lo = 0;
  std::uint64_t hi = 0;
  bool operator==(const Hash128&) const = default;
  // A 64-bit fingerprint (the successor field of the ownership table).
  std::uint64_t fingerprint() const { return lo ^ (hi * 0x9e3779b97f4a7c15ULL); }
};

// Replaces the process-wide key (tests; the default is random per process).
void set_hash_key(std::uint64_t k0, std::uint64_t k1);

Hash128 hash128(const void* data, std::size_t n);
inline Hash128 hash128(std::string_view s) { return hash128(s.data(), s.size()); }

}  // namespace lorasync::proxy
