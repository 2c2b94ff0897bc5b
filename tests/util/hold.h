// tests/util/hold.h: for fake servers built on http::Server, a handler's pause that ends early when
// its client disconnects (a generation still running that the caller cancels).
#pragma once

#include <utility>  // before Asio's coroutine headers (Boost 1.74 with g++ 12)

#include <boost/asio/redirect_error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <chrono>

#include "http/server.h"

namespace lorasync::testing {

// Waits `seconds`, or less if the client of `w` leaves; returns false if it did (nothing to
// answer). Runs on the handler's strand, where the server fires client_gone().
inline http::Task<bool> hold_unless_client_leaves(http::ResponseWriter& w, double seconds) {
  boost::asio::steady_timer t(co_await boost::asio::this_coro::executor);
  t.expires_after(std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(seconds)));
  const auto id = w.client_gone().subscribe([&t] { t.cancel(); });
  if (!w.client_gone().fired()) {
    boost::system::error_code ec;
    co_await t.async_wait(boost::asio::redirect_error(boost::asio::use_awaitable, ec));
  }
  w.client_gone().unsubscribe(id);
  co_return !w.client_gone().fired();
}

}  // namespace lorasync::testing
