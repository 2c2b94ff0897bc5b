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
#include <thread>
#include <vector>

#include "proxy/async_sync.h"

namespace lorasync::proxy {
namespace {

namespace net = boost::asio;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

http::Task<void> sleep_ms(int ms) {
  net::steady_timer t(co_await net::this_coro::executor);
  t.expires_after(std::chrono::milliseconds(ms));
  co_await t.async_wait(net::use_awaitable);
}

TEST(AsyncMutex, WaitersGetTheLockInArrivalOrderWokenByTheUnlockNotByPolling) {
  net::io_context ioc;
  AsyncMutex m;
  std::vector<int> order;
  const auto t0 = Clock::now();
  double handed_over_after = -1;
  net::co_spawn(ioc, [&]() -> http::Task<void> {
    co_await m.lock();
    order.push_back(0);
    co_await sleep_ms(200);  // the others queue meanwhile
    m.unlock();
  }, net::detached);
  for (int i = 1; i <= 3; ++i)
    net::co_spawn(ioc, [&, i]() -> http::Task<void> {
      co_await m.lock();
      if (i == 1) handed_over_after = seconds_since(t0);
      order.push_back(i);
      m.unlock();
    }, net::detached);
  const std::size_t handlers = ioc.run();
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3}));
  // Woken by the hand-over at 0.2 s, not by the 1 s guard of a lost wake-up.
  EXPECT_GE(handed_over_after, 0.19);
  EXPECT_LT(handed_over_after, 0.9);
  // A waiter polling every 2 ms would have run about 100 handlers while the lock was held.
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
  bool result = false;
  double woke_after = -1;
  const auto t0 = Clock::now();
  net::co_spawn(ioc, [&]() -> http::Task<void> {
    result = co_await n.wait_until([&] { return ready.load(); }, Clock::now() + std::chrono::seconds(10));
    woke_after = seconds_since(t0);
  }, net::detached);
  std::thread setter([&] {
    n.notify_all();  // an announcement with the condition still false changes nothing
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    ready.store(true);
    n.notify_all();
  });
  const std::size_t handlers = ioc.run();
  setter.join();
  EXPECT_TRUE(result);
  EXPECT_GE(woke_after, 0.19);
  EXPECT_LT(woke_after, 0.9) << "woken by the 1 s guard, not by the announcement";
  EXPECT_LT(handlers, 20u);
}

TEST(Notifier, GivesUpAtItsDeadlineAndCostsNothingWithoutWaiters) {
  net::io_context ioc;
  Notifier n;
  n.notify_all();  // nobody waits: nothing posted
  EXPECT_EQ(ioc.poll(), 0u);
  ioc.restart();
  bool result = true;
  double took = -1;
  net::co_spawn(ioc, [&]() -> http::Task<void> {
    const auto t0 = Clock::now();
    result = co_await n.wait_until([] { return false; }, Clock::now() + std::chrono::milliseconds(150));
    took = seconds_since(t0);
  }, net::detached);
  ioc.run();
  EXPECT_FALSE(result);
  EXPECT_GE(took, 0.14);
  // A condition already true returns at once, without waiting.
  ioc.restart();
  net::co_spawn(ioc, [&]() -> http::Task<void> {
    result = co_await n.wait_until([] { return true; }, Clock::now() + std::chrono::seconds(10));
  }, net::detached);
  const auto t1 = Clock::now();
  ioc.run();
  EXPECT_TRUE(result);
  EXPECT_LT(seconds_since(t1), 0.5);
}

}  // namespace
}  // namespace lorasync::proxy
