// `lorasync eval`: accuracy of a model, with or without a LoRA adapter, on a JSONL problem set,
// graded by the verifier (reward/grade.h, boxed answers only: the training reward's rule).
//
// Two modes, same prompts (rl/dataset.h renders and tokenizes them with the --model tokenizer):
//   in-process  load the model (and --adapter) here and sample each (problem, sample) with
//               model::generate, one sequence at a time; seed of each = mix(seed, index, sample).
//   --server    POST /v1/completions to a running `lorasync serve`, `lorasync proxy` or vLLM, one
//               request per problem with n = --samples and seed = mix(seed, index), token-id
//               prompts, up to --concurrency requests in flight on one io thread (this one).
// Stops: the model's EOS ids plus <|im_end|> when the tokenizer has it (sent as stop_token_ids).
//
// Output: one JSON line on stdout (and atomically to --out):
//   {"accuracy", "problems", "samples", "correct", "mean_length", "truncated_frac", "mode",
//    "seconds", ...}; accuracy = correct / (problems * samples); mean_length in completion tokens
//   (stop token included); truncated_frac = share of samples that hit --max-new-tokens.
//   --samples-out FILE.jsonl keeps every completion with its verdict, sorted by (problem, sample).
// Progress goes to stderr. Exit codes: 2 for bad flags; 1 for everything found while running
// (a missing or malformed data file, an unreachable server, an HTTP error with its message).
#include <utility>  // before Asio's coroutine headers (Boost 1.74 + g++ 12)

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <optional>

#include "commands.h"
#include "core/model/logprobs.h"
#include "core/tokenizer/tokenizer.h"
#include "http/client.h"
#include "model_options.h"
#include "reward/grade.h"
#include "rl/dataset.h"
#include "util/bench_report.h"
#include "util/error.h"
#include "util/files.h"
#include "util/log.h"
#include "util/random.h"

namespace lorasync::cli {

namespace {

using nlohmann::json;

struct EvalCmdOptions {
  ModelOptions model;                 // --model (weights in-process; tokenizer always), --adapter
  rl::DatasetOptions dataset;         // keys, prompt format, system prompt, prompt token limit
  std::string data;                   // JSONL problem set
  std::string server;                 // base URL; empty = in-process
  std::string served_model;           // `model` field in server mode (default: --model's name)
  std::string api_key;                // Authorization: Bearer, server mode
  std::string out;                    // optional JSON result file
  std::string samples_out;            // optional JSONL, one line per completion
  std::int64_t samples = 1;           // completions per problem
  double temperature = 1.0;           // 0 = greedy
  std::int64_t max_new_tokens = 512;  // per completion
  std::int64_t limit = 0;             // first N problems (0 = all)
  std::uint64_t seed = 0;
  int concurrency = 32;               // server mode: requests in flight
};

// Seeds of one problem (server mode: the request's seed) and of one sample (in-process). Kept to
// 63 bits: servers parse the seed as a signed integer.
std::uint64_t problem_seed(std::uint64_t seed, std::int64_t index) {
  return splitmix64(splitmix64(seed) ^ static_cast<std::uint64_t>(index)) >> 1;
}
std::uint64_t sample_seed(std::uint64_t seed, std::int64_t index, std::int64_t sample) {
  return splitmix64(problem_seed(seed, index) ^ splitmix64(static_cast<std::uint64_t>(sample))) >> 1;
}

// Running totals, and a progress line on stderr at most every 5 s (and at the end). Grades each
// completion; keeps a record of each when --samples-out asks for them.
struct Tally {
  std::int64_t n_problems_total = 0, n_problems = 0, n_samples = 0, n_correct = 0, n_tokens = 0,
               n_truncated = 0;
  double t_start = now_seconds(), t_last_report = now_seconds();
  bool keep_records = false;
  std::vector<nlohmann::ordered_json> records;

  void add_sample(const rl::Problem& p, std::int64_t sample, const std::string& text,
                  std::size_t n_completion_tokens, bool truncated) {
    const auto g = reward::grade(text, p.answers);
    ++n_samples;
    n_correct += g.correct ? 1 : 0;
    n_tokens += static_cast<std::int64_t>(n_completion_tokens);
    n_truncated += truncated ? 1 : 0;
    if (keep_records)
      records.push_back({{"index", p.index}, {"sample", sample}, {"correct", g.correct},
                         {"reason", g.reason}, {"extracted", g.extracted},
                         {"n_tokens", n_completion_tokens},
                         {"finish_reason", truncated ? "length" : "stop"}, {"text", text}});
  }
  double accuracy() const {
    return n_samples ? static_cast<double>(n_correct) / static_cast<double>(n_samples) : 0.0;
  }
  void problem_done() {
    ++n_problems;
    const double now = now_seconds();
    if (now - t_last_report < 5.0 && n_problems != n_problems_total) return;
    t_last_report = now;
    LS_LOG_INFO("eval", "{}/{} problems, {} samples, accuracy {:.4f}, {:.1f} s", n_problems,
                n_problems_total, n_samples, accuracy(), now - t_start);
  }
};

// Text of generated ids; ids outside the tokenizer (a model's padded vocabulary rows) are dropped.
std::string decode_completion(const tok::Tokenizer& tk, const std::vector<std::int64_t>& ids) {
  std::vector<std::int32_t> v;
  v.reserve(ids.size());
  for (auto id : ids)
    if (id >= 0 && id <= INT32_MAX && tk.is_valid_id(static_cast<std::int32_t>(id)))
      v.push_back(static_cast<std::int32_t>(id));
  return tk.decode(v, /*skip_special=*/true);
}

std::vector<std::int64_t> stop_ids(const std::vector<std::int64_t>& eos, const tok::Tokenizer& tk) {
  std::vector<std::int64_t> out = eos;
  if (auto im_end = tk.token_to_id("<|im_end|>")) out.push_back(*im_end);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

// ---- in-process --------------------------------------------------------------------------------

void run_in_process(const EvalCmdOptions& o, const std::vector<const rl::Problem*>& problems,
                    const tok::Tokenizer& tk, Tally& tally) {
  auto lm = load_model(o.model);
  const auto& cfg = lm.model->config();
  const auto stops = stop_ids(cfg.eos_token_ids, tk);
  bool warned = false;
  for (const rl::Problem* p : problems) {
    model::GenerateOptions g;
    g.temperature = o.temperature;
    g.stop_ids = stops;
    const auto n_prompt = static_cast<std::int64_t>(p->prompt_ids.size());
    g.max_new_tokens = std::min(o.max_new_tokens, cfg.max_position_embeddings - n_prompt);
    if (g.max_new_tokens < o.max_new_tokens && !warned) {
      LS_LOG_WARN("eval", "problem {}: prompt of {} tokens + --max-new-tokens {} exceeds the "
                  "model's context of {}; generating at most {} tokens for such prompts",
                  p->index, n_prompt, o.max_new_tokens, cfg.max_position_embeddings,
                  std::max<std::int64_t>(g.max_new_tokens, 0));
      warned = true;
    }
    for (std::int64_t s = 0; s < o.samples; ++s) {
      if (g.max_new_tokens < 1) {  // no room at all: an empty, truncated completion
        tally.add_sample(*p, s, "", 0, true);
        continue;
      }
      g.seed = sample_seed(o.seed, p->index, s);
      auto r = model::generate(*lm.model, lm.adapter.get(), p->prompt_ids, g);
      tally.add_sample(*p, s, decode_completion(tk, r.ids), r.ids.size(), !r.stopped);
    }
    tally.problem_done();
  }
}

// ---- server mode -------------------------------------------------------------------------------

// The `model` field: --served-model, else the --model directory's name (serve's default).
std::string run_model_name(const EvalCmdOptions& o) {
  if (!o.served_model.empty()) return o.served_model;
  fs::path m(o.model.model_dir);
  if (m.filename().empty()) m = m.parent_path();  // "dir/"
  return m.filename().string();
}

struct ServerRun {
  const EvalCmdOptions& o;
  const std::vector<const rl::Problem*>& problems;
  const tok::Tokenizer& tk;
  Tally& tally;
  std::vector<std::int64_t> stops;
  std::string model_name;
  http::Pool& pool;
  http::Headers headers;
  std::size_t next = 0;     // next problem to send (one io thread: no lock)
  std::string failure;      // first error; stops dispatch
};

// Grades one response; "" on success, else what is wrong with it.
std::string score_response(ServerRun& run, const rl::Problem& p, const std::string& body) {
  auto j = json::parse(body, nullptr, false);
  if (!j.is_object() || !j.contains("choices") || !j["choices"].is_array())
    return "response without a choices list";
  const json& choices = j["choices"];
  if (static_cast<std::int64_t>(choices.size()) != run.o.samples)
    return fmt::format("{} choices for n = {}", choices.size(), run.o.samples);
  std::int64_t sample = 0;
  for (const json& c : choices) {
    if (!c.is_object()) return "a choice is not an object";
    std::string text;
    std::vector<std::int64_t> ids;
    if (auto t = c.find("token_ids"); t != c.end() && t->is_array()) {
      for (const json& x : *t) {
        if (!x.is_number_integer()) return "token_ids holds a non-integer";
        ids.push_back(x.get<std::int64_t>());
      }
    }
    if (auto t = c.find("text"); t != c.end() && t->is_string()) text = t->get<std::string>();
    else if (!ids.empty()) text = decode_completion(run.tk, ids);
    else return "a choice has neither text nor token_ids";
    std::size_t n_tokens = ids.size();
    if (n_tokens == 0 && !text.empty()) n_tokens = run.tk.encode(text, {.parse_special = false}).size();
    const bool truncated = c.value("finish_reason", json()).is_string() &&
                           c["finish_reason"].get<std::string>() == "length";
    run.tally.add_sample(p, sample++, text, n_tokens, truncated);
  }
  return "";
}

http::Task<void> server_worker(ServerRun& run) {
  while (run.failure.empty() && run.next < run.problems.size()) {
    const rl::Problem& p = *run.problems[run.next++];
    json req = {{"model", run.model_name},
                {"prompt", p.prompt_ids},
                {"n", run.o.samples},
                {"max_tokens", run.o.max_new_tokens},
                {"temperature", run.o.temperature},
                {"top_p", 1},
                {"seed", problem_seed(run.o.seed, p.index)},
                {"return_token_ids", true},
                {"stop_token_ids", run.stops}};
    const std::string body = req.dump();
    http::CallOptions co;
    co.first_byte_timeout_s = 3600;  // a long generation under load sends nothing until done
    auto f = co_await run.pool.fetch({"POST", "/v1/completions", &run.headers, body}, co, 64u << 20);
    if (!run.failure.empty()) co_return;
    if (f.error != http::CallError::kNone) {
      const bool unreachable =
          f.error == http::CallError::kConnect || f.error == http::CallError::kConnectTimeout;
      run.failure = unreachable ? fmt::format("cannot reach server {}: {} ({})", run.pool.url().str(),
                                              f.message, http::call_error_name(f.error))
                                : fmt::format("request to server {} failed for problem {}: {} ({})",
                                              run.pool.url().str(), p.index, f.message,
                                              http::call_error_name(f.error));
      co_return;
    }
    if (f.status != 200) {
      run.failure = fmt::format("server {} answered {} for problem {}: {}", run.pool.url().str(),
                                f.status, p.index, http::error_message_of(f.body));
      co_return;
    }
    std::string bad;
    try {
      bad = score_response(run, p, f.body);
    } catch (const std::exception& e) {  // never let an exception end a detached worker silently
      bad = e.what();
    }
    if (!bad.empty()) {
      run.failure = fmt::format("server {}: malformed response for problem {}: {}",
                                run.pool.url().str(), p.index, bad);
      co_return;
    }
    run.tally.problem_done();
  }
}

void run_server(const EvalCmdOptions& o, const http::Url& url,
                const std::vector<const rl::Problem*>& problems, const tok::Tokenizer& tk,
                Tally& tally) {
  // Stops from the model directory's config when it has one (the tokenizer's otherwise).
  std::vector<std::int64_t> eos;
  const fs::path cfg = fs::path(o.model.model_dir) / "config.json";
  if (fs::exists(cfg)) {
    auto j = json::parse(read_file(cfg), nullptr, false);
    if (j.is_object() && j.contains("eos_token_id")) {
      const json& e = j["eos_token_id"];
      if (e.is_number_integer()) eos.push_back(e.get<std::int64_t>());
      else if (e.is_array())
        for (const json& x : e)
          if (x.is_number_integer()) eos.push_back(x.get<std::int64_t>());
    }
  }
  if (eos.empty() && tk.special_tokens().eos) eos.push_back(*tk.special_tokens().eos);

  boost::asio::io_context ioc;  // declared before the pool: the pool must be destroyed first
  http::ClientOptions copts;
  copts.max_connections = static_cast<std::size_t>(o.concurrency);
  http::Pool pool(url, copts);
  ServerRun run{o, problems, tk, tally, stop_ids(eos, tk), run_model_name(o), pool, {}, 0, {}};
  run.headers.add("Content-Type", "application/json");
  if (!o.api_key.empty()) run.headers.add("Authorization", "Bearer " + o.api_key);
  LS_LOG_INFO("eval", "{} problems x {} samples via {} (model {}, {} in flight)", problems.size(),
              o.samples, url.str(), run.model_name, o.concurrency);
  const auto n_workers = std::min<std::size_t>(static_cast<std::size_t>(o.concurrency), problems.size());
  for (std::size_t w = 0; w < n_workers; ++w)
    boost::asio::co_spawn(ioc, server_worker(run), boost::asio::detached);
  ioc.run();
  if (!run.failure.empty()) throw_env("{}", run.failure);
}

// ---- the command -------------------------------------------------------------------------------

void validate_flags(const EvalCmdOptions& o) {
  if (o.samples < 1 || o.samples > 1024) throw_invalid("--samples must be in [1, 1024], got {}", o.samples);
  if (o.max_new_tokens < 1) throw_invalid("--max-new-tokens must be at least 1, got {}", o.max_new_tokens);
  if (!(o.temperature >= 0)) throw_invalid("--temperature must be >= 0, got {}", o.temperature);
  if (o.limit < 0) throw_invalid("--limit must be >= 0 (0 = all), got {}", o.limit);
  if (o.concurrency < 1) throw_invalid("--concurrency must be at least 1, got {}", o.concurrency);
  if (o.dataset.max_prompt_tokens < 1)
    throw_invalid("--max-prompt-tokens must be at least 1, got {}", o.dataset.max_prompt_tokens);
  if (o.dataset.prompt_format != "chatml" && o.dataset.prompt_format != "raw")
    throw_invalid("--prompt-format {:?} is not one of chatml, raw", o.dataset.prompt_format);
  if (o.server.empty()) {
    if (!o.served_model.empty()) throw_invalid("--served-model needs --server");
    if (!o.api_key.empty()) throw_invalid("--api-key needs --server");
  } else if (!o.model.adapter_dir.empty()) {
    throw_invalid("--adapter is for in-process evaluation; with --server, load the adapter into "
                  "the server and pass its name with --served-model");
  }
}

int run_eval(EvalCmdOptions o) {
  validate_flags(o);
  std::optional<http::Url> url;
  if (!o.server.empty()) {
    std::string err;
    url = http::Url::parse(o.server, err);
    if (!url) throw_invalid("--server {:?}: {}", o.server, err);
  }
  try {
    const double t0 = now_seconds();
    const auto tk = tok::Tokenizer::load(o.model.model_dir);
    auto ds = rl::load_dataset(o.data, tk, o.dataset);
    if (ds.skipped_long > 0)
      LS_LOG_WARN("eval", "{} of {} prompts are longer than --max-prompt-tokens {} and are left out",
                  ds.skipped_long, ds.n_rows, o.dataset.max_prompt_tokens);
    std::vector<const rl::Problem*> problems;
    for (const auto& p : ds.problems) {
      if (o.limit > 0 && static_cast<std::int64_t>(problems.size()) >= o.limit) break;
      problems.push_back(&p);
    }
    Tally tally;
    tally.n_problems_total = static_cast<std::int64_t>(problems.size());
    tally.keep_records = !o.samples_out.empty();
    if (url) run_server(o, *url, problems, tk, tally);
    else run_in_process(o, problems, tk, tally);
    const auto n = static_cast<double>(std::max<std::int64_t>(tally.n_samples, 1));
    nlohmann::ordered_json out = {{"accuracy", tally.accuracy()},
                {"problems", tally.n_problems},
                {"samples", o.samples},
                {"correct", tally.n_correct},
                {"mean_length", static_cast<double>(tally.n_tokens) / n},
                {"truncated_frac", static_cast<double>(tally.n_truncated) / n},
                {"mode", url ? "server" : "in_process"},
                {"seconds", now_seconds() - t0},
                {"data", ds.file},
                {"skipped_long", ds.skipped_long},
                {"seed", o.seed},
                {"temperature", o.temperature},
                {"max_new_tokens", o.max_new_tokens}};
    if (url) out["served_model"] = run_model_name(o);
    else out["adapter"] = o.model.adapter_dir.empty() ? json(nullptr) : json(o.model.adapter_dir);
    if (tally.keep_records) {
      // Server responses arrive in any order: sort by (problem, sample).
      std::sort(tally.records.begin(), tally.records.end(), [](const auto& a, const auto& b) {
        return std::pair(a["index"].template get<std::int64_t>(), a["sample"].template get<std::int64_t>()) <
               std::pair(b["index"].template get<std::int64_t>(), b["sample"].template get<std::int64_t>());
      });
      std::string lines;
      for (const auto& r : tally.records) lines += r.dump() + "\n";
      write_file_atomic(o.samples_out, lines);
    }
    const std::string line = out.dump() + "\n";
    if (!o.out.empty()) write_file_atomic(o.out, line);
    std::fputs(line.c_str(), stdout);
    std::fflush(stdout);
    return 0;
  } catch (const std::exception& e) {
    // Everything past flag parsing is a run-time failure (bad data file, server, model files).
    std::fprintf(stderr, "lorasync eval: error: %s\n", e.what());
    return 1;
  }
}

}  // namespace

void register_eval(CLI::App& root, Registry& reg) {
  auto o = std::make_shared<EvalCmdOptions>();
  auto* sub = root.add_subcommand(
      "eval", "accuracy of a model (optionally with an adapter) on a JSONL problem set");
  add_model_options(sub, o->model);  // --model (also the tokenizer), --adapter, --dtype, --device, --threads
  sub->add_option("--data", o->data, "JSONL problem set (problem and answer fields)")->required();
  sub->add_option("--server", o->server,
                  "evaluate through a running lorasync serve / proxy (base URL) instead of in-process");
  sub->add_option("--served-model", o->served_model,
                  "server mode: the model field to send (an adapter name or the base model id; "
                  "default: --model's directory name)");
  sub->add_option("--api-key", o->api_key, "server mode: sent as Authorization: Bearer");
  sub->add_option("--samples", o->samples, "completions per problem")->capture_default_str();
  sub->add_option("--temperature", o->temperature, "sampling temperature (0 = greedy)")->capture_default_str();
  sub->add_option("--max-new-tokens", o->max_new_tokens, "tokens per completion")->capture_default_str();
  sub->add_option("--limit", o->limit, "evaluate the first N problems (0 = all)")->capture_default_str();
  sub->add_option("--seed", o->seed, "sampling seed (per-sample seeds derive from it)")->capture_default_str();
  sub->add_option("--prompt-format", o->dataset.prompt_format, "chatml | raw")->capture_default_str();
  sub->add_option("--system-prompt", o->dataset.system_prompt, "chatml system message ('' = none)")
      ->capture_default_str();
  sub->add_option("--problem-key", o->dataset.problem_key, "JSON field of the problem")->capture_default_str();
  sub->add_option("--answer-key", o->dataset.answer_key, "JSON field of the answer(s)")->capture_default_str();
  sub->add_option("--max-prompt-tokens", o->dataset.max_prompt_tokens,
                  "longer prompts are left out (reported)")->capture_default_str();
  sub->add_option("--out", o->out, "also write the result JSON to this file (atomically)");
  sub->add_option("--samples-out", o->samples_out,
                  "write every completion (index, sample, correct, text, ...) to this JSONL file");
  sub->add_option("--concurrency", o->concurrency, "server mode: requests in flight")->capture_default_str();
  o->dataset.file_setting = "--data";
  o->dataset.problem_key_setting = "--problem-key";
  o->dataset.answer_key_setting = "--answer-key";
  o->dataset.prompt_format_setting = "--prompt-format";
  o->dataset.max_prompt_tokens_setting = "--max-prompt-tokens";
  reg.add(sub, [o] { return run_eval(*o); });
}

}  // namespace lorasync::cli
