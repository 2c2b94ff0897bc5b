#include "rl/pipeline.h"

#include <utility>  // before Asio's coroutine headers (Boost 1.74 + g++ 12)

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <limits>
#include <mutex>
#include <random>
#include <thread>

#include "core/tokenizer/tokenizer.h"
#include "http/client.h"
#include "reward/reward_fn.h"
#include "rl/advantages.h"
#include "rl/completion_response.h"
#include "rl/episode.h"
#include "rl/rollout_source.h"
#include "rl/scoring.h"
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

}  // namespace

struct Pipeline::Impl {
  PipelineOptions opt;
  const Dataset& data;
  const tok::Tokenizer& tokenizer;
  std::shared_ptr<const reward::RewardFunction> reward;
  EventSink sink;
  AdvantageMode adv_mode;

  mutable std::mutex mu;
  std::condition_variable cv_trainer, cv_score, cv_space;
  std::function<std::uint64_t()> event_offset;  // capture(): the event log's offset
  Cursor cursor;
  bool dispatch_done = false;  // data.epochs reached
  std::map<std::int64_t, VersionInfo> versions;
  std::int64_t current = 0;
  struct InFlight {
    PromptRef prompt;
    std::int64_t version = 0;
    std::shared_ptr<http::CancelSignal> cancel;
    bool stale = false;
    bool backoff = false;       // waiting to retry: no request out; the retry names the current version
    std::uint64_t ordinal = 0;  // dispatch order
  };
  std::map<std::uint64_t, InFlight> inflight;
  std::uint64_t next_id = 1, next_seq = 1, next_ordinal = 1;
  std::int64_t credit = 0;  // async.ordered: samples the trainer allows to dispatch
  std::int64_t inflight_seqs = 0;
  std::deque<Group> scoring;             // waiting for a worker
  std::map<std::uint64_t, Group> active;  // being scored
  std::map<std::pair<std::int64_t, std::uint64_t>, Group> queue;  // (sync index, seq)
  std::int64_t queued_samples = 0;
  std::map<std::string, std::int64_t> counters;
  WindowStats window;
  std::int64_t c = 0;  // samples trained since the last switch
  double last_success = now_s();
  std::optional<std::string> fatal;
  bool stopping = false;
  double admission_blocked_since = -1, score_blocked_since = -1;

  // Declared before the io_context: coroutine frames the context destroys may still hold the
  // source's objects (an episode's environment session).
  std::unique_ptr<RolloutSource> source;  // single turn, or episodes against an environment
  asio::io_context ctx;
  // The dispatcher's wait when nothing can be admitted, cancelled (no polling) by any change that may
  // admit a group; its 50 ms expiry only bounds a wake-up that a future change might forget.
  asio::steady_timer dispatch_timer{ctx};
  bool dispatch_wake = false;  // a wake-up is posted and the dispatcher has not looked since
  std::unique_ptr<http::Pool> pool;
  std::thread rollout_thread;
  std::vector<std::thread> workers;

  Impl(PipelineOptions o, const Dataset& d, const tok::Tokenizer& t, std::shared_ptr<const reward::RewardFunction> r,
       EventSink s)
      : opt(std::move(o)), data(d), tokenizer(t), reward(std::move(r)), sink(std::move(s)),
        adv_mode(parse_advantage_mode(opt.cfg.grpo.advantage)) {
    for (const char* k : {"rollout/retry_total", "rollout/failed_total", "rollout/cancelled_stale_total",
                          "rollout/abandoned_total", "rollout/reward_timeout_total", "rollout/invalid_response_total",
                          "rollout/reward_crashed_total", "rollout/reward_invalid_total", "rollout/reward_error_total",
                          "sample/dropped_stale_total"})
      counters[k] = 0;
    source = opt.cfg.env.command.empty() ? make_single_turn_source(opt.cfg)
                                         : make_episode_source(opt.cfg, tokenizer, opt.vocab, opt.stop_ids);
    for (const auto& k : source->counter_names()) counters[k] = 0;
  }

  std::int64_t G() const { return opt.cfg.grpo.num_generations; }

  void wake_dispatcher_locked() {
    if (dispatch_wake) return;
    dispatch_wake = true;
    asio::post(ctx, [this] { dispatch_timer.cancel(); });
  }

  // A group's request is over (answered, failed, cancelled or stopped): its slot frees admission.
  void end_inflight_locked(std::uint64_t id) {
    inflight_seqs -= G();
    inflight.erase(id);
    wake_dispatcher_locked();
  }

  std::int64_t staleness_locked(std::int64_t sync_index) const {
    auto it = versions.find(current);
    const std::int64_t kv = it == versions.end() ? 0 : it->second.sync_index;
    return kv - sync_index;
  }

  void emit(const GroupEvent& e) {
    if (sink) sink(e);
  }

  // A dropped, cancelled or failed prompt goes to the front of the dispatch order, or is abandoned.
  void requeue_locked(const PromptRef& p, const Group* g) {
    if (opt.cfg.async.ordered) credit += G();  // the step still needs these samples
    cv_trainer.notify_all();                   // an ordered pop may have waited on this group
    wake_dispatcher_locked();
    if (opt.cfg.async.requeue_dropped && p.attempt < opt.cfg.async.max_prompt_attempts) {
      cursor.redo.push_front({p.index, p.epoch, p.attempt + 1});
      return;
    }
    ++counters["rollout/abandoned_total"];
    GroupEvent e{"abandoned", p};
    if (g) e.version = g->version, e.sync_index = g->sync_index;
    emit(e);
  }

  std::optional<PromptRef> next_prompt_locked() {
    if (!cursor.redo.empty()) {
      PromptRef p = cursor.redo.front();
      cursor.redo.pop_front();
      return p;
    }
    if (dispatch_done) return std::nullopt;
    const auto n = static_cast<std::int64_t>(data.problems.size());
    if (cursor.position >= n) {
      if (opt.cfg.data.epochs > 0 && cursor.epoch + 1 >= opt.cfg.data.epochs) {
        dispatch_done = true;
        return std::nullopt;
      }
      ++cursor.epoch;
      cursor.position = 0;
      cursor.permutation = epoch_permutation(n, opt.cfg.seed, cursor.epoch, opt.cfg.data.shuffle);
    }
    const std::int64_t pos = cursor.permutation[static_cast<std::size_t>(cursor.position++)];
    return PromptRef{data.problems[static_cast<std::size_t>(pos)].index, cursor.epoch, 1};
  }

  std::int64_t scoring_samples_locked() const {
    return static_cast<std::int64_t>(scoring.size() + active.size()) * G();
  }

  // Admission (trainer.md §1.6); accounts blocked time per reason.
  std::optional<std::pair<std::uint64_t, InFlight>> try_admit_locked() {
    const double t = now_s();
    auto block = [&](double& since, double& sum, bool blocked) {
      if (blocked && since < 0) since = t;
      if (!blocked && since >= 0) sum += t - since, since = -1;
    };
    if (stopping || fatal || current == 0) return std::nullopt;
    if (inflight_seqs + G() > opt.cfg.async.max_inflight) return std::nullopt;
    if (opt.cfg.async.ordered && credit < G()) return std::nullopt;
    const bool score_full = static_cast<std::int64_t>(scoring.size()) >= opt.cfg.async.score_queue_groups;
    block(score_blocked_since, window.score_block_s, score_full);
    if (score_full) return std::nullopt;
    const std::int64_t S = opt.cfg.sync.weight_sync_steps * opt.cfg.batching.samples_per_step;
    const std::int64_t ahead = queued_samples + scoring_samples_locked() + inflight_seqs;
    const bool budget = c + ahead + G() > std::max<std::int64_t>(opt.cfg.async.max_staleness, 1) * S;
    block(admission_blocked_since, window.admission_block_s, budget);
    if (budget) return std::nullopt;
    auto p = next_prompt_locked();
    if (!p) return std::nullopt;
    InFlight f{*p, current, std::make_shared<http::CancelSignal>(), false, false, next_ordinal++};
    if (opt.cfg.async.ordered) credit -= G();
    const std::uint64_t id = next_id++;
    inflight.emplace(id, f);
    inflight_seqs += G();
    return std::make_pair(id, f);
  }

  const Problem& problem(std::int64_t index) const {
    const Problem* p = find_problem(data, index);
    LS_CHECK(p, "unknown prompt index");
    return *p;
  }

  std::string request_body(const PromptRef& p, const TurnRequest& t, const std::string& model_name) const {
    const auto& g = opt.cfg.generation;
    json j;
    j["model"] = model_name;
    j["prompt"] = t.prompt;
    j["n"] = t.n;
    j["max_tokens"] = t.max_tokens;
    j["temperature"] = g.temperature;
    j["top_p"] = 1.0;
    j["logprobs"] = 0;
    j["return_token_ids"] = true;
    j["stop_token_ids"] = opt.stop_ids;
    if (g.seed_requests) {
      std::uint64_t h = splitmix64(static_cast<std::uint64_t>(opt.cfg.seed));
      h = splitmix64(h ^ static_cast<std::uint64_t>(p.epoch));
      h = splitmix64(h ^ static_cast<std::uint64_t>(p.index));
      h = splitmix64(h ^ static_cast<std::uint64_t>(p.attempt));
      if (t.seed_salt != 0) h = splitmix64(h ^ t.seed_salt);
      j["seed"] = static_cast<std::int64_t>(h & 0x7fffffffu);
    }
    return j.dump();
  }

  std::optional<std::string> parse_response(const std::string& body, TurnAnswer& g, std::int64_t n, std::int64_t max_tokens) const {
    return parse_completion_response(body, n, max_tokens, opt.vocab, opt.prefix, [this](std::int64_t v) -> std::optional<VersionInfo> {
      std::lock_guard lk(mu);
      auto it = versions.find(v);
      if (it == versions.end()) return std::nullopt;
      return it->second;
    }, g);
  }

  // One completion call of a rollout, with the retries of trainer.md §1.5: kOk with the answer,
  // kCancelled (a switch made it stale), kFailed (every retry failed), kStopped (stop or a fatal
  // error). Each call names the then-current version; only the rollout's first call sets the
  // version the in-flight entry is judged by.
  asio::awaitable<TurnAnswer> complete(std::uint64_t id, const InFlight& f, TurnRequest t) {
    const auto& a = opt.cfg.async;
    std::int64_t retries = 0;
    asio::steady_timer timer(ctx);
    std::mt19937_64 jitter(splitmix64(id ^ t.seed_salt));
    http::Headers headers;
    headers.add("Content-Type", "application/json");
    if (!opt.api_key.empty()) headers.add("Authorization", "Bearer " + opt.api_key);
    TurnAnswer out;
    for (;;) {
      std::string model_name, body;
      {
        std::lock_guard lk(mu);
        if (stopping || fatal) break;  // no retry once the run ends
        auto it = inflight.find(id);
        if (t.first) it->second.version = current;  // a retry names the then-current version
        it->second.backoff = false;
        model_name = versions.at(current).name;
      }
      body = request_body(f.prompt, t, model_name);
      http::OutRequest req{"POST", "/v1/completions", &headers, body};
      http::CallOptions co;
      co.first_byte_timeout_s = opt.cfg.generation.request_timeout_s;
      co.total_timeout_s = opt.cfg.generation.request_timeout_s;
      co.cancel = f.cancel.get();
      const double t0 = now_s();
      http::Pool::Full r = co_await pool->fetch(req, co, 64u << 20);
      const double dt = now_s() - t0;
      std::string why;
      if (r.error == http::CallError::kCancelled) {
        std::lock_guard lk(mu);
        auto it = inflight.find(id);
        const bool stale = it != inflight.end() && it->second.stale;
        out.kind = stale && !stopping ? RolloutKind::kCancelled : RolloutKind::kStopped;
        co_return out;
      } else if (r.error != http::CallError::kNone) {
        why = std::string("transport: ") + r.message;
      } else if (r.status == 429 || r.status >= 500) {
        why = "HTTP " + std::to_string(r.status) + ": " + r.body.substr(0, 300);
      } else if (r.status == 404) {
        std::lock_guard lk(mu);
        const auto it = inflight.find(id);
        if (versions.count(it->second.version)) {
          // a replica lost its adapters; the proxy re-syncs it: retried
          why = "HTTP 404 for a loaded version: " + r.body.substr(0, 300);
        } else {
          fatal = "server answered 404 for version " + std::to_string(it->second.version) + " that was already unloaded: " + r.body.substr(0, 300);
        }
      } else if (r.status != 200) {
        std::lock_guard lk(mu);
        if (!fatal) fatal = "the server refused a rollout request (HTTP " + std::to_string(r.status) + "): " + r.body.substr(0, 500) +
                            " (check generation.* and the server's flags)";
      } else if (auto bad = parse_response(r.body, out, t.n, t.max_tokens)) {
        why = "invalid response: " + *bad;
        std::lock_guard lk(mu);
        ++counters["rollout/invalid_response_total"];
      } else {
        std::lock_guard lk(mu);
        last_success = now_s();
        window.request_s_sum += dt;
        ++window.requests;
        for (const auto& m : out.members) window.generated_tokens += static_cast<std::int64_t>(m.ids.size());
        out.request_s = dt;
        out.kind = RolloutKind::kOk;
        co_return out;
      }
      {
        std::lock_guard lk(mu);
        if (fatal) break;  // the run ends: the prompt stays owed (below), like a stop's
        if (++retries > a.max_retries) {
          LS_LOG_WARN("trainer", "rollout of prompt {} failed after {} retries: {}", f.prompt.index, a.max_retries, why);
          out.kind = RolloutKind::kFailed;
          out.why = why;
          co_return out;
        }
        ++counters["rollout/retry_total"];
        inflight[id].backoff = true;  // a switch meanwhile does not cancel it (nothing to cancel)
      }
      LS_LOG_DEBUG("trainer", "retrying prompt {} ({}): {}", f.prompt.index, retries, why);
      double backoff = std::min(a.retry_backoff_s * std::pow(2.0, static_cast<double>(retries - 1)), a.retry_backoff_max_s);
      backoff *= std::uniform_real_distribution<double>(0.75, 1.25)(jitter);
      timer.expires_after(std::chrono::microseconds(static_cast<std::int64_t>(backoff * 1e6)));
      boost::system::error_code ec;
      co_await timer.async_wait(asio::redirect_error(asio::use_awaitable, ec));
    }
    out.kind = RolloutKind::kStopped;
    co_return out;
  }

  asio::awaitable<void> run_group(std::uint64_t id, InFlight f) {
    CompleteFn call = [this, id, f](TurnRequest t) { return complete(id, f, std::move(t)); };
    RolloutOutcome o = co_await source->rollout(f.prompt, problem(f.prompt.index), call);
    std::lock_guard lk(mu);
    for (const auto& [k, v] : o.counters) counters[k] += v;
    auto it = inflight.find(id);
    if (o.kind == RolloutKind::kOk && it != inflight.end()) {
      Group& g = o.group;
      last_success = now_s();
      g.prompt = f.prompt;
      g.ordinal = f.ordinal;
      end_inflight_locked(id);
      scoring.push_back(std::move(g));
      cv_score.notify_one();
      co_return;
    }
    if (o.kind == RolloutKind::kCancelled && it != inflight.end() && !stopping) {
      const std::int64_t v = it->second.version;
      const std::int64_t k = versions.count(v) ? versions[v].sync_index : 0;
      ++counters["rollout/cancelled_stale_total"];
      emit({"cancelled", f.prompt, v, k, staleness_locked(k), 0, 0});
      requeue_locked(f.prompt, nullptr);
      end_inflight_locked(id);
      cv_trainer.notify_all();
      co_return;
    }
    if (o.kind == RolloutKind::kFailed && it != inflight.end() && !stopping && !fatal) {
      ++counters["rollout/failed_total"];
      emit({"failed", f.prompt, it->second.version, 0, 0, 0, 0});
      requeue_locked(f.prompt, nullptr);
      end_inflight_locked(id);
      cv_trainer.notify_all();
      co_return;
    }
    // Stopping, or a fatal error (this group's or another's) that ends the run: the request gave
    // nothing, so the prompt returns to the front of the dispatch order with the same attempt and
    // the checkpoint written on the way out owes it (trainer.md "exactly once").
    if (it != inflight.end()) {
      cursor.redo.push_front(f.prompt);
      end_inflight_locked(id);
    }
    cv_trainer.notify_all();
  }

  asio::awaitable<void> dispatcher() {
    for (;;) {
      std::optional<std::pair<std::uint64_t, InFlight>> d;
      {
        std::lock_guard lk(mu);
        if (stopping) co_return;
        // Every change made before this point is seen by the admission below; one made after it
        // posts a cancel, which can only run once this coroutine waits (one rollout thread).
        dispatch_wake = false;
        d = try_admit_locked();
      }
      if (d) {
        asio::co_spawn(ctx, run_group(d->first, d->second), asio::detached);
        continue;
      }
      dispatch_timer.expires_after(std::chrono::milliseconds(50));
      boost::system::error_code ec;
      co_await dispatch_timer.async_wait(asio::redirect_error(asio::use_awaitable, ec));
    }
  }

  void score_worker() {
    for (;;) {
      Group g;
      std::uint64_t key = 0;
      {
        std::unique_lock lk(mu);
        cv_score.wait(lk, [&] { return stopping || !scoring.empty(); });
        if (stopping) return;
        g = std::move(scoring.front());
        scoring.pop_front();
        wake_dispatcher_locked();  // the scoring queue has room again
        key = next_seq++;
        active.emplace(key, g);  // kept for a checkpoint taken meanwhile (stored unscored)
      }
      const double t0 = now_s();
      const ScoringRules rules{opt.cfg.grpo.truncated_reward, opt.cfg.grpo.reward_timeout_s, opt.cfg.grpo.reward_on_timeout,
                         &opt.stop_ids};
      // An episode's rewards came from its environment (Group::prescored).
      const ScoringCounts failed = g.prescored ? ScoringCounts{} : score_members(g.members, problem(g.prompt.index), *reward, tokenizer, rules);
      std::vector<double> rewards;
      for (const auto& m : g.members) rewards.push_back(m.reward);
      auto adv = group_advantages(rewards, adv_mode);
      std::unique_lock lk(mu);
      counters["rollout/reward_timeout_total"] += failed.timeouts;
      counters["rollout/reward_crashed_total"] += failed.crashed;
      counters["rollout/reward_invalid_total"] += failed.invalid;
      counters["rollout/reward_error_total"] += failed.errors;
      if (stopping) {  // shutting down: the rewards were abandoned; keep the group unscored
        active.erase(key);
        if (!g.prescored)  // an environment's rewards are kept: the episode cannot be replayed
          for (auto& m : g.members) m.reward = std::numeric_limits<double>::quiet_NaN();
        scoring.push_front(std::move(g));
        return;
      }
      g.score_s = now_s() - t0;
      window.score_s_sum += g.score_s;
      ++window.scored_groups;
      if (!adv) {
        active.erase(key);
        emit({"failed", g.prompt, g.version, g.sync_index, staleness_locked(g.sync_index), g.tokens(), g.mean_reward()});
        ++counters["rollout/failed_total"];
        requeue_locked(g.prompt, &g);
        continue;
      }
      for (std::size_t i = 0; i < g.members.size(); ++i) g.members[i].advantage = adv->advantages[i];
      g.scored = true;
      const double w0 = now_s();
      cv_space.wait(lk, [&] { return stopping || queued_samples + G() <= opt.cfg.async.queue_maxsize || queue.empty(); });
      window.backpressure_s += now_s() - w0;
      active.erase(key);
      if (stopping) {
        scoring.push_front(std::move(g));  // captured as a scored group by a final checkpoint
        return;
      }
      push_queue_locked(std::move(g));
    }
  }

  void push_queue_locked(Group g) {
    g.seq = opt.cfg.async.ordered ? g.ordinal : next_seq++;
    g.enqueued_at = now_s();
    queued_samples += static_cast<std::int64_t>(g.members.size());
    queue.emplace(std::make_pair(g.sync_index, g.seq), std::move(g));
    cv_trainer.notify_all();
  }

  // async.ordered: the next group may leave the queue only when no group dispatched before it is
  // still on its way (in flight or scoring).
  bool next_in_order_locked() const {
    if (queue.empty()) return false;
    if (!opt.cfg.async.ordered) return true;
    const std::uint64_t head = queue.begin()->second.ordinal;
    for (const auto& [id, f] : inflight)
      if (f.ordinal < head) return false;
    for (const auto& g : scoring)
      if (g.ordinal < head) return false;
    for (const auto& [k, g] : active)
      if (g.ordinal < head) return false;
    return true;
  }

  bool exhausted_locked() const {
    return dispatch_done && cursor.redo.empty() && inflight.empty() && scoring.empty() && active.empty() && queue.empty();
  }
};

Pipeline::Pipeline(PipelineOptions opt, const Dataset& data, const tok::Tokenizer& tokenizer,
                   std::shared_ptr<const reward::RewardFunction> reward, EventSink sink)
    : impl_(std::make_unique<Impl>(std::move(opt), data, tokenizer, std::move(reward), std::move(sink))) {
  std::string err;
  auto url = http::Url::parse(impl_->opt.server_url, err);
  if (!url) throw_invalid("generation.server_url '{}': {}", impl_->opt.server_url, err);
  http::ClientOptions co;
  co.max_connections = static_cast<std::size_t>(std::max<std::int64_t>(1, impl_->opt.cfg.async.max_inflight));
  impl_->pool = std::make_unique<http::Pool>(*url, co);
}

Pipeline::~Pipeline() { stop(); }

void Pipeline::init_fresh() {
  std::lock_guard lk(impl_->mu);
  impl_->cursor = Cursor{};
  impl_->cursor.permutation = epoch_permutation(static_cast<std::int64_t>(impl_->data.problems.size()), impl_->opt.cfg.seed, 0,
                                                impl_->opt.cfg.data.shuffle);
}

void Pipeline::restore(PipelineState st) {
  std::lock_guard lk(impl_->mu);
  auto& I = *impl_;
  I.cursor = std::move(st.cursor);
  if (I.cursor.permutation.empty())
    I.cursor.permutation = epoch_permutation(static_cast<std::int64_t>(I.data.problems.size()), I.opt.cfg.seed, I.cursor.epoch,
                                             I.opt.cfg.data.shuffle);
  for (auto& [k, v] : st.counters) I.counters[k] = v;
  for (const auto& v : st.versions) I.versions[v.version] = v;
  I.current = st.current;
  I.c = st.samples_since_switch;
  for (auto& g : st.groups) {
    g.ordinal = I.next_ordinal++;  // before anything dispatched by this process
    if (g.scored) I.push_queue_locked(std::move(g));
    else I.scoring.push_back(std::move(g));  // re-scored
  }
}

void Pipeline::start() {
  auto& I = *impl_;
  I.rollout_thread = std::thread([&I] {
    asio::co_spawn(I.ctx, I.dispatcher(), asio::detached);
    auto guard = asio::make_work_guard(I.ctx);
    I.ctx.run();
  });
  for (std::int64_t i = 0; i < std::max<std::int64_t>(1, I.opt.cfg.async.score_workers); ++i)
    I.workers.emplace_back([&I] { I.score_worker(); });
}

void Pipeline::stop() {
  auto& I = *impl_;
  {
    std::lock_guard lk(I.mu);
    if (I.stopping && !I.rollout_thread.joinable()) return;
    I.stopping = true;
    I.wake_dispatcher_locked();  // it returns
    for (auto& [id, f] : I.inflight) {
      auto sig = f.cancel;
      asio::post(I.ctx, [sig] { sig->fire(); });
    }
  }
  I.reward->shutdown();  // external rewards: kill or abandon calls in progress, never wait on them
  I.source->shutdown();  // environments: the same
  I.cv_score.notify_all();
  I.cv_space.notify_all();
  I.cv_trainer.notify_all();
  for (auto& w : I.workers)
    if (w.joinable()) w.join();
  I.workers.clear();
  if (I.rollout_thread.joinable()) {
    // Let the aborted requests unwind (they return their prompts to the redo list), then stop.
    for (int i = 0; i < 500; ++i) {
      {
        std::lock_guard lk(I.mu);
        if (I.inflight.empty()) break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    asio::post(I.ctx, [&I] { I.pool.reset(); });
    I.ctx.stop();
    I.rollout_thread.join();
    I.source->join();  // its threads post into the context no more
    I.pool.reset();
    std::lock_guard lk(I.mu);
    for (auto& [id, f] : I.inflight) I.cursor.redo.push_front(f.prompt);  // never started unwinding
    I.inflight.clear();
    I.inflight_seqs = 0;
  }
}

std::optional<Group> Pipeline::pop(double timeout_s) {
  auto& I = *impl_;
  std::unique_lock lk(I.mu);
  I.cv_trainer.wait_for(lk, std::chrono::duration<double>(timeout_s),
                        [&] { return I.next_in_order_locked() || I.fatal || I.exhausted_locked() || I.stopping; });
  if (!I.next_in_order_locked()) return std::nullopt;
  auto it = I.queue.begin();
  Group g = std::move(it->second);
  I.queue.erase(it);
  I.queued_samples -= static_cast<std::int64_t>(g.members.size());
  I.cv_space.notify_all();
  I.wake_dispatcher_locked();
  return g;
}

void Pipeline::grant(std::int64_t samples) {
  auto& I = *impl_;
  std::lock_guard lk(I.mu);
  if (!I.opt.cfg.async.ordered) return;
  const std::int64_t ahead = I.queued_samples + I.scoring_samples_locked() + I.inflight_seqs;
  I.credit = std::max<std::int64_t>(0, samples - ahead);
  I.wake_dispatcher_locked();
}

void Pipeline::unpop(std::vector<Group> groups) {
  std::lock_guard lk(impl_->mu);
  for (auto& g : groups) {
    impl_->queued_samples += static_cast<std::int64_t>(g.members.size());
    impl_->queue.emplace(std::make_pair(g.sync_index, g.seq), std::move(g));
  }
}

void Pipeline::drop_stale(const Group& g, std::int64_t staleness) {
  auto& I = *impl_;
  std::lock_guard lk(I.mu);
  I.counters["sample/dropped_stale_total"] += static_cast<std::int64_t>(g.members.size());
  I.emit({"dropped_stale", g.prompt, g.version, g.sync_index, staleness, g.tokens(), g.mean_reward()});
  I.requeue_locked(g.prompt, &g);
}

void Pipeline::record_trained(const std::vector<Group>& groups) {
  auto& I = *impl_;
  std::lock_guard lk(I.mu);
  for (const auto& g : groups) {
    I.c += static_cast<std::int64_t>(g.members.size());
    I.emit({"trained", g.prompt, g.version, g.sync_index, g.staleness, g.tokens(), g.mean_reward()});
  }
}

std::int64_t Pipeline::staleness_of(const Group& g) const {
  std::lock_guard lk(impl_->mu);
  return impl_->staleness_locked(g.sync_index);
}

bool Pipeline::exhausted() const {
  std::lock_guard lk(impl_->mu);
  return impl_->exhausted_locked();
}

void Pipeline::add_version(const VersionInfo& v) {
  std::lock_guard lk(impl_->mu);
  impl_->versions[v.version] = v;
}

void Pipeline::switch_to(std::int64_t version) {
  auto& I = *impl_;
  std::lock_guard lk(I.mu);
  LS_CHECK(I.versions.count(version), "switch to an unknown version");
  I.current = version;
  I.c = 0;
  const std::int64_t bound = I.opt.cfg.async.max_staleness;
  for (auto& [id, f] : I.inflight) {
    auto it = I.versions.find(f.version);
    const std::int64_t k = it == I.versions.end() ? 0 : it->second.sync_index;
    if (!f.stale && !f.backoff && I.staleness_locked(k) > bound) {
      f.stale = true;
      auto sig = f.cancel;
      asio::post(I.ctx, [sig] { sig->fire(); });
    }
  }
  for (auto it = I.queue.begin(); it != I.queue.end();) {
    const std::int64_t s = I.staleness_locked(it->second.sync_index);
    if (s > bound) {
      const Group& g = it->second;
      I.counters["sample/dropped_stale_total"] += static_cast<std::int64_t>(g.members.size());
      I.emit({"dropped_stale", g.prompt, g.version, g.sync_index, s, g.tokens(), g.mean_reward()});
      I.requeue_locked(g.prompt, &g);
      I.queued_samples -= static_cast<std::int64_t>(g.members.size());
      it = I.queue.erase(it);
    } else {
      ++it;
    }
  }
  I.cv_space.notify_all();
  I.wake_dispatcher_locked();  // c = 0: the admission budget is whole again
}

bool Pipeline::in_flight_uses(std::int64_t version) const {
  std::lock_guard lk(impl_->mu);
  for (const auto& [id, f] : impl_->inflight)
    if (f.version == version) return true;
  return false;
}

void Pipeline::retire_version(std::int64_t version) {
  std::lock_guard lk(impl_->mu);
  if (version != impl_->current) impl_->versions.erase(version);
}

std::optional<VersionInfo> Pipeline::version(std::int64_t v) const {
  std::lock_guard lk(impl_->mu);
  auto it = impl_->versions.find(v);
  if (it == impl_->versions.end()) return std::nullopt;
  return it->second;
}

std::optional<VersionInfo> Pipeline::current() const {
  std::lock_guard lk(impl_->mu);
  auto it = impl_->versions.find(impl_->current);
  if (it == impl_->versions.end()) return std::nullopt;
  return it->second;
}

void Pipeline::set_event_offset(std::function<std::uint64_t()> f) {
  std::lock_guard lk(impl_->mu);
  impl_->event_offset = std::move(f);
}

PipelineState Pipeline::capture() const {
  auto& I = *impl_;
  std::lock_guard lk(I.mu);
  PipelineState st;
  if (I.event_offset) st.events_offset = I.event_offset();
  st.cursor = I.cursor;
  std::deque<PromptRef> redo;
  for (const auto& [id, f] : I.inflight) redo.push_back(f.prompt);  // dispatch order (ids ascend)
  for (const auto& p : I.cursor.redo) redo.push_back(p);
  st.cursor.redo = std::move(redo);
  for (const auto& [k, g] : I.queue) st.groups.push_back(g);
  for (const auto& g : I.scoring) st.groups.push_back(g);
  for (const auto& [k, g] : I.active) {
    Group u = g;
    u.scored = false;
    st.groups.push_back(std::move(u));
  }
  st.counters = I.counters;
  for (const auto& [v, info] : I.versions) st.versions.push_back(info);
  st.current = I.current;
  st.samples_since_switch = I.c;
  return st;
}

std::int64_t Pipeline::queue_samples() const {
  std::lock_guard lk(impl_->mu);
  return impl_->queued_samples;
}

std::int64_t Pipeline::inflight_sequences() const {
  std::lock_guard lk(impl_->mu);
  return impl_->inflight_seqs;
}

std::map<std::string, std::int64_t> Pipeline::counters() const {
  std::lock_guard lk(impl_->mu);
  return impl_->counters;
}

void Pipeline::add_counter(const std::string& name, std::int64_t delta) {
  std::lock_guard lk(impl_->mu);
  impl_->counters[name] += delta;
}

WindowStats Pipeline::take_window() {
  std::lock_guard lk(impl_->mu);
  auto& I = *impl_;
  const double t = now_s();
  if (I.admission_blocked_since >= 0) I.window.admission_block_s += t - I.admission_blocked_since, I.admission_blocked_since = t;
  if (I.score_blocked_since >= 0) I.window.score_block_s += t - I.score_blocked_since, I.score_blocked_since = t;
  WindowStats w = I.window;
  I.window = WindowStats{};
  return w;
}

double Pipeline::seconds_since_success() const {
  std::lock_guard lk(impl_->mu);
  return now_s() - impl_->last_success;
}

std::optional<std::string> Pipeline::fatal() const {
  std::lock_guard lk(impl_->mu);
  return impl_->fatal;
}

double Pipeline::dispatched_fraction() const {
  std::lock_guard lk(impl_->mu);
  const auto n = static_cast<double>(std::max<std::size_t>(1, impl_->data.problems.size()));
  return static_cast<double>(impl_->cursor.epoch) + static_cast<double>(impl_->cursor.position) / n;
}

}  // namespace lorasync::rl
