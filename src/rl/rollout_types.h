// rl/rollout_types.h: what a rollout produces and the trainer consumes: the prompt a group answers
// (PromptRef), its samples (Member: ids, behaviour logprobs, an episode's mask and per-token
// versions, reward, advantage), the group (Group) and an adapter version (VersionInfo). Shared by
// the pipeline, the rollout sources, the scoring, the checkpoint and the trainer's step.
// Thread-safety: value types.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace lorasync::rl {

struct PromptRef {
  std::int64_t index = 0;    // problem index (dataset order)
  std::int64_t epoch = 0;
  std::int64_t attempt = 1;  // 1 = first dispatch
};

struct Member {
  std::vector<std::int32_t> ids;  // completion token ids as sampled (stop token included); for an
                                  // episode every token after its first prompt, the model's turns
                                  // and the environment's between them
  std::vector<float> logprobs;    // behaviour logprobs, one per id (0 for an environment token)
  // Per id: 1 = sampled by the model (trained), 0 = the environment's (context only). Empty: all 1.
  std::vector<std::uint8_t> mask;
  // Per id: the adapter version that sampled it (an environment token: its turn's). Empty: all
  // the group's version.
  std::vector<std::int64_t> versions;
  std::vector<std::int64_t> prompt_ids;  // an episode's first prompt; empty: the problem's
  std::string finish;             // "stop" | "length" | ...; an episode: "done" or why it ended
  std::int64_t turns = 0;         // an episode's model turns (0: single turn)
  double reward = 0;
  std::vector<double> parts;      // per reward function
  double advantage = 0;
  bool valid() const { return std::isfinite(reward); }  // false: a reward function failed (NaN)
  bool trainable(std::size_t i) const { return mask.empty() || mask[i] != 0; }
  std::int64_t model_tokens() const;  // ids the model sampled (the trained ones)
};

struct Group {
  PromptRef prompt;
  std::int64_t version = 0, sync_index = 0;
  std::vector<Member> members;
  std::uint64_t seq = 0;     // queue order within a sync index: completion order, or dispatch
                             // order with async.ordered
  std::uint64_t ordinal = 0; // dispatch order (this process)
  double enqueued_at = 0;    // seconds (steady clock), for time_in_queue
  double request_s = 0, score_s = 0;
  bool scored = false;
  bool prescored = false;    // rewards came with the rollout (an environment's): no reward functions
  // Staleness at the step's last check before training (what the step trained at; a switch during
  // the step does not change it). Set by the trainer.
  std::int64_t staleness = 0;
  double mean_reward() const;
  std::int64_t tokens() const;
};

struct VersionInfo {
  std::int64_t version = 0, sync_index = 0;
  std::string name, sha256;
};

// Parses "<prefix>-v<N>"; nullopt when the name does not match (pipeline_parts.cpp).
std::optional<std::int64_t> parse_version_name(const std::string& name, const std::string& prefix);

}  // namespace lorasync::rl
