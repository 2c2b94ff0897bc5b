// libFuzzer: what the trainer reads from others during a rollout: an environment worker's answer
// lines (rl/environment.h: reset and step answers) and a server's completion answer
// (rl/completion_response.h). The first byte picks the parser, the rest is the input. Each
// either accepts with its invariants holding or refuses (EnvFailed / a reason); never a crash, a
// wild read, or another exception.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "rl/completion_response.h"
#include "rl/environment.h"

using namespace lorasync::rl;

namespace {

void check_observation(const Observation& o) {
  if (o.tokens && !o.messages.empty()) std::abort();
  for (const auto& m : o.messages)
    if (m.role != "system" && m.role != "user" && m.role != "tool") std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::string in(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 3) {
    case 0:
      try {
        Observation o = parse_reset_answer(in, 1);
        check_observation(o);
        if (!o.tokens && o.messages.empty()) std::abort();
      } catch (const EnvFailed&) {
      }
      break;
    case 1:
      try {
        EnvStepResult r = parse_step_answer(in, 1);
        if (!r.done && !r.has_observation) std::abort();
        if (!std::isfinite(r.reward)) std::abort();
        if (r.has_observation) check_observation(r.observation);
      } catch (const EnvFailed&) {
      }
      break;
    default: {
      TurnAnswer a;
      const std::int64_t n = 2, max_tokens = 8, vocab = 1000;
      auto lookup = [](std::int64_t v) -> std::optional<VersionInfo> {
        if (v < 1 || v > 3) return std::nullopt;
        return VersionInfo{v, v - 1, "policy-v" + std::to_string(v), v == 3 ? "ab" : ""};
      };
      if (!parse_completion_response(in, n, max_tokens, vocab, "policy", lookup, a)) {
        if (static_cast<std::int64_t>(a.members.size()) != n || a.version < 1 || a.version > 3) std::abort();
        for (const auto& m : a.members) {
          if (m.ids.empty() || m.ids.size() != m.logprobs.size() || static_cast<std::int64_t>(m.ids.size()) > max_tokens) std::abort();
          for (auto id : m.ids)
            if (id < 0 || id >= vocab) std::abort();
          for (auto lp : m.logprobs)
            if (!std::isfinite(lp) || lp > 0) std::abort();
        }
      }
    }
  }
  return 0;
}
