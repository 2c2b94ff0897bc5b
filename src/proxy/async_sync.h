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

// A FIFO lock for coroutines (the fleet operations'). unlock() hands the lock to the oldest
// waiter and wakes it; a waiter never polls.
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
  struct Waiter;
  std::mutex mu_;
  bool held_ = false;
  std::deque<std::shared_ptr<Waiter>> waiters_;
};

// Releases an AsyncMutex at the end of the scope (after lock() or a successful try_lock()).
struct AsyncMutexHeld {
  AsyncMutex& m;
  ~AsyncMutexHeld() { m.unlock(); }
};

// Coroutines waiting for a condition that other code (any thread) makes true and then announces
// with notify_all(). notify_all() costs one atomic load while nobody waits.
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
  struct Waiter;
  // Shared with the waiting coroutines: a frame that its io_context destroys at shutdown, after
  // the Notifier, still leaves the list safely.
  struct State {
    std::mutex mu;
    std::atomic<int> waiting{0};
    std::vector<std::shared_ptr<Waiter>> waiters;
  };
  std::shared_ptr<State> st_;
};

}  // namespace lorasync::proxy
