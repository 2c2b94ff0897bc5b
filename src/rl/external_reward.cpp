// Command rewards: a pool of sandboxed worker processes speaking JSON lines (contracts in
// external_reward.h). HTTP rewards are in external_reward_http.cpp.
#include "rl/external_reward.h"

#include <nlohmann/json.hpp>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <mutex>

#include "rl/sandbox_worker.h"
#include "util/error.h"
#include "util/log.h"

namespace lorasync::rl {

using reward::RewardCallFailed;
using reward::RewardFailure;
using reward::RewardFunction;
using reward::RewardInput;
using reward::RewardOutput;

namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

class CommandReward final : public RewardFunction {
 public:
  explicit CommandReward(ExternalRewardOptions o)
      : opt_(std::move(o)),
        sandbox_(sandbox_options("reward " + opt_.name, opt_.command, opt_.workdir, opt_.cpu_s, opt_.memory_mb, opt_.max_output_bytes,
                                 opt_.network)),
        workers_(static_cast<std::size_t>(opt_.workers)) {}
  ~CommandReward() override {
    std::lock_guard lk(mu_);
    for (auto& w : workers_) w.proc.kill();
  }

  std::string name() const override { return opt_.name; }
  bool parallel_members() const override { return true; }

  void shutdown() const override {
    std::lock_guard lk(mu_);
    closing_ = true;
    // Running calls notice within one poll slice and kill their own worker; idle ones go now.
    for (auto& w : workers_)
      if (!w.busy) w.proc.kill();
    cv_.notify_all();
  }

  RewardOutput score(const RewardInput& in) const override {
    const std::string line = reward_request_json(in) + "\n";
    Worker* w = acquire();
    struct Release {
      const CommandReward* self;
      Worker* w;
      ~Release() {
        std::lock_guard lk(self->mu_);
        w->busy = false;
        if (self->closing_) w->proc.kill();
        self->cv_.notify_one();
      }
    } release{this, w};
    const bool fresh = !w->proc.running();
    const double allowed = opt_.timeout_s + (fresh ? opt_.startup_s : 0.0);
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(allowed));
    if (fresh) w->proc.start(sandbox_);
    w->proc.send_line(line, deadline, opt_.timeout_s, &closing_);
    std::string answer = w->proc.read_line(deadline, opt_.timeout_s, &closing_);
    RewardOutput out;
    out.reward = parse_reward_answer(answer, "reward " + opt_.name);
    out.reason = "external";
    out.components.push_back({opt_.name, out.reward, 1});
    return out;
  }

 private:
  struct Worker {
    SandboxWorker proc;
    bool busy = false;
  };

  Worker* acquire() const {
    std::unique_lock lk(mu_);
    for (;;) {
      if (closing_) throw RewardCallFailed(RewardFailure::kUnavailable, "reward " + opt_.name + ": shutting down");
      for (auto& w : workers_)
        if (!w.busy) {
          w.busy = true;
          return &w;
        }
      cv_.wait(lk);
    }
  }

  ExternalRewardOptions opt_;
  SandboxOptions sandbox_;
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  mutable std::vector<Worker> workers_;
  mutable std::atomic<bool> closing_{false};
};

}  // namespace

std::string reward_request_json(const RewardInput& in) {
  json j = {{"prompt", std::string(in.prompt)},
            {"completion", std::string(in.completion)},
            {"completion_ids", std::vector<std::int32_t>(in.completion_ids.begin(), in.completion_ids.end())},
            {"finish_reason", std::string(in.finish_reason)},
            {"references", in.references}};
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

double parse_reward_answer(const std::string& text, const std::string& who) {
  auto invalid = [&](const std::string& why) -> double {
    std::string shown = text.size() > 200 ? text.substr(0, 200) + "..." : text;
    throw RewardCallFailed(RewardFailure::kInvalidOutput, who + ": " + why + " (answer: " + json(shown).dump(-1, ' ', false, json::error_handler_t::replace) + ")");
  };
  json j = json::parse(text, nullptr, false);
  if (j.is_discarded()) return invalid("the answer is not JSON");
  const json* v = &j;
  if (j.is_object()) {
    auto it = j.find("reward");
    if (it == j.end()) return invalid("the answer has no \"reward\"");
    v = &*it;
  }
  if (!v->is_number()) return invalid("the reward is not a number");
  const double r = v->get<double>();
  if (!std::isfinite(r) || r < 0 || r > 1) return invalid("the reward must be a finite number in [0, 1]");
  return r;
}

std::shared_ptr<const RewardFunction> make_http_reward(const ExternalRewardOptions& o);  // external_reward_http.cpp

std::shared_ptr<const RewardFunction> make_external_reward(const ExternalRewardOptions& o) {
  const std::string where = "rewards." + o.name;
  if (o.workers < 1) throw_invalid("{}.workers must be at least 1, got {}", where, o.workers);
  if (!(o.timeout_s > 0) || !std::isfinite(o.timeout_s)) throw_invalid("{}.timeout_s must be positive, got {}", where, o.timeout_s);
  if (o.max_output_bytes < 16) throw_invalid("{}.max_output_bytes must be at least 16, got {}", where, o.max_output_bytes);
  if (o.kind == "command") {
    if (o.command.empty() || o.command[0].empty()) throw_invalid("{}.command must name a program (a list: [\"python3\", \"score.py\"])", where);
    if (!(o.cpu_s > 0)) throw_invalid("{}.cpu_s must be positive, got {}", where, o.cpu_s);
    if (o.memory_mb < 16) throw_invalid("{}.memory_mb must be at least 16, got {}", where, o.memory_mb);
    if (!(o.startup_s >= 0)) throw_invalid("{}.startup_s must be >= 0, got {}", where, o.startup_s);
    return std::make_shared<CommandReward>(o);
  }
  if (o.kind == "http") return make_http_reward(o);
  throw_invalid("{}.kind must be \"command\" or \"http\", got \"{}\"", where, o.kind);
}

}  // namespace lorasync::rl
