// Multi-turn episodes as a rollout source (contracts in episode.h).
#include "rl/episode.h"

#include <utility>  // before Asio's coroutine headers (Boost 1.74 + g++ 12)

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/thread_pool.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <limits>
#include <optional>

#include "core/tokenizer/tokenizer.h"
#include "util/error.h"
#include "util/log.h"
#include "util/random.h"

namespace lorasync::rl {

namespace asio = boost::asio;
using json = nlohmann::json;

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Runs a blocking call on `pool`; the awaiting coroutine resumes on its own executor with the
// result or the exception. `f` must capture only trivially copyable values (pointers, numbers):
// g++ 12 frees non-trivial captures twice on their way through Asio's coroutine initiation.
template <class F>
asio::awaitable<std::invoke_result_t<F>> on_pool(asio::thread_pool& pool, F f) {
  using R = std::invoke_result_t<F>;
  return asio::async_initiate<const asio::use_awaitable_t<>, void(std::exception_ptr, R)>(
      [&pool](auto handler, F fn) {
        asio::post(pool, [handler = std::move(handler), fn = std::move(fn)]() mutable {
          std::exception_ptr err;
          R value{};
          try {
            value = fn();
          } catch (...) {
            err = std::current_exception();
          }
          auto ex = asio::get_associated_executor(handler);
          asio::dispatch(ex, [handler = std::move(handler), err, value = std::move(value)]() mutable {
            std::move(handler)(err, std::move(value));
          });
        });
      },
      asio::use_awaitable, std::move(f));
}

const char* const kTruncations[] = {"turns", "tokens", "observation", "context", "deadline"};

struct EpisodeResult {
  Member member;
  RolloutKind stop = RolloutKind::kOk;  // not kOk: a completion call's outcome ends the group
  std::string why;
  std::int64_t version = 0, sync_index = 0;  // of its first turn (0: none)
  std::optional<EnvFailure> failure;
  std::string truncation;  // "" or one of kTruncations
  std::int64_t cut_turns = 0;  // model turns cut by max_tokens
  double env_s = 0;
  bool unavailable = false;  // the pool shut down: the run is stopping
};

class EpisodeSource final : public RolloutSource {
 public:
  EpisodeSource(const TrainConfig& cfg, const tok::Tokenizer& tokenizer, std::int64_t vocab, std::vector<std::int64_t> stop_ids)
      : cfg_(cfg), tokenizer_(tokenizer), vocab_(vocab), stop_ids_(std::move(stop_ids)),
        pool_(EnvOptions{cfg.env.command, cfg.env.workdir, cfg.env.environment, cfg.env.workers, cfg.env.timeout_s,
                         cfg.env.startup_s, cfg.env.cpu_s, cfg.env.memory_mb, cfg.env.network, cfg.env.max_output_bytes}),
        threads_(static_cast<std::size_t>(std::max<std::int64_t>(1, cfg.env.workers))),
        free_slots_(std::max<std::int64_t>(1, cfg.env.workers)) {
    render_env_turn(tokenizer_, {}, false);  // throws now for a tokenizer without the ChatML markers
    im_end_ = *tokenizer_.token_to_id("<|im_end|>");
  }
  ~EpisodeSource() override { join(); }
  void join() override {
    pool_.shutdown();
    threads_.join();
  }

  std::vector<std::string> counter_names() const override {
    std::vector<std::string> n = {"episode/total", "episode/turns_total", "episode/env_ms_total", "episode/model_tokens_total",
                                  "episode/env_tokens_total", "episode/cut_turns_total"};
    for (auto k : {EnvFailure::kTimeout, EnvFailure::kCrashed, EnvFailure::kInvalid, EnvFailure::kError})
      n.push_back(std::string("rollout/env_") + env_failure_name(k) + "_total");
    for (const char* t : kTruncations) n.push_back(std::string("episode/truncated_") + t + "_total");
    return n;
  }

  void shutdown() override { pool_.shutdown(); }

  asio::awaitable<RolloutOutcome> rollout(const PromptRef& p, const Problem& problem, CompleteFn complete) override {
    const std::int64_t G = cfg_.grpo.num_generations;
    std::uint64_t h = splitmix64(static_cast<std::uint64_t>(cfg_.seed) ^ 0x656e76ULL);
    h = splitmix64(h ^ static_cast<std::uint64_t>(p.epoch));
    h = splitmix64(h ^ static_cast<std::uint64_t>(p.index));
    const auto seed = static_cast<std::int64_t>(splitmix64(h ^ static_cast<std::uint64_t>(p.attempt)) & 0x7fffffffu);
    const std::string row = env_row_json(problem);
    std::vector<EpisodeResult> results(static_cast<std::size_t>(G));
    auto ex = co_await asio::this_coro::executor;
    std::int64_t remaining = G;
    asio::steady_timer done(ex, asio::steady_timer::time_point::max());
    for (std::int64_t m = 0; m < G; ++m)
      asio::co_spawn(ex, run_member(results[static_cast<std::size_t>(m)], row, seed, m, complete, remaining, done), asio::detached);
    while (remaining > 0) {
      boost::system::error_code ec;
      co_await done.async_wait(asio::redirect_error(asio::use_awaitable, ec));
    }
    RolloutOutcome out;
    // A completion call that did not answer ends the group (the worst outcome wins: stopped, then
    // cancelled, then failed), as a single-turn request would.
    for (auto kind : {RolloutKind::kStopped, RolloutKind::kCancelled, RolloutKind::kFailed})
      for (auto& r : results)
        if (r.stop == kind || (kind == RolloutKind::kStopped && r.unavailable)) {
          out.kind = kind;
          out.why = r.why;
          co_return out;
        }
    Group& g = out.group;
    g.prescored = true;
    std::int64_t best_k = std::numeric_limits<std::int64_t>::max();
    for (auto& r : results) {
      if (r.version != 0 && r.sync_index < best_k) best_k = r.sync_index, g.version = r.version, g.sync_index = r.sync_index;
      ++out.counters["episode/total"];
      out.counters["episode/turns_total"] += r.member.turns;
      out.counters["episode/cut_turns_total"] += r.cut_turns;
      out.counters["episode/env_ms_total"] += static_cast<std::int64_t>(r.env_s * 1000);
      out.counters["episode/model_tokens_total"] += r.member.model_tokens();
      out.counters["episode/env_tokens_total"] += static_cast<std::int64_t>(r.member.ids.size()) - r.member.model_tokens();
      if (r.failure) ++out.counters[std::string("rollout/env_") + env_failure_name(*r.failure) + "_total"];
      if (!r.truncation.empty()) ++out.counters["episode/truncated_" + r.truncation + "_total"];
      g.members.push_back(std::move(r.member));
    }
    if (g.version == 0) {  // no episode got as far as a model turn: nothing to train
      out.kind = RolloutKind::kFailed;
      out.why = "no episode of the group reached a model turn";
    }
    co_return out;
  }

 private:
  asio::awaitable<void> run_member(EpisodeResult& out, const std::string& row, std::int64_t seed, std::int64_t m, CompleteFn complete,
                                   std::int64_t& remaining, asio::steady_timer& done) {
    out = co_await episode(row, seed, m, std::move(complete));
    if (--remaining == 0) done.cancel();
  }

  // Episodes wait here, on the rollout thread, for one of env.workers workers: a blocking wait
  // on the environment threads would hold the threads that the running episodes need.
  asio::awaitable<void> acquire_slot() {
    while (free_slots_ == 0) {
      asio::steady_timer t(co_await asio::this_coro::executor, asio::steady_timer::time_point::max());
      waiters_.push_back(&t);
      boost::system::error_code ec;
      co_await t.async_wait(asio::redirect_error(asio::use_awaitable, ec));
      waiters_.erase(std::remove(waiters_.begin(), waiters_.end(), &t), waiters_.end());
    }
    --free_slots_;
  }
  void release_slot() {
    ++free_slots_;
    if (!waiters_.empty()) {
      waiters_.front()->cancel();
      waiters_.erase(waiters_.begin());  // the next release wakes the next waiter
    }
  }

  asio::awaitable<EpisodeResult> episode(const std::string& row, std::int64_t seed, std::int64_t member, CompleteFn complete) {
    bool held = false;
    std::shared_ptr<EnvironmentPool::Session> session;
    EpisodeResult r = co_await run_episode(row, seed, member, complete, held, session);
    session.reset();  // the worker goes back to the pool before the slot is handed on
    if (held) release_slot();
    co_return r;
  }

  asio::awaitable<EpisodeResult> run_episode(const std::string& row, std::int64_t seed, std::int64_t member, CompleteFn complete,
                                             bool& held, std::shared_ptr<EnvironmentPool::Session>& session) {
    EpisodeResult r;
    Member& mem = r.member;
    mem.reward = 0;
    const double t_start = now_s();
    auto fail_env = [&](const EnvFailed& e) {
      if (e.kind() == EnvFailure::kUnavailable) {
        r.unavailable = true;
        return;
      }
      r.failure = e.kind();
      mem.reward = std::numeric_limits<double>::quiet_NaN();
      mem.finish = std::string("env_") + env_failure_name(e.kind());
      LS_LOG_WARN("trainer", "episode failed ({}): {}", env_failure_name(e.kind()), e.what());
    };
    Observation obs;
    try {
      const double t0 = now_s();
      co_await acquire_slot();
      held = true;
      session = co_await on_pool(threads_, [this] { return std::shared_ptr<EnvironmentPool::Session>(pool_.open()); });
      EnvironmentPool::Session* sp = session.get();
      obs = co_await on_pool(threads_, [sp, &row, seed] { return sp->reset(row, seed); });
      r.env_s += now_s() - t0;
    } catch (const EnvFailed& e) {
      fail_env(e);
      co_return r;
    }
    const auto& gen = cfg_.generation;
    std::optional<std::vector<std::int64_t>> first;
    try {
      first = observation_tokens(obs, false, gen.context_len - 1);
    } catch (const EnvFailed& e) {
      fail_env(e);
      co_return r;
    }
    if (!first) {
      fail_env(EnvFailed(EnvFailure::kInvalid, "env: the first observation leaves no room for a model turn in generation.context_len " +
                                                   std::to_string(gen.context_len)));
      co_return r;
    }
    std::vector<std::int64_t> context = std::move(*first);
    mem.prompt_ids = context;
    const std::int64_t episode_budget = cfg_.env.max_episode_tokens > 0 ? cfg_.env.max_episode_tokens : gen.context_len;
    std::int64_t version = 0;
    for (;;) {
      if (mem.turns >= cfg_.env.max_turns) {
        r.truncation = "turns";
        break;
      }
      if (now_s() - t_start > cfg_.env.episode_deadline_s) {
        r.truncation = "deadline";
        break;
      }
      const std::int64_t used = static_cast<std::int64_t>(mem.ids.size());
      const std::int64_t room = std::min({gen.max_new_tokens, episode_budget - used, gen.context_len - static_cast<std::int64_t>(context.size())});
      if (room <= 0) {
        r.truncation = "tokens";
        break;
      }
      TurnRequest req;
      req.prompt = context;
      req.n = 1;
      req.max_tokens = room;
      req.seed_salt = splitmix64(static_cast<std::uint64_t>(member) * 1000003u + static_cast<std::uint64_t>(mem.turns) + 1);
      req.first = mem.turns == 0;
      TurnAnswer a = co_await complete(std::move(req));
      if (a.kind != RolloutKind::kOk) {
        r.stop = a.kind;
        r.why = a.why;
        co_return r;
      }
      const Member& turn = a.members.at(0);
      if (mem.turns == 0) r.version = a.version, r.sync_index = a.sync_index;
      version = a.version;
      ++mem.turns;
      for (std::size_t i = 0; i < turn.ids.size(); ++i) {
        mem.ids.push_back(turn.ids[i]);
        mem.logprobs.push_back(turn.logprobs[i]);
        mem.mask.push_back(1);
        mem.versions.push_back(version);
        context.push_back(turn.ids[i]);
      }
      const bool cut = turn.finish == "length";  // the environment sees it (finish_reason) and decides
      r.cut_turns += cut;
      EnvAction act;
      std::vector<std::int32_t> text_ids(turn.ids.begin(), turn.ids.end());
      if (!text_ids.empty() && std::find(stop_ids_.begin(), stop_ids_.end(), text_ids.back()) != stop_ids_.end()) text_ids.pop_back();
      act.text = tokenizer_.decode(text_ids);
      act.token_ids.assign(turn.ids.begin(), turn.ids.end());
      act.finish_reason = turn.finish.empty() ? "stop" : turn.finish;
      EnvStepResult step;
      std::optional<std::vector<std::int64_t>> obs_ids;
      try {
        const double t0 = now_s();
        EnvironmentPool::Session* sp = session.get();
        const EnvAction* ap = &act;  // lives in this frame until the call returns
        step = co_await on_pool(threads_, [sp, ap] { return sp->step(*ap); });
        r.env_s += now_s() - t0;
        mem.reward += step.reward;
        if (step.done) {
          mem.finish = "done";
          break;
        }
        obs_ids = observation_tokens(step.observation, true, cfg_.env.max_observation_tokens);
        // A turn cut by max_tokens has no end-of-turn token: the template's one closes it (context).
        if (obs_ids && cut && !step.observation.tokens) obs_ids->insert(obs_ids->begin(), im_end_);
      } catch (const EnvFailed& e) {
        fail_env(e);
        co_return r;
      }
      if (!obs_ids || static_cast<std::int64_t>(obs_ids->size()) > cfg_.env.max_observation_tokens) {
        r.truncation = "observation";
        break;
      }
      if (static_cast<std::int64_t>(context.size() + obs_ids->size()) >= gen.context_len ||
          used + static_cast<std::int64_t>(turn.ids.size() + obs_ids->size()) >= episode_budget) {
        r.truncation = "context";
        break;
      }
      for (auto id : *obs_ids) {
        mem.ids.push_back(static_cast<std::int32_t>(id));
        mem.logprobs.push_back(0.0f);
        mem.mask.push_back(0);
        mem.versions.push_back(version);
        context.push_back(id);
      }
    }
    if (!r.truncation.empty()) mem.finish = "truncated_" + r.truncation;
    co_return r;
  }

  // The tokens of an observation (validated against the vocabulary), or nullopt when it has more
  // than `limit` tokens; messages far over it are refused by their size, not tokenized.
  std::optional<std::vector<std::int64_t>> observation_tokens(const Observation& obs, bool continuation, std::int64_t limit) const {
    if (obs.tokens) {
      for (auto id : obs.token_ids)
        if (id < 0 || id >= vocab_)
          throw EnvFailed(EnvFailure::kInvalid, "env: observation token id " + std::to_string(id) + " is outside the vocabulary");
      if (static_cast<std::int64_t>(obs.token_ids.size()) > limit) return std::nullopt;
      return obs.token_ids;
    }
    std::size_t bytes = 0;
    for (const auto& m : obs.messages) bytes += m.content.size();
    if (static_cast<std::int64_t>(bytes) > limit * 64 + 4096) return std::nullopt;
    auto ids = render_env_turn(tokenizer_, obs.messages, continuation);
    if (static_cast<std::int64_t>(ids.size()) > limit) return std::nullopt;
    return ids;
  }

  const TrainConfig& cfg_;
  const tok::Tokenizer& tokenizer_;
  std::int64_t vocab_;
  std::vector<std::int64_t> stop_ids_;
  EnvironmentPool pool_;
  asio::thread_pool threads_;
  std::int64_t im_end_ = 0;
  std::int64_t free_slots_ = 0;                  // rollout thread only
  std::vector<asio::steady_timer*> waiters_;    // rollout thread only
};

}  // namespace

std::string env_row_json(const Problem& problem) {
  return json{{"index", problem.index}, {"problem", problem.problem}, {"answers", problem.answers}}.dump(
      -1, ' ', false, json::error_handler_t::replace);
}

std::vector<std::int64_t> render_env_turn(const tok::Tokenizer& tokenizer, const std::vector<EnvMessage>& messages, bool continuation) {
  const auto start = tokenizer.token_to_id("<|im_start|>"), end = tokenizer.token_to_id("<|im_end|>");
  if (!start || !end) throw_invalid("env: the tokenizer has no <|im_start|> / <|im_end|> tokens (the ChatML template is needed)");
  tok::EncodeOptions eo;
  eo.parse_special = false;
  eo.add_special_tokens = false;
  std::vector<std::int32_t> ids;
  if (continuation) tokenizer.encode_into("\n", ids, eo);
  for (const auto& m : messages) {
    ids.push_back(*start);
    if (m.role == "tool") tokenizer.encode_into("user\n<tool_response>\n" + m.content + "\n</tool_response>", ids, eo);
    else tokenizer.encode_into(m.role + "\n" + m.content, ids, eo);
    ids.push_back(*end);
    tokenizer.encode_into("\n", ids, eo);
  }
  ids.push_back(*start);
  tokenizer.encode_into("assistant\n", ids, eo);
  return {ids.begin(), ids.end()};
}

std::unique_ptr<RolloutSource> make_episode_source(const TrainConfig& cfg, const tok::Tokenizer& tokenizer, std::int64_t vocab,
                                                   std::vector<std::int64_t> stop_ids) {
  return std::make_unique<EpisodeSource>(cfg, tokenizer, vocab, std::move(stop_ids));
}

}  // namespace lorasync::rl
