// The HTTP server's connection handling seen from a raw socket: a client that half-closes after its
// request gets its answer and the close at once (not at the idle timeout), also when it half-closes
// while the handler runs; a client that leaves mid-request is noticed (client_gone) at once;
// pipelined requests are all answered; a head that never ends gets 408 from the timeout sweeper.
// With one I/O thread (connections on the io_context's executor) and with two (a strand each).
// Servers on the caller's io_context (ServerOptions::io) share its one thread and stop cleanly
// with a request in flight.
// No assertion on elapsed time: a path that must not be the one taken (an idle timeout, a
// handler's own end, a grace period) is set to an hour, far beyond kGuardMs, the bound that turns
// a hang into a failure; so an event seen within the guard (a close, client_gone) can only come
// from the path under test, and a slow machine only makes it come later.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "http/server.h"
#include "util/error.h"
#include "util/loopback.h"

namespace lorasync::http {
namespace {

using Clock = std::chrono::steady_clock;

// How long a test waits for an event before it gives up: a guard against a hang, not a measure.
constexpr int kGuardMs = 30'000;
// A timeout, delay or grace period that must not be reached in a test: far beyond kGuardMs.
constexpr double kNeverS = 3600;

// Waits (polling, at most kGuardMs) until `done` holds; returns whether it did.
bool wait_for_event(const std::function<bool()>& done) {
  for (int i = 0; i < kGuardMs && !done(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return done();
}

struct Echo {
  Server server;
  explicit Echo(ServerOptions o)
      : server(o, [](Request& req, ResponseWriter& w) -> Task<void> {
          co_await w.send(json_response(200, "{\"path\":\"" + std::string(req.path()) + "\"}"));
        }) {
    server.start();
  }
};

int connect_to(std::uint16_t port) {
  const int fd = testing::connect_loopback(port);
  EXPECT_GE(fd, 0) << "connection to port " << port << " refused";
  return fd;
}

// Everything the server sends until it closes, or until it has sent nothing for kGuardMs;
// `closed` says which.
std::string read_until_close(int fd, bool& closed) {
  std::string out;
  closed = false;
  char buf[4096];
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, kGuardMs) <= 0) break;
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) {
      closed = true;
      break;
    }
    out.append(buf, static_cast<std::size_t>(n));
  }
  return out;
}

std::size_t count(const std::string& s, const std::string& what) {
  std::size_t n = 0;
  for (std::size_t p = 0; (p = s.find(what, p)) != std::string::npos; p += what.size()) ++n;
  return n;
}

// Answers after `delay_s`, or as soon as the client is gone (counted in `gone`); `started`
// counts the handler calls.
struct Slow {
  std::atomic<int> started{0};
  std::atomic<int> gone{0};
  Server server;
  Slow(ServerOptions o, double delay_s)
      : server(o, [this, delay_s](Request& req, ResponseWriter& w) -> Task<void> {
          namespace net = boost::asio;
          started.fetch_add(1);
          net::steady_timer t(co_await net::this_coro::executor,
                              std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(delay_s)));
          const auto id = w.client_gone().subscribe([&t] { t.cancel(); });
          boost::system::error_code ec;
          co_await t.async_wait(net::redirect_error(net::use_awaitable, ec));
          w.client_gone().unsubscribe(id);
          if (w.client_gone().fired()) {
            gone.fetch_add(1);
            w.abort();
            co_return;
          }
          co_await w.send(json_response(200, "{\"path\":\"" + std::string(req.path()) + "\"}"));
        }) {
    server.start();
  }
};

// A connection whose GET `path` the server's handler has started (`started` says when).
int request_in_flight(std::uint16_t port, const std::string& path, const std::function<bool()>& started) {
  const int fd = connect_to(port);
  const std::string req = "GET " + path + " HTTP/1.1\r\nHost: x\r\n\r\n";
  EXPECT_EQ(::send(fd, req.data(), req.size(), 0), static_cast<ssize_t>(req.size()));
  EXPECT_TRUE(wait_for_event(started)) << path << ": its handler never started";
  return fd;
}

// Slow's request `path`, its handler call number `n` (from 1) started.
int request_in_flight(Slow& s, const std::string& path, int n) {
  return request_in_flight(s.server.port(), path, [&s, n] { return s.started.load() >= n; });
}

// Whether a connection to `port` is accepted (false once stop() has closed the listener).
bool listening(std::uint16_t port) {
  const int fd = testing::connect_loopback(port);
  if (fd >= 0) ::close(fd);
  return fd >= 0;
}

class HttpServerThreads : public ::testing::TestWithParam<int> {};
INSTANTIATE_TEST_SUITE_P(OneAndTwo, HttpServerThreads, ::testing::Values(1, 2));

TEST_P(HttpServerThreads, AClientThatHalfClosesGetsItsAnswerAndTheCloseAtOnce) {
  ServerOptions o;
  o.threads = GetParam();
  o.idle_timeout_s = kNeverS;  // a close that waited for it would come after the read's guard
  Echo e(o);
  for (int i = 0; i < 20; ++i) {
    const int fd = connect_to(e.server.port());
    const std::string req = "GET /a HTTP/1.1\r\nHost: x\r\n\r\n";
    ASSERT_EQ(::send(fd, req.data(), req.size(), 0), static_cast<ssize_t>(req.size()));
    ::shutdown(fd, SHUT_WR);
    bool closed = false;
    const std::string got = read_until_close(fd, closed);
    ::close(fd);
    // The close came within the guard: the half-close's, as the idle timeout is an hour away.
    EXPECT_TRUE(closed) << "not closed at the half-close (the idle timeout is " << kNeverS << " s)";
    EXPECT_EQ(got.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << got;
    EXPECT_NE(got.find("{\"path\":\"/a\"}"), std::string::npos) << got;
  }
}

// The end of stream arrives while the handler runs: like a departure (the server cannot tell a
// half-close from one), it fires client_gone, and the connection ends at once, not at the idle
// timeout (the end, seen by the server's watch, is not waited for a second time).
TEST_P(HttpServerThreads, AClientThatHalfClosesDuringItsRequestEndsTheConnectionAtOnce) {
  ServerOptions o;
  o.threads = GetParam();
  o.idle_timeout_s = kNeverS;
  Slow e(o, kNeverS);
  for (int i = 0; i < 5; ++i) {
    const int fd = request_in_flight(e, "/h", i + 1);
    ::shutdown(fd, SHUT_WR);
    bool closed = false;
    const std::string got = read_until_close(fd, closed);
    ::close(fd);
    // Closed within the guard, with neither the handler's answer (an hour away) nor the idle
    // timeout's close (an hour too): by the hang-up path, which fired client_gone.
    EXPECT_TRUE(closed) << "the connection outlived the half-close";
    EXPECT_EQ(got, "") << "answered: the handler's own end, not the half-close";
    EXPECT_EQ(e.gone.load(), i + 1);
  }
}

// A client that closes while its request runs is noticed at once: the handler's client_gone fires.
TEST_P(HttpServerThreads, AClientThatLeavesMidRequestIsNoticedAtOnce) {
  ServerOptions o;
  o.threads = GetParam();
  Slow e(o, kNeverS);
  for (int i = 0; i < 5; ++i) {
    ::close(request_in_flight(e, "/l", i + 1));
    // The handler would wait an hour: client_gone within the guard is the departure's.
    EXPECT_TRUE(wait_for_event([&] { return e.gone.load() > i; })) << "departure " << i << " not noticed";
    EXPECT_EQ(e.gone.load(), i + 1);
  }
}

// During stop()'s grace period the hang-up watch still runs: a client that leaves then ends its
// request at once, and stop() returns long before the grace period would.
TEST_P(HttpServerThreads, AClientThatLeavesDuringTheGracePeriodIsNoticedAndStopReturns) {
  ServerOptions o;
  o.threads = GetParam();
  Slow e(o, kNeverS);
  const int fd = request_in_flight(e, "/g", 1);
  // A grace period beyond the guard (finite, so that a failure ends after it).
  constexpr double kGraceS = 4.0 * kGuardMs / 1000;
  auto stopped = std::async(std::launch::async, [&] { e.server.stop(kGraceS); });
  // stop() has begun (it closes the listener first): the client leaves in its grace period.
  EXPECT_TRUE(wait_for_event([&] { return !listening(e.server.port()); })) << "stop() never closed the listener";
  ::close(fd);
  // stop() returned within the guard: before the grace period's end, so at the request's end,
  // which only the departure could bring (the handler waits an hour).
  EXPECT_EQ(stopped.wait_for(std::chrono::milliseconds(kGuardMs)), std::future_status::ready)
      << "stop() waited out its grace period";
  EXPECT_EQ(e.gone.load(), 1);
}

TEST_P(HttpServerThreads, PipelinedRequestsAreAllAnsweredInOrder) {
  ServerOptions o;
  o.threads = GetParam();
  o.idle_timeout_s = kNeverS;
  Echo e(o);
  const int fd = connect_to(e.server.port());
  std::string reqs;
  for (int i = 0; i < 5; ++i) reqs += "GET /p" + std::to_string(i) + " HTTP/1.1\r\nHost: x\r\n\r\n";
  reqs += "GET /last HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  ASSERT_EQ(::send(fd, reqs.data(), reqs.size(), 0), static_cast<ssize_t>(reqs.size()));
  bool closed = false;
  const std::string got = read_until_close(fd, closed);
  ::close(fd);
  EXPECT_TRUE(closed);
  EXPECT_EQ(count(got, "HTTP/1.1 200 OK"), 6u) << got;
  std::size_t at = 0;
  for (const std::string p : {"/p0", "/p1", "/p2", "/p3", "/p4", "/last"}) {
    const std::size_t next = got.find("\"" + p + "\"", at);
    ASSERT_NE(next, std::string::npos) << p << " missing or out of order";
    at = next;
  }
}

TEST(HttpServer, AHeadThatNeverEndsGets408FromTheSweeper) {
  ServerOptions o;
  o.client_timeout_s = 0.3;
  Echo e(o);
  const int fd = connect_to(e.server.port());
  const std::string part = "GET / HTTP/1.1\r\nHost: x\r\n";  // no blank line
  ASSERT_EQ(::send(fd, part.data(), part.size(), 0), static_cast<ssize_t>(part.size()));
  bool closed = false;
  const std::string got = read_until_close(fd, closed);
  ::close(fd);
  // The server writes 408 only on a connection its sweeper timed out (Session::timed_out): the
  // answer itself says the client timeout, not some other path, ended the request. The idle
  // timeout (75 s) would have closed it without an answer.
  EXPECT_TRUE(closed);
  EXPECT_EQ(got.rfind("HTTP/1.1 408", 0), 0u) << got;
  EXPECT_NE(got.find("request not received within the client timeout"), std::string::npos) << got;
}

// Two servers on one io_context of the caller's: the caller's thread runs every handler of both;
// stop() with a request in flight closes its connection after the grace, while that thread still
// runs; then the io_context goes before the servers, as ServerOptions::io asks.
TEST(HttpServer, ServersOnTheCallersIoContextShareItsThreadAndStopWithARequestInFlight) {
  namespace net = boost::asio;
  auto io = std::make_unique<net::io_context>(1);
  std::mutex mu;
  std::vector<std::thread::id> ran_on;
  // /held waits an hour; anything else is answered at once.
  auto make = [&] {
    ServerOptions o;
    o.io = io.get();
    return std::make_unique<Server>(o, [&](Request& req, ResponseWriter& w) -> Task<void> {
      {
        std::lock_guard lk(mu);
        ran_on.push_back(std::this_thread::get_id());
      }
      const double delay_s = req.path() == "/held" ? kNeverS : 0;
      net::steady_timer t(co_await net::this_coro::executor,
                          std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(delay_s)));
      boost::system::error_code ec;
      co_await t.async_wait(net::redirect_error(net::use_awaitable, ec));
      co_await w.send(json_response(200, "{\"path\":\"" + std::string(req.path()) + "\"}"));
    });
  };
  auto fast = make(), slow = make();
  fast->start();
  slow->start();
  std::thread runner([&] { io->run(); });
  const auto runner_id = runner.get_id();
  for (auto* srv : {fast.get(), slow.get()}) {
    const int fd = connect_to(srv->port());
    const std::string req = "GET /a HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    ASSERT_EQ(::send(fd, req.data(), req.size(), 0), static_cast<ssize_t>(req.size()));
    bool closed = false;
    const std::string got = read_until_close(fd, closed);
    ::close(fd);
    EXPECT_EQ(got.rfind("HTTP/1.1 200", 0), 0u) << got;
  }
  const int held = request_in_flight(slow->port(), "/held", [&] {
    std::lock_guard lk(mu);
    return ran_on.size() == 3;
  });
  fast->stop(0.2);
  slow->stop(0.2);  // /held's handler waits an hour: closed after the grace
  // Closed within the guard and unanswered: by the stop, as the handler's end is an hour away.
  bool closed = false;
  const std::string got = read_until_close(held, closed);
  ::close(held);
  EXPECT_TRUE(closed);
  EXPECT_EQ(got.find("HTTP/1.1 200"), std::string::npos) << got;
  io->stop();
  runner.join();
  {
    std::lock_guard lk(mu);
    ASSERT_EQ(ran_on.size(), 3u);
    for (const auto& id : ran_on) EXPECT_EQ(id, runner_id);
  }
  io.reset();  // before the servers: its pending handlers (the held request's) refer to them
  slow.reset();
  fast.reset();
}

TEST(HttpServer, AServerOnTheCallersIoContextHasOneThread) {
  boost::asio::io_context io(1);
  ServerOptions o;
  o.io = &io;
  o.threads = 2;
  EXPECT_THROW(Server(o, [](Request&, ResponseWriter&) -> Task<void> { co_return; }), Error);
}

}  // namespace
}  // namespace lorasync::http
