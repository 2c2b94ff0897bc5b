// bench/proxy/completion_body.h: the non-streaming /v1/completions answer of `lorasync serve`,
// rebuilt for the stub replicas without the engine: the same fields, in the same order and number
// formatting as server::CompletionState::final_json (src/server/openai.cpp; nlohmann's dump, keys
// sorted), for n choices of max_tokens generated tokens each. With `logprobs` and
// `return_token_ids` (what the trainer asks for, src/rl/pipeline.cpp) a choice carries its text,
// `logprobs` {text_offset, token_logprobs, tokens, top_logprobs: null}, `token_ids` and the prompt's
// `prompt_token_ids`: 11.8 KB per choice at 256 tokens and the trace's prompts (112-432 ids), as
// `bench proxy` reports it (stub_body_bytes_per_choice); the logprobs alone are ~4.9 KB of it.
// The generated tokens are real Qwen2 tokens (ids and texts): a table of 512, every 69th token of
// the ASCII problems of MATH-500 under the Qwen2 tokenizer (2.87 bytes and 3.15 id digits per token,
// the corpus' 2.76 and 3.13), with a logprob drawn per token. A test renders the same tokens
// through CompletionState and compares the bodies byte for byte.
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace lorasync::bench {

// What the stub reads from a completions request (a top-level key scan, no DOM: the stub's own
// CPU shares the host with the proxy under test).
struct CompletionAsk {
  std::string model;
  std::vector<std::int64_t> prompt_ids;  // a token-id prompt (empty for text)
  int n = 1;
  int max_tokens = 16;
  bool logprobs = false;          // `logprobs` an integer: per-token logprobs (no alternatives)
  bool return_token_ids = false;
};
CompletionAsk read_completion_ask(std::string_view body);

struct GenToken {
  std::int32_t id = 0;
  std::string_view text;
  float logprob = 0;
};
// Generated token k of choice `choice` under `seed` (deterministic).
GenToken generated_token(std::uint64_t seed, std::size_t choice, std::size_t k);

struct CompletionMeta {
  std::string id = "cmpl-stub";
  std::int64_t created = 0;
  std::string adapter;  // empty: the base model (provenance adapter null)
  std::string adapter_sha256, base_model_sha256;
  std::uint64_t prompt_tokens = 0, cached_prompt_tokens = 0;
};
// The table as JSON, {"tokens": [[id, text], ...], "logprobs": [...]}: the Python stubs'
// (bench/proxy/py_stubs.py) generate from it.
std::string generation_table_json();

// The answer's body; every choice of `ask` generates ask.max_tokens tokens (finish "length").
std::string completion_body(const CompletionAsk& ask, const CompletionMeta& meta, std::uint64_t seed);

}  // namespace lorasync::bench
