// HTTP rewards (contracts in external_reward.h): POST the completion's JSON, read {"reward": x}.
// Each call runs on its own short-lived thread with its own connection, so that the caller can
// abandon it at the deadline or on shutdown without waiting; the abandoned request still ends by
// the client's own timeout.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>

#include "http/blocking_client.h"
#include "rl/external_reward.h"
#include "util/error.h"

namespace lorasync::rl {

using reward::RewardCallFailed;
using reward::RewardFailure;
using reward::RewardFunction;
using reward::RewardInput;
using reward::RewardOutput;

namespace {

using Clock = std::chrono::steady_clock;

struct Call {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  http::Pool::Full result;
};

class HttpReward final : public RewardFunction {
 public:
  explicit HttpReward(ExternalRewardOptions o) : opt_(std::move(o)) {
    const auto scheme = opt_.url.find("://");
    const auto slash = scheme == std::string::npos ? std::string::npos : opt_.url.find('/', scheme + 3);
    base_ = slash == std::string::npos ? opt_.url : opt_.url.substr(0, slash);
    target_ = slash == std::string::npos ? "/" : opt_.url.substr(slash);
    if (!opt_.bearer_token_env.empty()) {
      const char* t = std::getenv(opt_.bearer_token_env.c_str());
      if (t == nullptr || *t == '\0')
        throw_invalid("rewards.{}.bearer_token_env: the environment variable {} is not set", opt_.name, opt_.bearer_token_env);
      token_ = t;
    }
    http::BlockingClient probe(base_, token_);  // InvalidInput naming the URL when it does not parse
  }

  std::string name() const override { return opt_.name; }
  bool parallel_members() const override { return true; }

  void shutdown() const override {
    std::lock_guard lk(mu_);
    closing_ = true;
    cv_.notify_all();
  }

  RewardOutput score(const RewardInput& in) const override {
    const std::string who = "reward " + opt_.name;
    {
      std::unique_lock lk(mu_);
      cv_.wait(lk, [&] { return closing_ || running_ < opt_.workers; });
      if (closing_) throw RewardCallFailed(RewardFailure::kUnavailable, who + ": shutting down");
      ++running_;
    }
    struct Slot {
      const HttpReward* self;
      ~Slot() {
        std::lock_guard lk(self->mu_);
        --self->running_;
        self->cv_.notify_all();
      }
    } slot{this};
    auto call = std::make_shared<Call>();
    std::thread([call, base = base_, target = target_, token = token_, body = reward_request_json(in), t = opt_.timeout_s] {
      http::Pool::Full r;
      try {
        http::BlockingClient client(base, token);
        r = client.request("POST", target, body, t);
      } catch (const std::exception& e) {
        r.status = 0;
        r.message = e.what();
      }
      std::lock_guard lk(call->mu);
      call->result = std::move(r);
      call->done = true;
      call->cv.notify_all();
    }).detach();
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(opt_.timeout_s));
    std::unique_lock lk(call->mu);
    while (!call->done) {
      if (closing_.load()) throw RewardCallFailed(RewardFailure::kUnavailable, who + ": shutting down (request abandoned)");
      if (Clock::now() >= deadline)
        throw RewardCallFailed(RewardFailure::kTimeout, who + ": no answer from " + opt_.url + " within " +
                                                            fmt::format("{:g}", opt_.timeout_s) + " s (request abandoned)");
      call->cv.wait_for(lk, std::chrono::milliseconds(50));
    }
    const http::Pool::Full& r = call->result;
    if (r.status == 0) {
      const bool timed_out = r.error == http::CallError::kFirstByteTimeout || r.error == http::CallError::kTotalTimeout ||
                             r.error == http::CallError::kIdleTimeout || r.error == http::CallError::kConnectTimeout;
      throw RewardCallFailed(timed_out ? RewardFailure::kTimeout : RewardFailure::kCrashed,
                             who + ": request to " + opt_.url + " failed: " + r.message);
    }
    if (r.status >= 500) throw RewardCallFailed(RewardFailure::kCrashed, who + ": " + opt_.url + " answered HTTP " + std::to_string(r.status));
    if (r.status != 200)
      throw RewardCallFailed(RewardFailure::kInvalidOutput, who + ": " + opt_.url + " answered HTTP " + std::to_string(r.status));
    RewardOutput out;
    out.reward = parse_reward_answer(r.body, who);
    out.reason = "external";
    out.components.push_back({opt_.name, out.reward, 1});
    return out;
  }

 private:
  ExternalRewardOptions opt_;
  std::string base_, target_, token_;
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  mutable std::int64_t running_ = 0;
  mutable std::atomic<bool> closing_{false};
};

}  // namespace

std::shared_ptr<const RewardFunction> make_http_reward(const ExternalRewardOptions& o) {
  if (o.url.rfind("http://", 0) != 0 && o.url.rfind("https://", 0) != 0)
    throw_invalid("rewards.{}.url must be an http:// or https:// URL, got \"{}\"", o.name, o.url);
  return std::make_shared<HttpReward>(o);
}

}  // namespace lorasync::rl
