// A rollout request's answer, validated (contracts in completion_response.h).
#include "rl/completion_response.h"

#include <nlohmann/json.hpp>

#include <cmath>

namespace lorasync::rl {

using json = nlohmann::json;

std::optional<std::string> parse_completion_response(const std::string& body, std::int64_t n, std::int64_t max_tokens, std::int64_t vocab,
                                                     const std::string& prefix, const VersionLookup& lookup, TurnAnswer& g) {
  json j = json::parse(body, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return "body is not a JSON object";
  std::string name;
  std::optional<std::string> sha;
  if (j.contains("lorasync") && j["lorasync"].is_object()) {
    const auto& p = j["lorasync"];
    if (!p.contains("adapter") || !p["adapter"].is_string()) return "provenance names no adapter";
    name = p["adapter"].get<std::string>();
    if (p.contains("adapter_sha256") && p["adapter_sha256"].is_string()) sha = p["adapter_sha256"].get<std::string>();
  } else if (j.contains("model") && j["model"].is_string()) {
    name = j["model"].get<std::string>();  // stock vLLM echoes the adapter name
  } else {
    return "no provenance";
  }
  auto v = parse_version_name(name, prefix);
  if (!v) return "provenance names '" + name + "', not a version of this run";
  {
    const auto info = lookup(*v);
    if (!info) return "provenance names unknown version '" + name + "'";
    if (sha && !info->sha256.empty() && *sha != info->sha256) return "adapter_sha256 of '" + name + "' differs from its manifest";
    g.version = *v;
    g.sync_index = info->sync_index;
  }
  if (!j.contains("choices") || !j["choices"].is_array()) return "no choices";
  const auto& ch = j["choices"];
  if (static_cast<std::int64_t>(ch.size()) != n) return "expected " + std::to_string(n) + " choices, got " + std::to_string(ch.size());
  g.members.assign(ch.size(), Member{});
  for (const auto& c : ch) {
    if (!c.is_object() || !c.contains("index") || !c["index"].is_number_integer()) return "choice without index";
    const auto idx = c["index"].get<std::int64_t>();
    if (idx < 0 || idx >= n) return "choice index out of range";
    Member& m = g.members[static_cast<std::size_t>(idx)];
    if (!m.ids.empty()) return "duplicate choice index";
    if (!c.contains("token_ids") || !c["token_ids"].is_array()) return "choice without token_ids";
    for (const auto& t : c["token_ids"]) {
      if (!t.is_number_integer()) return "non-integer token id";
      const auto id = t.get<std::int64_t>();
      if (id < 0 || id >= vocab) return "token id " + std::to_string(id) + " outside the vocabulary";
      m.ids.push_back(static_cast<std::int32_t>(id));
    }
    if (static_cast<std::int64_t>(m.ids.size()) > max_tokens)
      return "choice " + std::to_string(idx) + " has " + std::to_string(m.ids.size()) + " tokens, more than max_tokens " +
             std::to_string(max_tokens);
    const json* lp = nullptr;
    if (c.contains("logprobs") && c["logprobs"].is_object() && c["logprobs"].contains("token_logprobs"))
      lp = &c["logprobs"]["token_logprobs"];
    if (!lp || !lp->is_array()) return "choice without logprobs";
    for (const auto& x : *lp) {
      if (!x.is_number()) return "non-numeric logprob";
      const double d = x.get<double>();
      if (!std::isfinite(d) || d > 0) return "logprob " + std::to_string(d) + " is not finite or > 0";
      m.logprobs.push_back(static_cast<float>(d));
    }
    if (m.ids.empty() || m.ids.size() != m.logprobs.size()) return "token_ids and logprobs differ in length or are empty";
    m.finish = c.contains("finish_reason") && c["finish_reason"].is_string() ? c["finish_reason"].get<std::string>() : "";
  }
  return std::nullopt;
}

}  // namespace lorasync::rl
