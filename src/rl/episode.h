// rl/episode.h: multi-turn episodes as a rollout source (rl/rollout_source.h; docs/environments.md
// and trainer.md "Episodes").
//
// A group is G episodes of the same task row, run at once. One episode:
//   reset(row, seed) -> the first observation, rendered with the chat template plus the assistant
//   header: the episode's prompt. Then, until the environment says done or a limit ends it:
//     a model turn: one completion (n = 1) on the whole context so far, max_tokens bounded by
//       generation.max_new_tokens, what env.max_episode_tokens and generation.context_len leave;
//     step(action) with the turn's text and token ids; its reward adds to the episode's;
//     the observation's messages are rendered as the template renders the next turns
//       ("\n<|im_start|>user\n...<|im_end|>\n<|im_start|>assistant\n") and tokenized alone: the
//       context grows by exactly the sampled tokens and these (token-in/token-out, nothing the
//       model wrote is re-tokenised). Token-id observations are appended verbatim.
// Limits, each ending the episode with the rewards so far ("truncated", counted by reason):
//   env.max_turns model turns; env.max_episode_tokens (or the context) left for no model turn;
//   an observation over env.max_observation_tokens or one that leaves no room for a model turn;
//   env.episode_deadline_s. A model turn cut by max_tokens is passed on with finish_reason
//   "length" (the environment decides); when the episode goes on, the template's <|im_end|>
//   closes the cut turn as a context token (counted: episode/cut_turns_total).
// Failures: an environment failure (rl/environment.h: timeout, crash, invalid answer, its own
// error) or an invalid observation (a token id outside the vocabulary) costs that episode: its
// reward is NaN (left out of the group's statistics, advantage 0), counted as
// rollout/env_<kind>_total. A completion call that was cancelled, failed or stopped ends the
// whole group the same way a single-turn request's would.
// Versions: each token records the adapter version that sampled it; the group's version is the
// oldest first turn's, so its staleness is that of its oldest tokens (trainer.md "Episodes").
// Thread model: rollout() on the rollout thread; environment calls on the source's own threads.
#pragma once

#include <memory>

#include "rl/environment.h"
#include "rl/rollout_source.h"

namespace lorasync::tok {
class Tokenizer;
}

namespace lorasync::rl {

// The row an environment's reset gets: {"index", "problem", "answers"}.
std::string env_row_json(const Problem& problem);

// Tokens of environment messages in the ChatML template: each message as
// <|im_start|>{role}\n{content}<|im_end|>\n ("tool" as a user turn wrapped in <tool_response>),
// then <|im_start|>assistant\n; `continuation` starts with the "\n" that follows the model's
// <|im_end|>. Content is tokenized with special tokens as text, so an environment cannot forge the
// template's markers. InvalidInput when the tokenizer has no <|im_start|> / <|im_end|>.
std::vector<std::int64_t> render_env_turn(const tok::Tokenizer& tokenizer, const std::vector<EnvMessage>& messages,
                                          bool continuation);

std::unique_ptr<RolloutSource> make_episode_source(const TrainConfig& cfg, const tok::Tokenizer& tokenizer,
                                                   std::int64_t vocab, std::vector<std::int64_t> stop_ids);

}  // namespace lorasync::rl
