// server/openai.h: the OpenAI/vLLM protocol of `lorasync serve`: JSON request bodies parsed into
// engine requests, engine output rendered into JSON responses and SSE chunks. The only place of
// the server where JSON meets native types. No sockets here (unit- and fuzz-tested directly).
//
// Errors are lorasync::Error with kind InvalidInput and `param` set to the field at fault; the
// message names the field and the value ("temperature must be a number, got \"hot\"").
// Thread-safety: functions are reentrant; a CompletionState is owned by one request.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/tokenizer/chat_template.h"
#include "engine/request.h"

namespace lorasync::tok {
class Tokenizer;
}

namespace lorasync::server {

struct ParsedCompletion {
  std::string model;
  std::vector<std::vector<std::int32_t>> prompts;  // one or more (a batch); each gets n choices
  engine::SamplingParams params;
  bool stream = false;
  bool include_usage = false;        // stream_options.include_usage
  bool return_token_ids = false;
  bool chat = false;                 // /v1/chat/completions
  bool max_tokens_unset = false;     // chat without max_tokens: the rest of the context
};

// Parses a /v1/completions body. Text prompts are tokenized (special tokens parsed, no BOS).
ParsedCompletion parse_completion(std::string_view body, const tok::Tokenizer& tokenizer);
// Parses a /v1/chat/completions body: messages rendered with the model's chat format (ChatML,
// Qwen3's or Llama 3's: core/tokenizer/chat_template.h), generation prompt added; the format's
// end-of-turn tokens stop by default (<|im_end|> and <|endoftext|>; <|eot_id|>, <|end_of_text|>,
// <|eom_id|>). `chat_template_kwargs: {"enable_thinking": false}` (vLLM's field) pre-fills an empty
// <think> block for Qwen3.
ParsedCompletion parse_chat(std::string_view body, const tok::Tokenizer& tokenizer,
                            tok::ChatFormat format = tok::ChatFormat::kChatml);

// Provenance block (http-api.md "lorasync").
struct Provenance {
  std::optional<std::string> adapter;         // null for the base model
  std::optional<std::string> adapter_sha256;
  std::string base_model_sha256;
};

// Accumulates a request's output across engine deliveries and renders it.
class CompletionState {
 public:
  CompletionState(std::string id, std::int64_t created, const ParsedCompletion& req, Provenance prov,
                  const tok::Tokenizer* tokenizer);
  // Output of sub-request `prompt_index` (choices are numbered prompt_index * n + index).
  // Returns the SSE events to send for this delivery when streaming ("data: {...}\n\n" each).
  std::string add(std::size_t prompt_index, const std::vector<engine::ChoiceDelta>& deltas,
                  const engine::RequestUsage& usage, bool done);
  bool all_done() const;
  // The final non-streaming JSON body.
  std::string final_json() const;
  // The events that close a stream (usage chunk when asked, then [DONE]).
  std::string stream_tail() const;
  // First error reported by the engine (e.g. the model vanished), empty if none.
  const std::string& error() const { return error_; }
  // The error is the engine's failure (answer 500), not the request's (the model vanished: 404).
  bool error_internal() const { return error_internal_; }

 private:
  struct Choice {
    std::string text;
    std::vector<std::int32_t> ids;
    std::vector<float> logprobs;
    std::vector<std::string> tokens;
    std::vector<std::vector<std::pair<std::int32_t, float>>> top;
    std::vector<std::int64_t> offsets;
    std::int64_t text_len = 0;  // for text_offset
    std::optional<std::string> finish;
  };
  std::string chunk_json(std::size_t choice, const engine::ChoiceDelta& d, std::size_t first_token) const;
  // choices[].logprobs from token `from` on: completions shape, or the chat shape for chat; null
  // when logprobs were not asked for.
  nlohmann::json choice_logprobs(const Choice& c, std::size_t from) const;
  std::string usage_json() const;

  std::string id_;
  std::int64_t created_;
  ParsedCompletion req_;
  Provenance prov_;
  std::vector<Choice> choices_;
  std::vector<engine::RequestUsage> usage_;
  std::vector<bool> done_;
  std::vector<std::vector<std::int32_t>> prompts_;
  bool error_internal_ = false;
  std::string error_;
  const tok::Tokenizer* tokenizer_ = nullptr;
};

}  // namespace lorasync::server
