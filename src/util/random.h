// util/random.h: SplitMix64, the counter-based mixer behind the project's seeded choices (the
// trainer's permutations and request seeds, eval's seeds, the verifier's sample points, the bench
// stubs' service times). Each choice is a pure function of its inputs, so no generator state is
// kept, shared or checkpointed.
// Thread-safety: pure functions.
#pragma once

#include <cstdint>

namespace lorasync {

inline constexpr std::uint64_t kSplitMixGamma = 0x9e3779b97f4a7c15ull;

// SplitMix64 of x: the generator's output for state x (x + gamma, then its finaliser).
constexpr std::uint64_t splitmix64(std::uint64_t x) noexcept {
  x += kSplitMixGamma;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// A double uniform in [0, 1) from the top 53 bits of a mixed value.
constexpr double unit_interval(std::uint64_t mixed) noexcept { return static_cast<double>(mixed >> 11) * 0x1.0p-53; }

}  // namespace lorasync
