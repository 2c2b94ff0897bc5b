// proxy/async_sync.h: waiting primitives for the proxy's coroutines, woken by events (no polling).
// Not a public header.
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "http/async.h"

namespace lorasync::proxy {

namespace detail {
struct Waiter;  // a waiting coroutine's timer, cancelled on its executor to wake it (async_sync.cpp)
}

// A FIFO lock for coroutines (the fleet operations'). unlock() hands the lock to the oldest
// waiter and wakes it; a waiter never polls. Waiters must run on a strand or on an io_context with
// one thread (true of every coroutine of the proxy): the wake-up is posted there.
class AsyncMutex {
 public:
  AsyncMutex();
  ~AsyncMutex();
  AsyncMutex(const AsyncMutex&) = delete;
  AsyncMutex& operator=(const AsyncMutex&) = delete;

  http::Task<void> lock();
  bool try_lock();
  void unlock();

 private:
  friend class AsyncMutexHeld;
  // Shared with the coroutines that lock it and with AsyncMutexHeld: a frame that its io_context
  // destroys at shutdown, after the AsyncMutex, still releases the lock safely.
  struct State {
    std::mutex mu;
    bool held = false;
    std::deque<std::shared_ptr<detail::Waiter>> waiters;
  };
  static void unlock(State& st);
  std::shared_ptr<State> st_;
};

// Releases an AsyncMutex at the end of the scope (after lock() or a successful try_lock()).
class AsyncMutexHeld {
 public:
  explicit AsyncMutexHeld(AsyncMutex& m) : st_(m.st_) {}
  ~AsyncMutexHeld() { AsyncMutex::unlock(*st_); }
  AsyncMutexHeld(const AsyncMutexHeld&) = delete;
  AsyncMutexHeld& operator=(const AsyncMutexHeld&) = delete;

 private:
  std::shared_ptr<AsyncMutex::State> st_;
};

// Coroutines waiting for a condition that other code (any thread) makes true and then announces
// with notify_all(). notify_all() costs one atomic load while nobody waits. Waiters must run on a
// strand or on an io_context with one thread, as for AsyncMutex.
class Notifier {
 public:
  Notifier();
  ~Notifier();
  Notifier(const Notifier&) = delete;
  Notifier& operator=(const Notifier&) = delete;

  // Waits until `holds()` is true (checked at once and after every notification) or `deadline`
  // passes; returns the last value of `holds()`.
  http::Task<bool> wait_until(std::function<bool()> holds, std::chrono::steady_clock::time_point deadline);
  void notify_all();

 private:
  // Shared with the waiting coroutines: a frame that its io_context destroys at shutdown, after
  // the Notifier, still leaves the list safely.
  struct State {
    std::mutex mu;
    std::atomic<int> waiting{0};
    std::vector<std::shared_ptr<detail::Waiter>> waiters;
  };
  std::shared_ptr<State> st_;
};

}  // namespace lorasync::proxy
