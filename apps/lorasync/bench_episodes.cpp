// `lorasync bench episodes`: multi-turn episodes through the fleet (docs/environments.md, "Routing
// and cache"). Two `lorasync serve` replicas of a small model and, in front of them, either
// `lorasync proxy` (prefix-affinity routing) or, as the same-run baseline, a round-robin choice of
// replica per request (what a generic load balancer does). Each episode is `turns` model turns
// built as the trainer builds them (rl/episode.h): turn k+1's prompt is turn k's prompt, the
// sampled tokens and an environment turn rendered with the template, token for token. Reported per
// arm (best round of `rounds`, the arms alternating first): the share of each continuation turn's
// prompt the replica served from its prefix cache (usage.prompt_tokens_details.cached_tokens over
// prompt tokens; the environment's new tokens can never be cached, so short turns bound it), the
// share of the previous turn's context (prompt + completion) that was reused from the cache
// (1.0 = all of it but the last partial KV block), episodes/s and turns/s.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <atomic>
#include <mutex>
#include <thread>

#include "bench_proxy.h"
#include "commands.h"
#include "core/tokenizer/tokenizer.h"
#include "http/blocking_client.h"
#include "rl/episode.h"
#include "util/bench_report.h"
#include "util/error.h"
#include "util/files.h"
#include "util/log.h"
#include "util/process.h"

namespace lorasync::cli {

namespace {

using nlohmann::json;
using bench_proxy::Child;

// A tool-using agent's system turn (about 150 tokens), the same for every episode.
constexpr const char* kSystem =
    "You are a careful assistant that solves maths problems step by step. You may call tools. "
    "# Tools\n\nYou may call one or more functions to assist with the user query. You are provided with function "
    "signatures within <tools></tools> XML tags:\n<tools>\n{\"type\": \"function\", \"function\": {\"name\": "
    "\"calculator\", \"description\": \"Evaluate an arithmetic expression\", \"parameters\": {\"type\": \"object\", "
    "\"properties\": {\"expression\": {\"type\": \"string\"}}, \"required\": [\"expression\"]}}}\n</tools>\n\nFor "
    "each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags. "
    "Put the final answer within \\boxed{}.";

struct BenchEpisodesOptions {
  std::string model;  // "" = a tiny random model with the Qwen2 tokenizer (init-model --preset tiny)
  std::string tokenizer = std::string(LORASYNC_SOURCE_DIR) + "/../shared/data/qwen2-tokenizer";
  std::int64_t episodes = 24, turns = 4, concurrency = 6, max_tokens = 48, rounds = 3, replicas = 2, threads = 1;
};

// `lorasync serve` on port 0; its first stdout line names the port.
Child spawn_serve(const std::string& model, std::int64_t threads) {
  const std::string self = lorasync_executable();
  int fds[2];
  if (pipe(fds) != 0) throw_env("pipe failed");
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(fds[1], 1);
    for (int fd = 3; fd < 65536; ++fd) close(fd);
    std::vector<std::string> args = {"lorasync", "--log-level", "warn", "serve", "--model", model, "--served-model-name", "m",
                                     "--port", "0", "--kv-cache-memory", "256MiB", "--max-model-len", "2048",
                                     "--threads", std::to_string(threads)};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(self.c_str(), argv.data());
    _exit(127);
  }
  close(fds[1]);
  const std::string line = bench_proxy::read_child_line(fds[0]);
  json j = json::parse(line, nullptr, false);
  if (j.is_discarded() || !j.contains("port")) throw_env("bench episodes: serve did not start: '{}'", line);
  return {pid, static_cast<std::uint16_t>(j["port"].get<int>())};
}

struct ArmResult {
  double cached_share = 0;  // continuation turns: cached prompt tokens / prompt tokens
  double reuse = 0;         // continuation turns: cached prompt tokens / the previous turn's context
  double episodes_per_s = 0, turns_per_s = 0;
  std::int64_t continuation_turns = 0;
};

// One round: every episode through `pick(request_no)`'s URL.
ArmResult run_arm(const BenchEpisodesOptions& o, const tok::Tokenizer& tk, const std::vector<std::string>& urls, bool round_robin,
                  std::int64_t round) {
  const auto im_end = *tk.token_to_id("<|im_end|>");
  std::atomic<std::int64_t> next_episode{0}, request_no{0};
  std::mutex mu;
  double cached = 0, prompt = 0, previous = 0;
  std::int64_t cont = 0, turns_done = 0;
  std::string failure;
  const double t0 = now_seconds();
  std::vector<std::thread> threads;
  for (std::int64_t c = 0; c < o.concurrency; ++c)
    threads.emplace_back([&] {
      std::vector<std::unique_ptr<http::BlockingClient>> clients;
      for (const auto& u : urls) clients.push_back(std::make_unique<http::BlockingClient>(u));
      for (;;) {
        const std::int64_t e = next_episode++;
        if (e >= o.episodes) return;
        // Distinct tasks per episode and round (no cross-episode reuse beyond the system turn).
        std::vector<std::int64_t> ctx = rl::render_env_turn(
            tk, {{"system", kSystem},
                 {"user", "Task " + std::to_string(round) + "-" + std::to_string(e) + ": add the numbers " +
                              std::to_string(e * 37 % 101) + " and " + std::to_string(e * 53 % 97) + "."}},
            false);
        double prev_len = 0;
        for (std::int64_t t = 0; t < o.turns; ++t) {
          const std::size_t which = round_robin ? static_cast<std::size_t>(request_no++ % static_cast<std::int64_t>(urls.size())) : 0;
          json body = {{"model", "m"}, {"prompt", ctx}, {"max_tokens", o.max_tokens}, {"temperature", 1.0}, {"n", 1},
                       {"return_token_ids", true}, {"seed", e * 1000 + t}};
          auto r = clients[which]->request("POST", "/v1/completions", body.dump(), 300);
          json a = json::parse(r.body, nullptr, false);
          if (r.status != 200 || a.is_discarded() || !a.contains("choices")) {
            std::lock_guard lk(mu);
            failure = "HTTP " + std::to_string(r.status) + ": " + r.body.substr(0, 300) + r.message;
            return;
          }
          const auto ids = a["choices"][0]["token_ids"].get<std::vector<std::int64_t>>();
          const auto cached_t = a["usage"]["prompt_tokens_details"]["cached_tokens"].get<double>();
          {
            std::lock_guard lk(mu);
            ++turns_done;
            if (t > 0) cached += cached_t, prompt += static_cast<double>(ctx.size()), previous += prev_len, ++cont;
          }
          ctx.insert(ctx.end(), ids.begin(), ids.end());
          prev_len = static_cast<double>(ctx.size());  // what the replica computed: prompt + completion
          if (a["choices"][0]["finish_reason"] == "length") ctx.push_back(im_end);  // as the trainer closes a cut turn
          const auto obs = rl::render_env_turn(tk, {{"user", "Observation " + std::to_string(t) + ": the tool returned " +
                                                                 std::to_string((e + t) * 7919 % 1000) + "."}},
                                               true);
          ctx.insert(ctx.end(), obs.begin(), obs.end());
        }
      }
    });
  for (auto& th : threads) th.join();
  if (!failure.empty()) throw_env("bench episodes: a request failed: {}", failure);
  const double wall = now_seconds() - t0;
  ArmResult r;
  r.cached_share = prompt > 0 ? cached / prompt : 0;
  r.reuse = previous > 0 ? cached / previous : 0;
  r.episodes_per_s = static_cast<double>(o.episodes) / wall;
  r.turns_per_s = static_cast<double>(turns_done) / wall;
  r.continuation_turns = cont;
  return r;
}

int run(const BenchEpisodesOptions& o) {
  BenchReporter rep;
  TempDir tmp("lorasync-bench-episodes");
  std::string model = o.model;
  if (model.empty()) {
    model = (tmp.path() / "tiny").string();
    const std::string cmd = bench_proxy::sh_quote(lorasync_executable()) + " --log-level warn init-model --preset tiny --seed 5 --init-std 0.1 --tokenizer " +
                            bench_proxy::sh_quote(o.tokenizer) + " --output " + bench_proxy::sh_quote(model) + " > /dev/null";
    if (std::system(cmd.c_str()) != 0) throw_env("bench episodes: init-model failed ({})", cmd);
  }
  const tok::Tokenizer tk = tok::Tokenizer::load(model);
  std::vector<Child> replicas;
  std::vector<std::string> urls;
  for (std::int64_t i = 0; i < o.replicas; ++i) {
    replicas.push_back(spawn_serve(model, o.threads));
    urls.push_back("http://127.0.0.1:" + std::to_string(replicas.back().port));
  }
  Child proxy = bench_proxy::spawn_proxy(urls, 1);
  const std::vector<std::string> via_proxy = {"http://127.0.0.1:" + std::to_string(proxy.port)};
  ArmResult best_proxy, best_rr;
  try {
    for (std::int64_t round = 0; round < o.rounds; ++round) {
      for (int k = 0; k < 2; ++k) {
        const bool rr = (k == 0) == (round % 2 == 1);  // alternate which arm goes first
        ArmResult a = run_arm(o, tk, rr ? urls : via_proxy, rr, round * 2 + k);
        ArmResult& best = rr ? best_rr : best_proxy;
        LS_LOG_INFO("bench", "round {} {}: cached share {:.3f}, {:.2f} episodes/s", round, rr ? "round-robin" : "proxy",
                    a.cached_share, a.episodes_per_s);
        if (a.episodes_per_s > best.episodes_per_s) best.episodes_per_s = a.episodes_per_s, best.turns_per_s = a.turns_per_s;
        best.cached_share = std::max(best.cached_share, a.cached_share);
        best.reuse = std::max(best.reuse, a.reuse);
        best.continuation_turns = a.continuation_turns;
      }
    }
  } catch (...) {
    bench_proxy::stop_child(proxy);
    for (auto& r : replicas) bench_proxy::stop_child(r);
    throw;
  }
  // How the proxy spread the turns: the busier replica's share of what it routed.
  double busiest = 0;
  json router;
  {
    http::BlockingClient c(via_proxy[0]);
    json st = json::parse(c.request("GET", "/proxy/stats").body, nullptr, false);
    if (!st.is_discarded() && st.contains("upstreams")) {
      double total = 0, top = 0;
      for (const auto& u : st["upstreams"]) total += u.value("routed", 0.0), top = std::max(top, u.value("routed", 0.0));
      busiest = total > 0 ? top / total : 0;
      router = st["router"];
    }
  }
  bench_proxy::stop_child(proxy);
  for (auto& r : replicas) bench_proxy::stop_child(r);
  LS_LOG_INFO("bench", "proxy router: {}", router.dump());
  const json cj = {{"episodes", o.episodes}, {"turns", o.turns}, {"concurrency", o.concurrency}, {"max_tokens", o.max_tokens},
                   {"replicas", o.replicas}, {"rounds", o.rounds}, {"baseline", "round-robin over the replicas"},
                   {"statistic", "best round of each arm"}, {"continuation_turns", best_proxy.continuation_turns}};
  rep.emit({"episodes", "continuation_cached_share", best_proxy.cached_share, "fraction", best_rr.cached_share, cj});
  rep.emit({"episodes", "continuation_prefix_reuse", best_proxy.reuse, "fraction", best_rr.reuse, cj});
  rep.emit({"episodes", "episodes_per_s", best_proxy.episodes_per_s, "episodes/s", best_rr.episodes_per_s, cj});
  rep.emit({"episodes", "proxy_busiest_replica_share", busiest, "fraction", std::nullopt, cj});
  rep.emit({"episodes", "turns_per_s", best_proxy.turns_per_s, "turns/s", best_rr.turns_per_s, cj});
  rep.print_table();
  return 0;
}

}  // namespace

void register_bench_episodes(CLI::App& bench, Registry& reg) {
  auto o = std::make_shared<BenchEpisodesOptions>();
  auto* sub = bench.add_subcommand("episodes", "multi-turn episodes through the proxy: prefix-cache share of continuations, episodes/s");
  sub->add_option("--model", o->model, "model directory (default: a tiny random model with the Qwen2 tokenizer)");
  sub->add_option("--tokenizer", o->tokenizer, "tokenizer of the default model")->capture_default_str();
  sub->add_option("--episodes", o->episodes, "episodes per round and arm")->capture_default_str();
  sub->add_option("--turns", o->turns, "model turns per episode")->capture_default_str();
  sub->add_option("--concurrency", o->concurrency, "episodes in flight")->capture_default_str();
  sub->add_option("--max-tokens", o->max_tokens, "tokens per model turn")->capture_default_str();
  sub->add_option("--rounds", o->rounds, "rounds of both arms (best of each is reported)")->capture_default_str();
  sub->add_option("--replicas", o->replicas, "serve replicas")->capture_default_str();
  sub->add_option("--threads", o->threads, "compute threads per replica")->capture_default_str();
  reg.add(sub, [o] { return run(*o); });
}

}  // namespace lorasync::cli
