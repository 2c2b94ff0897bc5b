// proxy/fleet_parts.h: helpers shared by the fleet operations (fleet.cpp, push.cpp). Not a
// public header.
#pragma once

#include <utility>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "proxy/proxy_impl.h"

namespace lorasync::proxy::fleet {

inline double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

inline bool contains(std::string_view hay, std::string_view needle) { return hay.find(needle) != std::string_view::npos; }

inline nlohmann::json target_json(const TargetResult& t, const std::string& url) {
  nlohmann::json j = {{"index", t.index}, {"url", url}, {"outcome", t.outcome},
                      {"status", t.status ? nlohmann::json(*t.status) : nlohmann::json(nullptr)},
                      {"attempts", t.attempts}, {"ms", static_cast<std::int64_t>(t.ms)}};
  if (t.outcome != "ok" && t.outcome != "skipped") j["body"] = t.body;
  if (!t.rollback.empty()) j["rollback"] = t.rollback;
  return j;
}

// Runs fn(i) for each i concurrently on the current executor (the caller's strand); returns when
// all have ended. The last one to end wakes the caller (no polling).
template <typename F>
http::Task<void> for_all(const std::vector<int>& idx, F fn) {
  if (idx.empty()) co_return;
  auto ex = co_await boost::asio::this_coro::executor;
  struct State {
    std::atomic<int> left;
    boost::asio::steady_timer timer;
    State(int n, boost::asio::any_io_executor e) : left(n), timer(std::move(e)) {}
  };
  auto st = std::make_shared<State>(static_cast<int>(idx.size()), ex);
  for (int i : idx)
    boost::asio::co_spawn(ex, [fn, i, st]() -> http::Task<void> {
      try {
        co_await fn(i);
      } catch (...) {
      }
      if (st->left.fetch_sub(1) == 1) boost::asio::post(st->timer.get_executor(), [st] { st->timer.cancel(); });
    }, boost::asio::detached);
  // The wake-up is posted to the same executor: it runs after the wait below has been issued. The
  // bounded wait only guards against an executor that is not a strand.
  while (st->left.load() > 0) {
    st->timer.expires_after(std::chrono::milliseconds(200));
    boost::system::error_code ec;
    co_await st->timer.async_wait(boost::asio::redirect_error(boost::asio::use_awaitable, ec));
  }
}

// Marks a fleet operation: bumps fleet_epoch on the way out, while fleet_lock is still held.
struct EpochBump {
  Proxy::Impl& p;
  ~EpochBump() {
    std::lock_guard lk(p.fleet_mu);
    ++p.fleet_epoch;
  }
};

}  // namespace lorasync::proxy::fleet
