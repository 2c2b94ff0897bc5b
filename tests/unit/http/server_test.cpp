// The HTTP server's connection handling seen from a raw socket: a client that half-closes after its
// request gets its answer and the close at once (not at the idle timeout), also when it half-closes
// while the handler runs; a client that leaves mid-request is noticed (client_gone) at once;
// pipelined requests are all answered; a head that never ends gets 408 from the timeout sweeper.
// With one I/O thread (connections on the io_context's executor) and with two (a strand each).
// Servers on the caller's io_context (ServerOptions::io) share its one thread and stop cleanly
// with a request in flight.
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
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "http/server.h"
#include "util/error.h"

namespace lorasync::http {
namespace {

using Clock = std::chrono::steady_clock;

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
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  return fd;
}

// Everything the server sends until it closes, or until `limit` passes; `closed` says which.
std::string read_until_close(int fd, double limit_s, bool& closed) {
  std::string out;
  closed = false;
  const auto end = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(limit_s));
  char buf[4096];
  while (Clock::now() < end) {
    pollfd p{fd, POLLIN, 0};
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now()).count();
    if (::poll(&p, 1, static_cast<int>(std::max<long>(1, left))) <= 0) continue;
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

// Answers after `delay_s`, or as soon as the client is gone (counted in `gone`).
struct Slow {
  std::atomic<int> gone{0};
  Server server;
  Slow(ServerOptions o, double delay_s)
      : server(o, [this, delay_s](Request& req, ResponseWriter& w) -> Task<void> {
          namespace net = boost::asio;
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

// A connection whose GET `path` the server's handler has started (50 ms after sending it).
int request_in_flight(std::uint16_t port, const std::string& path) {
  const int fd = connect_to(port);
  const std::string req = "GET " + path + " HTTP/1.1\r\nHost: x\r\n\r\n";
  EXPECT_EQ(::send(fd, req.data(), req.size(), 0), static_cast<ssize_t>(req.size()));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  return fd;
}

class HttpServerThreads : public ::testing::TestWithParam<int> {};
INSTANTIATE_TEST_SUITE_P(OneAndTwo, HttpServerThreads, ::testing::Values(1, 2));

TEST_P(HttpServerThreads, AClientThatHalfClosesGetsItsAnswerAndTheCloseAtOnce) {
  ServerOptions o;
  o.threads = GetParam();
  o.idle_timeout_s = 30;  // a close that waited for it would fail the test
  Echo e(o);
  for (int i = 0; i < 20; ++i) {
    const int fd = connect_to(e.server.port());
    const std::string req = "GET /a HTTP/1.1\r\nHost: x\r\n\r\n";
    ASSERT_EQ(::send(fd, req.data(), req.size(), 0), static_cast<ssize_t>(req.size()));
    ::shutdown(fd, SHUT_WR);
    bool closed = false;
    const auto t0 = Clock::now();
    const std::string got = read_until_close(fd, 5, closed);
    ::close(fd);
    EXPECT_TRUE(closed);
    EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 2.0) << "closed at a timeout, not at once";
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
  o.idle_timeout_s = 30;
  Slow e(o, 10.0);
  for (int i = 0; i < 5; ++i) {
    const int fd = request_in_flight(e.server.port(), "/h");
    ::shutdown(fd, SHUT_WR);
    bool closed = false;
    const auto t0 = Clock::now();
    read_until_close(fd, 5, closed);
    ::close(fd);
    EXPECT_TRUE(closed);
    EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 2.0) << "closed at a timeout, not at once";
    EXPECT_EQ(e.gone.load(), i + 1);
  }
}

// A client that closes while its request runs is noticed at once: the handler's client_gone fires.
TEST_P(HttpServerThreads, AClientThatLeavesMidRequestIsNoticedAtOnce) {
  ServerOptions o;
  o.threads = GetParam();
  Slow e(o, 10.0);
  for (int i = 0; i < 5; ++i) {
    ::close(request_in_flight(e.server.port(), "/l"));
    const auto t0 = Clock::now();
    while (e.gone.load() <= i && Clock::now() - t0 < std::chrono::seconds(5))
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    EXPECT_EQ(e.gone.load(), i + 1) << "departure " << i << " not noticed";
    EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 2.0);
  }
}

// During stop()'s grace period the hang-up watch still runs: a client that leaves then ends its
// request at once, and stop() returns long before the grace period would.
TEST_P(HttpServerThreads, AClientThatLeavesDuringTheGracePeriodIsNoticedAndStopReturns) {
  ServerOptions o;
  o.threads = GetParam();
  Slow e(o, 30.0);
  const int fd = request_in_flight(e.server.port(), "/g");
  const auto t0 = Clock::now();
  std::thread stopper([&] { e.server.stop(20.0); });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  ::close(fd);
  stopper.join();
  EXPECT_EQ(e.gone.load(), 1);
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 5.0);
}

TEST_P(HttpServerThreads, PipelinedRequestsAreAllAnsweredInOrder) {
  ServerOptions o;
  o.threads = GetParam();
  o.idle_timeout_s = 30;
  Echo e(o);
  const int fd = connect_to(e.server.port());
  std::string reqs;
  for (int i = 0; i < 5; ++i) reqs += "GET /p" + std::to_string(i) + " HTTP/1.1\r\nHost: x\r\n\r\n";
  reqs += "GET /last HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  ASSERT_EQ(::send(fd, reqs.data(), reqs.size(), 0), static_cast<ssize_t>(reqs.size()));
  bool closed = false;
  const std::string got = read_until_close(fd, 5, closed);
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
  const auto t0 = Clock::now();
  const std::string got = read_until_close(fd, 5, closed);
  ::close(fd);
  const double took = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_TRUE(closed);
  EXPECT_EQ(got.rfind("HTTP/1.1 408", 0), 0u) << got;
  EXPECT_GE(took, 0.25);
  EXPECT_LT(took, 3.0);  // the timeout plus a tick and the linger, not more
}

// Two servers on one io_context of the caller's: the caller's thread runs every handler of both;
// stop() with a request in flight closes its connection after the grace, while that thread still
// runs; then the io_context goes before the servers, as ServerOptions::io asks.
TEST(HttpServer, ServersOnTheCallersIoContextShareItsThreadAndStopWithARequestInFlight) {
  namespace net = boost::asio;
  auto io = std::make_unique<net::io_context>(1);
  std::mutex mu;
  std::vector<std::thread::id> ran_on;
  // /held waits 30 s; anything else is answered at once.
  auto make = [&] {
    ServerOptions o;
    o.io = io.get();
    return std::make_unique<Server>(o, [&](Request& req, ResponseWriter& w) -> Task<void> {
      {
        std::lock_guard lk(mu);
        ran_on.push_back(std::this_thread::get_id());
      }
      const double delay_s = req.path() == "/held" ? 30 : 0;
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
    const std::string got = read_until_close(fd, 5, closed);
    ::close(fd);
    EXPECT_EQ(got.rfind("HTTP/1.1 200", 0), 0u) << got;
  }
  const int held = request_in_flight(slow->port(), "/held");
  const auto t0 = Clock::now();
  fast->stop(0.2);
  slow->stop(0.2);  // /held's handler waits 30 s: closed after the grace
  bool closed = false;
  const std::string got = read_until_close(held, 5, closed);
  ::close(held);
  EXPECT_TRUE(closed);
  EXPECT_EQ(got.find("HTTP/1.1 200"), std::string::npos) << got;
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 3.0);
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
