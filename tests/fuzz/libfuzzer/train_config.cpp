// libFuzzer: the trainer's TOML configuration (rl/config.h) and `--set` overrides. Input: the
// file's text, then optionally "\n--set " and one override. Only lorasync::Error may come out; an
// accepted configuration validates and round-trips through to_toml().
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "rl/config.h"
#include "util/error.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::string text(reinterpret_cast<const char*>(data), size);
  std::vector<std::string> overrides;
  if (auto p = text.find("\n--set "); p != std::string::npos) {
    overrides.push_back(text.substr(p + 7));
    text.resize(p);
  }
  try {
    auto c = lorasync::rl::TrainConfig::parse(text, "fuzz.toml", overrides);
    c.validate();
    auto again = lorasync::rl::TrainConfig::parse(c.to_toml(), "round-trip.toml");
    if (again.to_toml() != c.to_toml()) std::abort();  // to_toml is not a fixed point
  } catch (const lorasync::Error&) {
  }
  return 0;
}
