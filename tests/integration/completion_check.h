// tests/integration/completion_check.h: what a whole /v1/completions answer holds, for the tests
// that send many (serve_soak_test.cpp, serve_inprocess_test.cpp): a 200 alone says nothing of the
// body behind it.
#pragma once

#include <nlohmann/json.hpp>

#include <optional>
#include <string>
#include <vector>

#include "util/http_client.h"

namespace lorasync::testing {

// Checks `body`, the answer to the completion request `req` (a token-id "prompt", "model",
// "max_tokens", optional "n", "stream", "logprobs", "return_token_ids", "stream_options"), against
// what the request asked for: the JSON document, or the SSE stream ending in [DONE]; one choice
// per n (indices 0..n-1), each with its text, a finish_reason of "length" or "stop" and nothing
// after it; with return_token_ids the prompt's ids and 1..max_tokens generated ids, exactly
// max_tokens when it finished for length; with logprobs one logprob (<= 0) per token; the model
// and the adapter (null for `base_model`) that served it; the usage counts (prompt tokens, the
// tokens generated over all choices, their sum), always in a JSON answer and in a stream that
// asked for include_usage. Returns "" when all hold, else the first that does not.
inline std::string completion_problem(const nlohmann::json& req, const std::string& body, const std::string& base_model) {
  using nlohmann::json;
  const int n = req.value("n", 1);
  const int max_tokens = req.at("max_tokens").get<int>();
  const json& prompt = req.at("prompt");
  const std::string model = req.at("model").get<std::string>();
  const bool stream = req.value("stream", false);
  const bool logprobs = req.contains("logprobs") && !req["logprobs"].is_null();
  const bool ids = req.value("return_token_ids", false);
  const bool usage_asked = !stream || (req.contains("stream_options") && req["stream_options"].value("include_usage", false));
  const json adapter = model == base_model ? json(nullptr) : json(model);

  std::vector<json> docs;  // the JSON answer, or the stream's events before [DONE]
  if (stream) {
    auto events = sse_events(body);
    if (events.empty() || events.back() != "[DONE]") return "the stream does not end with [DONE]";
    events.pop_back();
    for (const auto& e : events) {
      docs.push_back(json::parse(e, nullptr, false));
      if (docs.back().is_discarded()) return "an event is not JSON: " + e.substr(0, 200);
    }
  } else {
    docs.push_back(json::parse(body, nullptr, false));
    if (docs.back().is_discarded()) return "the body is not JSON";
  }

  struct Seen {
    std::size_t n_ids = 0, n_logprobs = 0;
    bool prompt_ids = false;
    std::optional<std::string> finish;
  };
  std::vector<Seen> seen(static_cast<std::size_t>(n));
  json usage;
  std::string id;
  for (const json& d : docs) {
    if (!d.is_object() || d.value("object", "") != "text_completion") return "object is not text_completion: " + d.dump().substr(0, 200);
    if (!d["id"].is_string() || d["id"].get<std::string>().empty()) return "no id";
    if (id.empty()) id = d["id"].get<std::string>();
    else if (d["id"] != id) return "the events carry different ids";
    if (d.value("model", "") != model) return "answered for model " + d.value("model", std::string("(none)"));
    if (d.contains("lorasync")) {
      if (d["lorasync"]["adapter"] != adapter) return "served by adapter " + d["lorasync"]["adapter"].dump();
    } else if (!stream) {
      return "no lorasync provenance";
    }
    if (d.contains("usage") && !d["usage"].is_null()) {
      if (!usage.is_null()) return "usage given twice";
      usage = d["usage"];
    }
    if (!d["choices"].is_array()) return "choices is not a list";
    if (!stream && d["choices"].size() != static_cast<std::size_t>(n))
      return std::to_string(d["choices"].size()) + " choices for n = " + std::to_string(n);
    for (std::size_t k = 0; k < d["choices"].size(); ++k) {
      const json& c = d["choices"][k];
      if (!c["index"].is_number_integer()) return "a choice without an index";
      const int i = c["index"].get<int>();
      if (i < 0 || i >= n || (!stream && i != static_cast<int>(k))) return "choice index " + std::to_string(i) + " out of place";
      Seen& s = seen[static_cast<std::size_t>(i)];
      const std::string at = "choice " + std::to_string(i) + ": ";
      if (s.finish) return at + "more after its finish_reason";
      if (!c["text"].is_string()) return at + "no text";
      std::size_t n_new = 0;
      if (ids) {
        if (!c["token_ids"].is_array()) return at + "no token_ids";
        for (const auto& t : c["token_ids"])
          if (!t.is_number_integer()) return at + "a token id that is not an integer";
        n_new = c["token_ids"].size();
        if (s.n_ids == 0 && c.contains("prompt_token_ids")) {
          if (c["prompt_token_ids"] != prompt) return at + "prompt_token_ids differ from the prompt";
          s.prompt_ids = true;
        }
        s.n_ids += n_new;
      }
      if (logprobs) {
        const json& lp = c["logprobs"];
        if (!lp.is_object() || !lp["token_logprobs"].is_array() || !lp["tokens"].is_array()) return at + "no logprobs";
        if (lp["tokens"].size() != lp["token_logprobs"].size()) return at + "logprobs of unequal lengths";
        for (const auto& v : lp["token_logprobs"])
          if (!v.is_number() || v.get<double>() > 1e-4) return at + "a logprob that is not <= 0: " + v.dump();
        if (ids && lp["token_logprobs"].size() != n_new) return at + "a logprob count unlike the token count";
        s.n_logprobs += lp["token_logprobs"].size();
      }
      if (!c["finish_reason"].is_null()) s.finish = c["finish_reason"].get<std::string>();
    }
  }
  std::size_t generated = 0;
  for (int i = 0; i < n; ++i) {
    const Seen& s = seen[static_cast<std::size_t>(i)];
    const std::string at = "choice " + std::to_string(i) + ": ";
    if (!s.finish) return at + "no finish_reason";
    if (*s.finish != "length" && *s.finish != "stop") return at + "finish_reason " + *s.finish;
    const std::size_t made = ids ? s.n_ids : s.n_logprobs;
    if (ids || logprobs) {
      if (made == 0 || made > static_cast<std::size_t>(max_tokens))
        return at + std::to_string(made) + " tokens for max_tokens " + std::to_string(max_tokens);
      if (*s.finish == "length" && made != static_cast<std::size_t>(max_tokens))
        return at + "finished for length after " + std::to_string(made) + " of " + std::to_string(max_tokens) + " tokens";
    }
    if (ids && !s.prompt_ids) return at + "no prompt_token_ids";
    generated += made;
  }
  if (usage.is_null()) return usage_asked ? "no usage" : "";
  const auto count = [&](const char* k) { return usage[k].is_number_integer() ? usage[k].get<long>() : -1; };
  const long p = count("prompt_tokens"), c = count("completion_tokens"), t = count("total_tokens");
  if (p != static_cast<long>(prompt.size())) return "usage: " + std::to_string(p) + " prompt tokens for " + std::to_string(prompt.size());
  if ((ids || logprobs) ? c != static_cast<long>(generated) : (c < n || c > static_cast<long>(n) * max_tokens))
    return "usage: " + std::to_string(c) + " completion tokens, the choices hold " + std::to_string(generated);
  if (t != p + c) return "usage: total_tokens " + std::to_string(t) + " is not " + std::to_string(p + c);
  const long cached = count("cached_prompt_tokens");
  if (cached < 0 || cached > p) return "usage: " + std::to_string(cached) + " cached of " + std::to_string(p) + " prompt tokens";
  return "";
}

}  // namespace lorasync::testing
