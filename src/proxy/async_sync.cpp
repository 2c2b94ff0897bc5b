#include <utility>

#include "proxy/async_sync.h"

#include <boost/asio/post.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <algorithm>

namespace lorasync::proxy {

namespace net = boost::asio;
using Clock = std::chrono::steady_clock;

namespace detail {

struct Waiter {
  explicit Waiter(net::any_io_executor ex) : timer(std::move(ex)) {}
  bool granted = false;  // AsyncMutex's: under its State::mu
  net::steady_timer timer;
};

}  // namespace detail

namespace {

using detail::Waiter;

// The wake-up of a waiter: the cancellation of its timer, posted to the waiter's own executor (its
// strand, or the only I/O thread), so it runs after the waiter has issued its wait and is never
// lost. (On an executor that ran handlers concurrently the cancel could race with the wait itself:
// hence the strand requirement. The waits are still bounded, 1 s, as a second line of defence.)
void wake(const std::shared_ptr<Waiter>& w) {
  net::post(w->timer.get_executor(), [w] { w->timer.cancel(); });
}

http::Task<void> wait_on(Waiter& w, Clock::time_point deadline) {
  w.timer.expires_at(std::min(deadline, Clock::now() + std::chrono::seconds(1)));
  boost::system::error_code ec;
  co_await w.timer.async_wait(net::redirect_error(net::use_awaitable, ec));
}

}  // namespace

AsyncMutex::AsyncMutex() : st_(std::make_shared<State>()) {}
AsyncMutex::~AsyncMutex() = default;

http::Task<void> AsyncMutex::lock() {
  std::shared_ptr<State> st = st_;  // this frame may outlive the AsyncMutex at shutdown
  auto ex = co_await net::this_coro::executor;
  std::shared_ptr<Waiter> w;
  {
    std::lock_guard lk(st->mu);
    if (!st->held) {
      st->held = true;
      co_return;
    }
    w = std::make_shared<Waiter>(ex);
    st->waiters.push_back(w);
  }
  try {
    for (;;) {
      {
        std::lock_guard lk(st->mu);
        if (w->granted) co_return;
      }
      co_await wait_on(*w, Clock::time_point::max());
    }
  } catch (...) {
    // (An allocation failure in the wait.) Leave the queue, or pass on a lock granted meanwhile:
    // a waiter that left must never be handed the lock.
    bool granted;
    {
      std::lock_guard lk(st->mu);
      granted = w->granted;
      if (!granted) std::erase(st->waiters, w);
    }
    if (granted) unlock(*st);
    throw;
  }
}

bool AsyncMutex::try_lock() {
  std::lock_guard lk(st_->mu);
  if (st_->held) return false;
  st_->held = true;
  return true;
}

void AsyncMutex::unlock() { unlock(*st_); }

void AsyncMutex::unlock(State& st) {
  std::lock_guard lk(st.mu);
  if (st.waiters.empty()) {
    st.held = false;
    return;
  }
  // Handed over: the lock stays held, now by the oldest waiter.
  std::shared_ptr<Waiter> w = std::move(st.waiters.front());
  st.waiters.pop_front();
  w->granted = true;
  wake(w);
}

Notifier::Notifier() : st_(std::make_shared<State>()) {}
Notifier::~Notifier() = default;

http::Task<bool> Notifier::wait_until(std::function<bool()> holds, Clock::time_point deadline) {
  auto w = std::make_shared<Waiter>(co_await net::this_coro::executor);
  std::shared_ptr<State> st = st_;
  {
    std::lock_guard lk(st->mu);
    st->waiters.push_back(w);
  }
  // Registered before the first check: a change made after it is announced to this waiter.
  st->waiting.fetch_add(1);
  struct Leave {
    std::shared_ptr<State> st;
    std::shared_ptr<Waiter> w;
    ~Leave() {
      std::lock_guard lk(st->mu);
      std::erase(st->waiters, w);
      st->waiting.fetch_sub(1);
    }
  } leave{st, w};
  for (;;) {
    if (holds()) co_return true;
    if (Clock::now() >= deadline) co_return false;
    co_await wait_on(*w, deadline);
  }
}

void Notifier::notify_all() {
  if (st_->waiting.load() == 0) return;
  std::lock_guard lk(st_->mu);
  for (const auto& w : st_->waiters) wake(w);
}

}  // namespace lorasync::proxy
