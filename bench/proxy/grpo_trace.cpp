#include "bench/proxy/grpo_trace.h"

#include <random>

namespace lorasync::bench {

std::vector<TraceRequest> make_grpo_trace(const TraceOptions& o) {
  std::mt19937_64 rng(o.seed);
  std::string tmpl;
  for (int i = 0; i < o.template_tokens; ++i) tmpl += std::to_string(100 + (i * 7919) % 30000) + ",";
  std::vector<TraceRequest> out;
  out.reserve(static_cast<std::size_t>(o.prompts * o.group));
  for (int p = 0; p < o.prompts; ++p) {
    std::string adapter = "policy-v" + std::to_string(1 + p / std::max(1, o.prompts_per_version));
    int len = o.problem_min + static_cast<int>(rng() % static_cast<std::uint64_t>(o.problem_max - o.problem_min + 1));
    std::string ids = tmpl;
    for (int i = 0; i < len; ++i) ids += std::to_string(1000 + rng() % 150000) + (i + 1 < len ? "," : "");
    std::string body = "{\"model\":\"" + adapter + "\",\"prompt\":[" + ids + "],\"max_tokens\":" +
                       std::to_string(o.max_tokens) + ",\"temperature\":1.0,\"top_p\":1.0,\"n\":1" +
                       (o.logprobs ? ",\"logprobs\":0" : "") + (o.return_token_ids ? ",\"return_token_ids\":true" : "") +
                       (o.stream ? ",\"stream\":true" : "") + "}";
    for (int g = 0; g < o.group; ++g) out.push_back({body, p, adapter});
  }
  return out;
}

}  // namespace lorasync::bench
