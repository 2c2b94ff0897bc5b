#include "server/openai.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <limits>

#include "core/tokenizer/chat_template.h"
#include "util/json_limits.h"
#include "core/tokenizer/tokenizer.h"
#include "util/error.h"

namespace lorasync::server {

using nlohmann::json;

namespace {

[[noreturn]] void bad(const std::string& param, const std::string& msg) {
  throw Error(ErrorKind::kInvalidInput, msg, param);
}

// A short view of an untrusted value for an error message: scalars as text, containers by their
// kind and size (never serialised whole).
std::string shown(const json& v) {
  if (v.is_object()) return fmt::format("an object of {} keys", v.size());
  if (v.is_array()) return fmt::format("a list of {} items", v.size());
  auto s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  return s.size() > 80 ? s.substr(0, 77) + "..." : s;
}

json parse_object(std::string_view body) {
  try {
    check_json_depth(body);
  } catch (const Error& e) {
    bad("", e.what());
  }
  json j;
  try {
    j = json::parse(body.begin(), body.end(), nullptr, true, false);
  } catch (const json::exception& e) {
    bad("", std::string("request body is not valid JSON: ") + e.what());
  }
  if (!j.is_object()) bad("", "request body must be a JSON object");
  return j;
}

const json* field(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return nullptr;
  return &*it;
}

double get_number(const json& j, const char* key, double def) {
  const json* v = field(j, key);
  if (!v) return def;
  if (!v->is_number()) bad(key, fmt::format("{} must be a number, got {}", key, shown(*v)));
  double d = v->get<double>();
  if (!std::isfinite(d)) bad(key, fmt::format("{} must be finite", key));
  return d;
}

std::int64_t get_int(const json& j, const char* key, std::int64_t def) {
  const json* v = field(j, key);
  if (!v) return def;
  if (v->is_number_float() && std::floor(v->get<double>()) == v->get<double>() &&
      std::abs(v->get<double>()) < 9e15)
    return static_cast<std::int64_t>(v->get<double>());
  if (!v->is_number_integer()) bad(key, fmt::format("{} must be an integer, got {}", key, shown(*v)));
  if (v->is_number_unsigned() && v->get<std::uint64_t>() > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
    bad(key, fmt::format("{} is too large: {}", key, shown(*v)));
  return v->get<std::int64_t>();
}

bool get_bool(const json& j, const char* key, bool def) {
  const json* v = field(j, key);
  if (!v) return def;
  if (!v->is_boolean()) bad(key, fmt::format("{} must be a boolean, got {}", key, shown(*v)));
  return v->get<bool>();
}

std::vector<std::int32_t> id_list(const json& a, const std::string& key) {
  std::vector<std::int32_t> out;
  out.reserve(a.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    const auto& x = a[i];
    if (!x.is_number_integer())
      bad(key, fmt::format("{}[{}] must be a token id (integer), got {}", key, i, shown(x)));
    auto v = x.get<std::int64_t>();
    if (v < 0 || v > std::numeric_limits<std::int32_t>::max())
      bad(key, fmt::format("{}[{}] = {} is not a valid token id", key, i, v));
    out.push_back(static_cast<std::int32_t>(v));
  }
  return out;
}

// Per-request amplification limits: what one request may ask of the engine.
constexpr std::int64_t kMaxN = 1024;              // completions per prompt
constexpr std::size_t kMaxSequences = 4096;       // prompts x n
constexpr std::size_t kMaxStopStrings = 32;
constexpr std::size_t kMaxStopBytes = 1024;
constexpr std::size_t kMaxStopTokenIds = 256;

void parse_common(const json& j, ParsedCompletion& r) {
  const json* m = field(j, "model");
  if (!m) bad("model", "model is required");
  if (!m->is_string()) bad("model", fmt::format("model must be a string, got {}", shown(*m)));
  r.model = m->get<std::string>();
  auto& p = r.params;
  p.max_tokens = get_int(j, "max_tokens", 16);
  if (r.chat && !field(j, "max_tokens")) {
    if (field(j, "max_completion_tokens")) p.max_tokens = get_int(j, "max_completion_tokens", 16);
    else r.max_tokens_unset = true;
  }
  p.temperature = get_number(j, "temperature", 1.0);
  p.top_p = get_number(j, "top_p", 1.0);
  p.top_k = get_int(j, "top_k", 0);
  p.min_p = get_number(j, "min_p", 0.0);
  p.repetition_penalty = get_number(j, "repetition_penalty", 1.0);
  for (const char* k : {"presence_penalty", "frequency_penalty"})
    if (get_number(j, k, 0.0) != 0.0)
      bad(k, fmt::format("{} is not supported (use repetition_penalty); got {}", k, shown(j[k])));
  if (const json* s = field(j, "seed")) {
    if (!s->is_number_integer()) bad("seed", fmt::format("seed must be an integer, got {}", shown(*s)));
    p.seed = static_cast<std::uint64_t>(s->get<std::int64_t>());
  }
  if (const json* s = field(j, "stop")) {
    if (s->is_string()) {
      p.stop.push_back(s->get<std::string>());
    } else if (s->is_array()) {
      for (std::size_t i = 0; i < s->size(); ++i) {
        if (!(*s)[i].is_string()) bad("stop", fmt::format("stop[{}] must be a string, got {}", i, shown((*s)[i])));
        p.stop.push_back((*s)[i].get<std::string>());
      }
    } else {
      bad("stop", fmt::format("stop must be a string or a list of strings, got {}", shown(*s)));
    }
    // Stop strings are scanned on every generated token on the engine thread: bounded.
    if (p.stop.size() > kMaxStopStrings)
      bad("stop", fmt::format("at most {} stop strings, got {}", kMaxStopStrings, p.stop.size()));
    for (const auto& x : p.stop) {
      if (x.empty()) bad("stop", "stop strings must not be empty");
      if (x.size() > kMaxStopBytes) bad("stop", fmt::format("a stop string is at most {} bytes, got {}", kMaxStopBytes, x.size()));
    }
  }
  if (const json* s = field(j, "stop_token_ids")) {
    if (!s->is_array()) bad("stop_token_ids", fmt::format("stop_token_ids must be a list of integers, got {}", shown(*s)));
    if (s->size() > kMaxStopTokenIds)
      bad("stop_token_ids", fmt::format("at most {} stop_token_ids, got {}", kMaxStopTokenIds, s->size()));
    p.stop_token_ids = id_list(*s, "stop_token_ids");
  }
  p.ignore_eos = get_bool(j, "ignore_eos", false);
  const std::int64_t n = get_int(j, "n", 1);
  if (n < 1 || n > kMaxN) bad("n", fmt::format("n must be in [1, {}], got {}", kMaxN, n));
  p.n = static_cast<int>(n);
  if (const json* b = field(j, "best_of"))
    if (!b->is_number_integer() || b->get<std::int64_t>() != n)
      bad("best_of", "best_of is not supported (only best_of = n)");
  if (get_bool(j, "echo", false)) bad("echo", "echo is not supported");
  if (r.chat) {
    if (get_bool(j, "logprobs", false)) {
      const std::int64_t k = get_int(j, "top_logprobs", 0);
      if (k < 0 || k > 1000) bad("top_logprobs", fmt::format("top_logprobs must be in [0, 1000], got {}", k));
      p.logprobs = static_cast<int>(k);
    }
  } else if (const json* lp = field(j, "logprobs")) {
    if (!lp->is_number_integer()) bad("logprobs", fmt::format("logprobs must be an integer or null, got {}", shown(*lp)));
    auto k = lp->get<std::int64_t>();
    if (k < 0 || k > 1000) bad("logprobs", fmt::format("logprobs must be >= 0, got {}", k));
    p.logprobs = static_cast<int>(k);
  }
  p.skip_special_tokens = get_bool(j, "skip_special_tokens", true);
  r.return_token_ids = get_bool(j, "return_token_ids", false);
  r.stream = get_bool(j, "stream", false);
  if (const json* so = field(j, "stream_options")) {
    if (!so->is_object()) bad("stream_options", "stream_options must be an object");
    r.include_usage = get_bool(*so, "include_usage", false);
  }
}

}  // namespace

ParsedCompletion parse_completion(std::string_view body, const tok::Tokenizer& tokenizer) {
  json j = parse_object(body);
  ParsedCompletion r;
  parse_common(j, r);
  const json* pr = field(j, "prompt");
  if (!pr) bad("prompt", "prompt is required");
  tok::EncodeOptions eo;
  eo.parse_special = true;
  auto encode = [&](const json& s, const std::string& key) {
    try {
      return tokenizer.encode(s.get<std::string>(), eo);
    } catch (const Error& e) {
      bad(key, fmt::format("{}: {}", key, e.what()));
    }
  };
  if (pr->is_string()) {
    r.prompts.push_back(encode(*pr, "prompt"));
  } else if (pr->is_array()) {
    if (pr->empty()) bad("prompt", "prompt must not be an empty list");
    const json& first = (*pr)[0];
    if (first.is_number()) {
      r.prompts.push_back(id_list(*pr, "prompt"));
    } else {
      const std::size_t sequences = pr->size() * static_cast<std::size_t>(r.params.n);
      if (sequences > kMaxSequences)
        bad("prompt", fmt::format("{} prompts x n = {} asks for {} sequences; at most {} per request", pr->size(),
                                  r.params.n, sequences, kMaxSequences));
      for (std::size_t i = 0; i < pr->size(); ++i) {
        const json& e = (*pr)[i];
        const std::string key = fmt::format("prompt[{}]", i);
        if (e.is_string()) r.prompts.push_back(encode(e, key));
        else if (e.is_array()) r.prompts.push_back(id_list(e, key));
        else bad("prompt", fmt::format("{} must be a string or a list of token ids, got {}", key, shown(e)));
      }
    }
  } else {
    bad("prompt", fmt::format("prompt must be a string, a list of token ids, or a list of those; got {}", shown(*pr)));
  }
  for (const auto& p : r.prompts)
    if (p.empty()) bad("prompt", "prompt must not be empty");
  return r;
}

ParsedCompletion parse_chat(std::string_view body, const tok::Tokenizer& tokenizer, tok::ChatFormat format) {
  json j = parse_object(body);
  ParsedCompletion r;
  r.chat = true;
  parse_common(j, r);
  const json* ms = field(j, "messages");
  if (!ms || !ms->is_array() || ms->empty()) bad("messages", "messages must be a non-empty list");
  std::vector<tok::ChatMessage> msgs;
  for (std::size_t i = 0; i < ms->size(); ++i) {
    const json& m = (*ms)[i];
    const std::string key = fmt::format("messages[{}]", i);
    if (!m.is_object()) bad("messages", key + " must be an object");
    const json* role = field(m, "role");
    if (!role || !role->is_string()) bad("messages", key + ".role must be a string");
    const std::string rs = role->get<std::string>();
    if (rs != "system" && rs != "user" && rs != "assistant")
      bad("messages", fmt::format("{}.role must be system, user or assistant; got '{}'", key, rs));
    const json* content = field(m, "content");
    std::string text;
    if (content && content->is_string()) {
      text = content->get<std::string>();
    } else if (content && content->is_array()) {
      for (const auto& part : *content) {
        if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") || !part["text"].is_string())
          bad("messages", key + ".content parts must be {\"type\": \"text\", \"text\": ...}");
        text += part["text"].get<std::string>();
      }
    } else if (content) {
      bad("messages", key + ".content must be a string or a list of text parts");
    }
    msgs.push_back({rs, std::move(text)});
  }
  tok::ChatOptions co;
  if (const json* kw = field(j, "chat_template_kwargs")) {
    if (!kw->is_object()) bad("chat_template_kwargs", "chat_template_kwargs must be an object");
    if (const json* th = field(*kw, "enable_thinking")) {
      if (!th->is_boolean()) bad("chat_template_kwargs", "chat_template_kwargs.enable_thinking must be a boolean");
      co.enable_thinking = th->get<bool>();
    }
  }
  std::string prompt = tok::render_chat(format, msgs, co);
  tok::EncodeOptions eo;
  eo.parse_special = true;
  r.prompts.push_back(tokenizer.encode(prompt, eo));
  for (std::string_view s : tok::chat_stop_tokens(format))
    if (auto id = tokenizer.token_to_id(s)) r.params.stop_token_ids.push_back(*id);
  return r;
}

CompletionState::CompletionState(std::string id, std::int64_t created, const ParsedCompletion& req,
                                 Provenance prov, const tok::Tokenizer* tokenizer)
    : id_(std::move(id)), created_(created), req_(req), prov_(std::move(prov)), tokenizer_(tokenizer) {
  const auto n = static_cast<std::size_t>(req.params.n);
  choices_.resize(req.prompts.size() * n);
  usage_.resize(req.prompts.size());
  done_.assign(req.prompts.size(), false);
  prompts_ = req.prompts;
}

bool CompletionState::all_done() const {
  for (bool d : done_)
    if (!d) return false;
  return true;
}

std::string CompletionState::add(std::size_t prompt_index, const std::vector<engine::ChoiceDelta>& deltas,
                                 const engine::RequestUsage& usage, bool done) {
  std::string events;
  const auto n = static_cast<std::size_t>(req_.params.n);
  for (const auto& d : deltas) {
    const std::size_t ci = prompt_index * n + static_cast<std::size_t>(d.index);
    if (ci >= choices_.size()) continue;
    Choice& c = choices_[ci];
    const std::size_t first_token = c.ids.size();
    for (const auto& t : d.tokens) {
      c.ids.push_back(t.id);
      c.logprobs.push_back(t.logprob);
      c.tokens.push_back(t.text);
      c.top.push_back(t.top);
      c.offsets.push_back(c.text_len);
      c.text_len += static_cast<std::int64_t>(t.text.size());
    }
    c.text += d.text;
    if (d.finish == engine::FinishReason::kError && error_.empty()) {
      error_ = d.error;
      error_internal_ = d.internal;
    }
    if (d.finish != engine::FinishReason::kNone) c.finish = engine::finish_reason_name(d.finish);
    if (req_.stream && (!d.tokens.empty() || !d.text.empty() || d.finish != engine::FinishReason::kNone))
      events += "data: " + chunk_json(ci, d, first_token) + "\n\n";
  }
  usage_[prompt_index] = usage;
  if (done) done_[prompt_index] = true;
  return events;
}

namespace {

json logprobs_json(const std::vector<std::string>& tokens, const std::vector<float>& lps,
                   const std::vector<std::vector<std::pair<std::int32_t, float>>>& top,
                   const std::vector<std::int64_t>& offsets, std::size_t from, bool with_top,
                   const tok::Tokenizer* tk) {
  json toks = json::array(), vals = json::array(), offs = json::array();
  json tops = with_top ? json::array() : json(nullptr);
  for (std::size_t i = from; i < lps.size(); ++i) {
    toks.push_back(tokens[i]);
    vals.push_back(lps[i]);
    offs.push_back(offsets[i]);
    if (with_top) {
      json m = json::object();
      for (const auto& [id, lp] : top[i]) {
        std::string key = tk && tk->is_valid_id(id) ? tk->decode(std::span<const std::int32_t>(&id, 1)) : std::to_string(id);
        if (!m.contains(key)) m[key] = lp;
      }
      tops.push_back(m);
    }
  }
  return {{"tokens", toks}, {"token_logprobs", vals}, {"top_logprobs", tops}, {"text_offset", offs}};
}

// One token in the chat shape: its text (lossy where the token ends inside a UTF-8 character),
// its exact bytes as integers, and its logprob, as OpenAI and vLLM return it.
json chat_token_json(std::int32_t id, float lp, const tok::Tokenizer* tk) {
  std::string_view raw;
  std::string text;
  if (tk && tk->is_valid_id(id)) {
    raw = tk->token_bytes(id);
    text = tk->decode(std::span<const std::int32_t>(&id, 1));
  } else {
    text = std::to_string(id);
    raw = text;
  }
  json bytes = json::array();
  for (unsigned char b : raw) bytes.push_back(static_cast<int>(b));
  return {{"token", std::move(text)}, {"logprob", lp}, {"bytes", std::move(bytes)}};
}

// Chat completions: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}
// (choices[].logprobs.content[]), top_logprobs always a list (empty unless asked for).
json chat_logprobs_json(const std::vector<std::int32_t>& ids, const std::vector<float>& lps,
                        const std::vector<std::vector<std::pair<std::int32_t, float>>>& top,
                        std::size_t from, const tok::Tokenizer* tk) {
  json content = json::array();
  for (std::size_t i = from; i < lps.size(); ++i) {
    json entry = chat_token_json(ids[i], lps[i], tk);
    json tops = json::array();
    for (const auto& [id, lp] : top[i]) tops.push_back(chat_token_json(id, lp, tk));
    entry["top_logprobs"] = std::move(tops);
    content.push_back(std::move(entry));
  }
  return {{"content", std::move(content)}, {"refusal", nullptr}};
}

}  // namespace

nlohmann::json CompletionState::choice_logprobs(const Choice& c, std::size_t from) const {
  if (!req_.params.logprobs) return json(nullptr);
  if (req_.chat) return chat_logprobs_json(c.ids, c.logprobs, c.top, from, tokenizer_);
  return logprobs_json(c.tokens, c.logprobs, c.top, c.offsets, from, *req_.params.logprobs > 0,
                       tokenizer_);
}

std::string CompletionState::chunk_json(std::size_t ci, const engine::ChoiceDelta& d,
                                        std::size_t first_token) const {
  const Choice& c = choices_[ci];
  json choice = {{"index", ci}, {"finish_reason", nullptr}};
  if (req_.chat) {
    choice["delta"] = first_token == 0 ? json{{"role", "assistant"}, {"content", d.text}} : json{{"content", d.text}};
  } else {
    choice["text"] = d.text;
  }
  choice["logprobs"] = choice_logprobs(c, first_token);
  if (req_.return_token_ids) {
    choice["token_ids"] = std::vector<std::int32_t>(c.ids.begin() + static_cast<std::ptrdiff_t>(first_token), c.ids.end());
    if (first_token == 0) choice["prompt_token_ids"] = prompts_[ci / static_cast<std::size_t>(req_.params.n)];
  }
  if (d.finish != engine::FinishReason::kNone) choice["finish_reason"] = engine::finish_reason_name(d.finish);
  json j = {{"id", id_},
            {"object", req_.chat ? "chat.completion.chunk" : "text_completion"},
            {"created", created_},
            {"model", req_.model},
            {"choices", json::array({choice})}};
  j["lorasync"] = {{"adapter", prov_.adapter ? json(*prov_.adapter) : json(nullptr)},
                   {"adapter_sha256", prov_.adapter_sha256 ? json(*prov_.adapter_sha256) : json(nullptr)},
                   {"base_model_sha256", prov_.base_model_sha256}};
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string CompletionState::usage_json() const {
  std::int64_t prompt = 0, completion = 0, cached = 0;
  for (const auto& u : usage_) {
    prompt += u.prompt_tokens;
    completion += u.completion_tokens;
    cached += u.cached_prompt_tokens;
  }
  json u = {{"prompt_tokens", prompt},
            {"completion_tokens", completion},
            {"total_tokens", prompt + completion},
            {"cached_prompt_tokens", cached},
            {"prompt_tokens_details", {{"cached_tokens", cached}}}};
  return u.dump();
}

std::string CompletionState::final_json() const {
  json choices = json::array();
  for (std::size_t i = 0; i < choices_.size(); ++i) {
    const Choice& c = choices_[i];
    json ch = {{"index", i}, {"finish_reason", c.finish ? json(*c.finish) : json(nullptr)}};
    if (req_.chat) ch["message"] = {{"role", "assistant"}, {"content", c.text}};
    else ch["text"] = c.text;
    ch["logprobs"] = choice_logprobs(c, 0);
    if (req_.return_token_ids) {
      ch["token_ids"] = c.ids;
      ch["prompt_token_ids"] = prompts_[i / static_cast<std::size_t>(req_.params.n)];
    }
    choices.push_back(std::move(ch));
  }
  json j = {{"id", id_},
            {"object", req_.chat ? "chat.completion" : "text_completion"},
            {"created", created_},
            {"model", req_.model},
            {"choices", choices},
            {"usage", json::parse(usage_json())}};
  j["lorasync"] = {{"adapter", prov_.adapter ? json(*prov_.adapter) : json(nullptr)},
                   {"adapter_sha256", prov_.adapter_sha256 ? json(*prov_.adapter_sha256) : json(nullptr)},
                   {"base_model_sha256", prov_.base_model_sha256}};
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string CompletionState::stream_tail() const {
  std::string out;
  if (req_.include_usage) {
    json j = {{"id", id_},
              {"object", req_.chat ? "chat.completion.chunk" : "text_completion"},
              {"created", created_},
              {"model", req_.model},
              {"choices", json::array()},
              {"usage", json::parse(usage_json())}};
    out += "data: " + j.dump() + "\n\n";
  }
  out += "data: [DONE]\n\n";
  return out;
}

}  // namespace lorasync::server
