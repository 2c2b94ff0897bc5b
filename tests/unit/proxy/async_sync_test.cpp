// The proxy's coroutine waiting primitives (proxy/async_sync.h): FIFO hand-over of the fleet lock,
// mutual exclusion across threads, and a notifier that wakes its waiters, with no polling: the
// io_context runs a handful of handlers per wait, where a 2 ms poll would run one per tick.
#include <gtest/gtest.h>

#include <utility>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <atomic>
#include <chrono>
#include <optional>
#include <thread>
#include <vector>

#include "proxy/async_sync.h"

namespace lorasync::proxy {
namespace {

namespace net = boost::asio;
using Clock = std::chrono::steady_clock;

http::Task<void> sleep_ms(int ms) {
  net::steady_timer t(co_await net::this_coro::executor);
  t.expires_after(std::chrono::milliseconds(ms));
  co_await t.async_wait(net::use_awaitable);
}

TEST(AsyncMutex, WaitersGetTheLockInArrivalOrderWokenByTheUnlockNotByPolling) {
  net::io_context ioc;
  AsyncMutex m;
  std::vector<int> order;
  bool released = false;
  net::co_spawn(ioc, [&]() -> http::Task<void> {
    co_await m.lock();
    order.push_back(0);
    co_await sleep_ms(200);  // the others queue meanwhile
    m.unlock();
    released = true;
  }, net::detached);
  for (int i = 1; i <= 3; ++i)
    net::co_spawn(ioc, [&, i]() -> http::Task<void> {
      co_await m.lock();
      order.push_back(i);
      m.unlock();
    }, net::detached);
  // Up to the holder's unlock, handler by handler; the waiters are queued by then.
  std::size_t handlers = 0;
  while (!released) {
    const std::size_t ran = ioc.run_one();
    ASSERT_GT(ran, 0u) << "the io_context ran out of work before the holder unlocked";
    handlers += ran;
  }
  EXPECT_EQ(order, (std::vector<int>{0}));
  // Woken by the hand-over, not by the 1 s guard of a lost wake-up: poll() runs only the handlers
  // ready now and waits for no timer, and the hand-overs complete inside it. (A lost wake-up
  // would leave the waiters asleep, order {0}: their guards expire a second after they queued.)
  handlers += ioc.poll();
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_TRUE(ioc.stopped()) << "nothing left to run: every waiter finished";
  // No polling while the lock was held: a waiter polling every 2 ms would have run about 100
  // handlers during the holder's 200 ms (a count of handlers, whatever the machine's speed).
  EXPECT_LT(handlers, 40u);
  EXPECT_TRUE(m.try_lock()) << "the last unlock released it";
  EXPECT_FALSE(m.try_lock());
  m.unlock();
}

TEST(AsyncMutex, ExcludesCoroutinesOnStrandsOfSeveralThreads) {
  net::io_context ioc;
  AsyncMutex m;
  std::atomic<int> inside{0};
  int counter = 0;  // guarded by m only
  std::atomic<int> overlaps{0};
  constexpr int kCoroutines = 8, kRounds = 200;
  for (int c = 0; c < kCoroutines; ++c)
    net::co_spawn(net::make_strand(ioc), [&]() -> http::Task<void> {
      for (int r = 0; r < kRounds; ++r) {
        if (r % 3 == 0 && m.try_lock()) {
          // taken without waiting
        } else {
          co_await m.lock();
        }
        if (inside.fetch_add(1) != 0) overlaps.fetch_add(1);
        co_await net::post(co_await net::this_coro::executor, net::use_awaitable);  // let others run
        ++counter;
        inside.fetch_sub(1);
        m.unlock();
      }
    }, net::detached);
  std::thread other([&] { ioc.run(); });
  ioc.run();
  other.join();
  EXPECT_EQ(overlaps.load(), 0);
  EXPECT_EQ(counter, kCoroutines * kRounds);
  EXPECT_TRUE(m.try_lock());
}

TEST(Notifier, WakesItsWaiterWhenAnotherThreadMakesTheConditionTrue) {
  net::io_context ioc;
  Notifier n;
  std::atomic<bool> ready{false};
  std::optional<bool> result;
  int checks = 0;
  net::co_spawn(ioc, [&]() -> http::Task<void> {
    result = co_await n.wait_until([&] { ++checks; return ready.load(); }, Clock::now() + std::chrono::seconds(10));
  }, net::detached);
  // poll() runs the handlers ready now and waits for no timer: what it completes was woken by an
  // event, never by the waiter's 1 s guard (nor its 10 s deadline).
  std::size_t handlers = ioc.poll();
  ASSERT_FALSE(result.has_value()) << "waiting";
  ASSERT_EQ(checks, 1);
  // An announcement with the condition still false: the waiter checks again and goes on waiting.
  std::thread([&] { n.notify_all(); }).join();
  handlers += ioc.poll();
  EXPECT_FALSE(result.has_value());
  EXPECT_GE(checks, 2) << "the announcement did not wake the waiter";
  // Asleep meanwhile: run_for() runs what comes due in 200 ms; a waiter polling every 2 ms would
  // run about 100 handlers, this one none (two should the test stall past its 1 s guard).
  const std::size_t idle = ioc.run_for(std::chrono::milliseconds(200));
  EXPECT_LT(idle, 5u);
  EXPECT_FALSE(result.has_value());
  // Another thread makes it true and announces it: the waiter finishes inside the next poll().
  std::thread([&] {
    ready.store(true);
    n.notify_all();
  }).join();
  handlers += ioc.poll();
  ASSERT_TRUE(result.has_value()) << "not woken by the announcement";
  EXPECT_TRUE(*result);
  EXPECT_TRUE(ioc.stopped());
  EXPECT_LT(handlers, 20u);
}

TEST(Notifier, GivesUpAtItsDeadlineAndCostsNothingWithoutWaiters) {
  net::io_context ioc;
  Notifier n;
  n.notify_all();  // nobody waits: nothing posted
  EXPECT_EQ(ioc.poll(), 0u);
  ioc.restart();
  bool result = true;
  int checks = 0;
  Clock::time_point deadline, gave_up;
  net::co_spawn(ioc, [&]() -> http::Task<void> {
    deadline = Clock::now() + std::chrono::milliseconds(150);
    result = co_await n.wait_until([&] { ++checks; return false; }, deadline);
    gave_up = Clock::now();
  }, net::detached);
  ioc.run();
  // It gave up (false), not at once but at the deadline: the condition was checked again after
  // the wait, and the (monotonic) clock read when it returned is at or past the deadline. No
  // bound on the elapsed time: a slow machine only returns later.
  EXPECT_FALSE(result);
  EXPECT_EQ(checks, 2) << "checked at once and once more at the deadline";
  EXPECT_GE(gave_up, deadline);
  // A condition already true returns at once, without waiting: inside one poll(), which waits for
  // no timer.
  ioc.restart();
  std::optional<bool> at_once;
  checks = 0;
  net::co_spawn(ioc, [&]() -> http::Task<void> {
    at_once = co_await n.wait_until([&] { ++checks; return true; }, Clock::now() + std::chrono::seconds(10));
  }, net::detached);
  ioc.poll();
  ASSERT_TRUE(at_once.has_value()) << "it waited";
  EXPECT_TRUE(*at_once);
  EXPECT_EQ(checks, 1);
  EXPECT_TRUE(ioc.stopped());
}

}  // namespace
}  // namespace lorasync::proxy
