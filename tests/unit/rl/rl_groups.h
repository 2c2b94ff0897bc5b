// tests/unit/rl/rl_groups.h: a scored group of the shape the trainer queues, for the pipeline and
// checkpoint tests.
#pragma once

#include "rl/pipeline.h"

namespace lorasync::rl {

inline Group make_group(std::int64_t prompt, std::int64_t version, std::int64_t k, int members = 4) {
  Group g;
  g.prompt = {prompt, 0, 1};
  g.version = version;
  g.sync_index = k;
  g.scored = true;
  for (int i = 0; i < members; ++i) {
    Member m;
    m.ids = {static_cast<std::int32_t>(10 + i), 11, 12};
    m.logprobs = {-0.5f, -1.25f, -3.0e-7f};
    m.finish = "stop";
    m.reward = i == 0 ? 1.0 : 0.0;
    m.parts = {m.reward};
    m.advantage = i == 0 ? 0.75 : -0.25;
    g.members.push_back(m);
  }
  return g;
}

}  // namespace lorasync::rl
