// server/offload.h: bridges between serve's io threads and its other threads (private to
// api_server.cpp): a pool for blocking work, a waker, and the channel through which the engine
// thread hands a request's output to its coroutine.
// Thread-safety: BlockingPool::post, Channel::push/pop/wake from any thread; Waker::wait and
// finish_offload on the coroutine's strand.
#pragma once

#include <utility>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "engine/request.h"
#include "http/async.h"

namespace lorasync::server {

namespace net = boost::asio;
using http::Task;

// Threads for blocking work (adapter file reads, waits on engine futures, tokenizing large
// bodies) so io threads never block. Several: one stuck job must not hold every load, unload and
// reset behind it. The destructor runs what is queued, then joins.
class BlockingPool {
 public:
  explicit BlockingPool(int threads = 4) {
    for (int i = 0; i < threads; ++i) t_.emplace_back([this] { run(); });
  }
  ~BlockingPool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : t_) t.join();
  }
  void post(std::function<void()> f) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      q_.push_back(std::move(f));
    }
    cv_.notify_one();
  }

 private:
  void run() {
    for (;;) {
      std::function<void()> f;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_ || !q_.empty(); });
        if (q_.empty()) return;
        f = std::move(q_.front());
        q_.pop_front();
      }
      f();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> q_;
  bool stop_ = false;
  std::vector<std::thread> t_;
};

// Wakes a coroutine from another thread: post(cancel) onto its strand.
struct Waker {
  explicit Waker(net::any_io_executor ex) : timer(ex) { timer.expires_at(net::steady_timer::time_point::max()); }
  net::steady_timer timer;
  Task<void> wait() {
    boost::system::error_code ec;
    timer.expires_at(net::steady_timer::time_point::max());
    co_await timer.async_wait(net::redirect_error(net::use_awaitable, ec));
  }
};

struct Output {
  std::size_t prompt_index;
  std::vector<engine::ChoiceDelta> deltas;
  engine::RequestUsage usage;
  bool done;
};

struct Channel : std::enable_shared_from_this<Channel> {
  explicit Channel(net::any_io_executor ex) : waker(ex) {}
  std::mutex mu;
  std::deque<Output> items;
  Waker waker;
  void push(Output o) {
    {
      std::lock_guard<std::mutex> lk(mu);
      items.push_back(std::move(o));
    }
    // The wake-up holds the channel: it may run after the request's coroutine has ended.
    wake();
  }
  void wake() {
    net::post(waker.timer.get_executor(), [self = shared_from_this()] { self->waker.timer.cancel(); });
  }
  bool empty() {
    std::lock_guard<std::mutex> lk(mu);
    return items.empty();
  }
  bool pop(Output& o) {
    std::lock_guard<std::mutex> lk(mu);
    if (items.empty()) return false;
    o = std::move(items.front());
    items.pop_front();
    return true;
  }
};

class ChannelSink : public engine::RequestSink {
 public:
  ChannelSink(std::shared_ptr<Channel> ch, std::size_t idx) : ch_(std::move(ch)), idx_(idx) {}
  void on_output(std::vector<engine::ChoiceDelta> deltas, const engine::RequestUsage& usage, bool done) override {
    ch_->push({idx_, std::move(deltas), usage, done});
  }

 private:
  std::shared_ptr<Channel> ch_;
  std::size_t idx_;
};

// Runs f on the blocking pool; finish_offload() resumes the coroutine with its result. Split in a
// plain function and a coroutine taking only a shared_ptr: g++ 12 mishandles temporaries (such as a
// lambda converted to std::function) inside co_await expressions.
template <typename T>
struct OffloadState {
  explicit OffloadState(net::any_io_executor e) : waker(e) {}
  Waker waker;
  std::optional<T> value;
  std::exception_ptr error;
  bool done = false;  // strand only
};

template <typename T>
std::shared_ptr<OffloadState<T>> start_offload(BlockingPool& pool, net::any_io_executor ex,
                                               std::function<T()> f) {
  auto st = std::make_shared<OffloadState<T>>(ex);
  pool.post([st, f = std::move(f)] {
    try {
      st->value.emplace(f());
    } catch (...) {
      st->error = std::current_exception();
    }
    net::post(st->waker.timer.get_executor(), [st] {
      st->done = true;
      st->waker.timer.cancel();
    });
  });
  return st;
}

template <typename T>
Task<T> finish_offload(std::shared_ptr<OffloadState<T>> st) {
  while (!st->done) co_await st->waker.wait();
  if (st->error) std::rethrow_exception(st->error);
  co_return std::move(*st->value);
}

}  // namespace lorasync::server
