// The HTTP client (http/client.h) against a scripted upstream on a raw socket: keep-alive reuse
// and its refusal after "Connection: close"; chunked (with extensions and a trailer, delivered a
// byte at a time) and read-until-close bodies (a body delimited by the connection's close never
// returns it to the pool); the timeouts: an idle body, a first-byte deadline shorter than the
// last call's on the same connection (it must fire on time), a first-byte deadline that passes
// while the body is awaited under a later idle one (it must not end the call), the total
// timeout; a reused connection reset before the status line is retried once on a fresh one; the
// head of a forwarded request (hop-by-hop, dropped and framing fields left out, extra ones added);
// response heads larger than the parser's field arena, after an interim answer, then small ones.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>

#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "http/client.h"

namespace lorasync::http {
namespace {

using Clock = std::chrono::steady_clock;

void send_all(int fd, std::string_view s) {
  while (!s.empty()) {
    const ssize_t n = ::send(fd, s.data(), s.size(), MSG_NOSIGNAL);
    if (n <= 0) return;
    s.remove_prefix(static_cast<std::size_t>(n));
  }
}

// Reads one request head (the tests' requests have no body). False at EOF or error.
bool read_request(int fd) {
  std::string got;
  char c;
  while (got.size() < 4 || got.compare(got.size() - 4, 4, "\r\n\r\n") != 0) {
    if (::recv(fd, &c, 1, 0) != 1) return false;
    got.push_back(c);
  }
  return true;
}

// Waits until the client closes the connection (or 10 s pass).
void wait_for_close(int fd) {
  pollfd p{fd, POLLIN, 0};
  char buf[256];
  const auto until = Clock::now() + std::chrono::seconds(10);
  while (Clock::now() < until) {
    if (::poll(&p, 1, 50) > 0 && ::recv(fd, buf, sizeof buf, 0) <= 0) return;
  }
}

// Listens on 127.0.0.1:0; each accepted connection runs script(fd, index) on its own thread.
class Upstream {
 public:
  using Script = std::function<void(int fd, int index)>;
  explicit Upstream(Script script) : script_(std::move(script)) {
    lfd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::bind(lfd_, reinterpret_cast<sockaddr*>(&a), sizeof a);
    ::listen(lfd_, 16);
    socklen_t len = sizeof a;
    ::getsockname(lfd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    acceptor_ = std::thread([this] {
      for (int i = 0;; ++i) {
        pollfd p{lfd_, POLLIN, 0};
        while (!stop_ && ::poll(&p, 1, 20) <= 0) {
        }
        if (stop_) return;
        const int fd = ::accept(lfd_, nullptr, nullptr);
        if (fd < 0) return;
        int one = 1;
        ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        accepted_ = i + 1;
        std::lock_guard lk(mu_);
        fds_.push_back(fd);
        threads_.emplace_back([this, fd, i] { script_(fd, i); });
      }
    });
  }
  ~Upstream() {
    stop_ = true;
    acceptor_.join();
    {
      std::lock_guard lk(mu_);
      for (int fd : fds_) ::shutdown(fd, SHUT_RDWR);
    }
    for (auto& t : threads_) t.join();
    for (int fd : fds_) ::close(fd);
    ::close(lfd_);
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  int accepted() const { return accepted_; }

 private:
  Script script_;
  int lfd_ = -1;
  std::uint16_t port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<int> accepted_{0};
  std::mutex mu_;
  std::vector<int> fds_;
  std::vector<std::thread> threads_;
  std::thread acceptor_;
};

struct Got {
  CallError error = CallError::kNone;
  int status = 0;
  std::string body;
  bool reused = false;
  double seconds = 0;
};

// One call on `pool` (bound to `ioc`), its body read to the end.
Got call(boost::asio::io_context& ioc, Pool& pool, CallOptions o, std::string_view method = "GET") {
  Got g;
  const auto t0 = Clock::now();
  boost::asio::co_spawn(
      ioc,
      [&]() -> Task<void> {
        auto r = co_await pool.call({method, "/x", nullptr, ""}, o);
        if (!r.ok()) {
          g.error = r.error;
          co_return;
        }
        g.status = r.response->status();
        g.reused = r.response->reused_connection();
        g.error = co_await r.response->read_all(g.body);
      },
      boost::asio::detached);
  ioc.run();
  ioc.restart();
  g.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return g;
}

Pool make_pool(const Upstream& up) {
  std::string err;
  return Pool(*Url::parse(up.url(), err), ClientOptions{});
}

CallOptions quick(double first_byte, double idle, double total = 0) {
  CallOptions o;
  o.first_byte_timeout_s = first_byte;
  o.idle_timeout_s = idle;
  o.total_timeout_s = total;
  return o;
}

TEST(HttpClient, KeepAliveReusesTheConnectionAndConnectionCloseDoesNot) {
  Upstream keep([](int fd, int) {
    while (read_request(fd)) send_all(fd, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok");
  });
  boost::asio::io_context ioc;
  {
    Pool pool = make_pool(keep);
    for (int i = 0; i < 3; ++i) {
      auto g = call(ioc, pool, quick(5, 5, 10));
      EXPECT_EQ(g.error, CallError::kNone) << call_error_name(g.error);
      EXPECT_EQ(g.status, 200);
      EXPECT_EQ(g.body, "ok");
      EXPECT_EQ(g.reused, i > 0) << i;
    }
    EXPECT_EQ(keep.accepted(), 1);
  }
  Upstream closing([](int fd, int) {
    if (read_request(fd)) send_all(fd, "HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 3\r\n\r\nbye");
    wait_for_close(fd);
  });
  {
    Pool pool = make_pool(closing);
    for (int i = 0; i < 2; ++i) {
      auto g = call(ioc, pool, quick(5, 5, 10));
      EXPECT_EQ(g.body, "bye");
      EXPECT_FALSE(g.reused);
    }
    EXPECT_EQ(closing.accepted(), 2);
  }
}

TEST(HttpClient, ChunkedBodiesByteByByteAndBodiesUntilCloseArriveWhole) {
  Upstream up([](int fd, int index) {
    if (!read_request(fd)) return;
    if (index == 0) {
      const std::string msg =
          "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n7\r\n, world\r\n0\r\nX-T: 1\r\n\r\n";
      for (char c : msg) {
        send_all(fd, std::string_view(&c, 1));
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
      while (read_request(fd)) send_all(fd, "HTTP/1.1 204 No Content\r\n\r\n");
    } else {
      send_all(fd, "HTTP/1.1 200 OK\r\n\r\nuntil the end");
      ::shutdown(fd, SHUT_WR);
      wait_for_close(fd);
    }
  });
  boost::asio::io_context ioc;
  Pool pool = make_pool(up);
  auto g = call(ioc, pool, quick(5, 5, 10));
  EXPECT_EQ(g.error, CallError::kNone) << call_error_name(g.error);
  EXPECT_EQ(g.body, "hello, world");
  auto g2 = call(ioc, pool, quick(5, 5, 10));  // the same connection: the chunked message ended cleanly
  EXPECT_EQ(g2.status, 204);
  EXPECT_TRUE(g2.reused);
  pool.close_idle();
  auto g3 = call(ioc, pool, quick(5, 5, 10));  // a new connection, whose body ends at its close
  EXPECT_EQ(g3.error, CallError::kNone) << call_error_name(g3.error);
  EXPECT_EQ(g3.body, "until the end");
  EXPECT_EQ(pool.idle_connections(), 0u);  // a body delimited by the close is not reusable
}

TEST(HttpClient, AStalledBodyEndsInAnIdleTimeout) {
  Upstream up([](int fd, int) {
    if (!read_request(fd)) return;
    send_all(fd, "HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc");
    wait_for_close(fd);
  });
  boost::asio::io_context ioc;
  Pool pool = make_pool(up);
  // The other deadlines are an hour away: only the idle one can end the call.
  auto g = call(ioc, pool, quick(3600, 0.3, 3600));
  EXPECT_EQ(g.error, CallError::kIdleTimeout) << call_error_name(g.error);
  EXPECT_EQ(pool.idle_connections(), 0u);
}

TEST(HttpClient, AnEarlierDeadlineOnAReusedConnectionFiresOnTime) {
  // The first call arms the connection's timer for an hour; the second asks for 0.3 s (a timer
  // left armed for the hour would hold the test until its timeout).
  Upstream up([](int fd, int) {
    if (!read_request(fd)) return;
    send_all(fd, "HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nA");
    if (!read_request(fd)) return;
    wait_for_close(fd);  // never answers the second request
  });
  boost::asio::io_context ioc;
  Pool pool = make_pool(up);
  auto g1 = call(ioc, pool, quick(3600, 3600));
  EXPECT_EQ(g1.body, "A");
  auto g2 = call(ioc, pool, quick(0.3, 3600));
  EXPECT_TRUE(g2.error == CallError::kFirstByteTimeout) << call_error_name(g2.error);
}

TEST(HttpClient, TheFirstByteDeadlineDoesNotEndACallWhoseHeadArrivedInTime) {
  // A 0.2 s first-byte deadline: the head arrives at once, the body after 0.6 s, within the
  // 10 s idle deadline that follows the head. The first-byte deadline must not end the call.
  Upstream up([](int fd, int) {
    if (!read_request(fd)) return;
    send_all(fd, "HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\n");
    std::this_thread::sleep_for(std::chrono::milliseconds(600));
    send_all(fd, "body");
    while (read_request(fd)) send_all(fd, "HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nB");
  });
  boost::asio::io_context ioc;
  Pool pool = make_pool(up);
  auto g = call(ioc, pool, quick(0.2, 10));
  EXPECT_EQ(g.error, CallError::kNone) << call_error_name(g.error);
  EXPECT_EQ(g.body, "body");
  EXPECT_GE(g.seconds, 0.5);
  auto g2 = call(ioc, pool, quick(0.2, 10));  // and the connection is still good
  EXPECT_EQ(g2.body, "B");
  EXPECT_TRUE(g2.reused);
}

TEST(HttpClient, TheTotalTimeoutEndsACallBeforeItsFirstByteTimeout) {
  Upstream up([](int fd, int) {
    if (read_request(fd)) wait_for_close(fd);
  });
  boost::asio::io_context ioc;
  Pool pool = make_pool(up);
  auto g = call(ioc, pool, quick(3600, 3600, 0.3));  // the other deadlines an hour away
  EXPECT_EQ(g.error, CallError::kTotalTimeout) << call_error_name(g.error);
}

TEST(HttpClient, AReusedConnectionResetBeforeTheStatusIsRetriedOnceOnAFreshOne) {
  Upstream up([](int fd, int index) {
    if (!read_request(fd)) return;
    send_all(fd, "HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n" + std::to_string(index));
    if (index == 0) {  // reads the second request and closes without an answer
      if (read_request(fd)) ::shutdown(fd, SHUT_RDWR);
      return;
    }
    while (read_request(fd)) send_all(fd, "HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nr");
  });
  boost::asio::io_context ioc;
  Pool pool = make_pool(up);
  auto g1 = call(ioc, pool, quick(5, 5, 10));
  EXPECT_EQ(g1.body, "0");
  auto g2 = call(ioc, pool, quick(5, 5, 10));
  EXPECT_EQ(g2.error, CallError::kNone) << call_error_name(g2.error);
  EXPECT_EQ(g2.body, "1");
  EXPECT_FALSE(g2.reused);
  EXPECT_EQ(up.accepted(), 2);
}

// A proxy forwards the headers it received without copying them: the head sent leaves out the
// hop-by-hop fields (the fixed ones and those a Connection field lists), Host and Content-Length
// of the given headers (the client writes its own) and the `drop` names in any case, then adds
// `extra`.
TEST(HttpClient, ForwardedHeadersLeaveOutHopByHopDroppedAndFramingFields) {
  std::mutex mu;
  std::string head;
  Upstream up([&](int fd, int) {
    std::string got;
    char c;
    while (got.size() < 4 || got.compare(got.size() - 4, 4, "\r\n\r\n") != 0) {
      if (::recv(fd, &c, 1, 0) != 1) return;
      got.push_back(c);
    }
    std::string body(4, '\0');
    for (char& b : body)
      if (::recv(fd, &b, 1, 0) != 1) return;
    {
      std::lock_guard lk(mu);
      head = got + body;
    }
    send_all(fd, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok");
  });
  Headers in;
  in.add("Host", "client.example");
  in.add("Content-Length", "999");
  in.add("Connection", "keep-alive, X-Secret-Hop");
  in.add("x-secret-hop", "1");
  in.add("Keep-Alive", "timeout=5");
  in.add("Authorization", "Bearer client-key");
  in.add("X-Request-Id", "from-client");
  in.add("Content-Type", "application/json");
  in.add("X-Custom", "kept");
  static constexpr std::string_view drop[] = {"authorization", "x-request-id"};
  const std::pair<std::string_view, std::string_view> extra[] = {{"X-Request-Id", "rid-1"},
                                                                 {"Authorization", "Bearer upstream"}};
  boost::asio::io_context ioc;
  Pool pool = make_pool(up);
  Got g;
  boost::asio::co_spawn(
      ioc,
      [&]() -> Task<void> {
        auto r = co_await pool.call({"POST", "/v1/completions", &in, "body", drop, extra}, quick(5, 5, 10));
        if (!r.ok()) {
          g.error = r.error;
          co_return;
        }
        g.error = co_await r.response->read_all(g.body);
      },
      boost::asio::detached);
  ioc.run();
  ASSERT_EQ(g.error, CallError::kNone) << call_error_name(g.error);
  EXPECT_EQ(g.body, "ok");
  std::lock_guard lk(mu);
  const std::string expected_start = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:";
  EXPECT_EQ(head.compare(0, expected_start.size(), expected_start), 0) << head;
  const auto fields = head.substr(head.find("\r\n", expected_start.size()) + 2);
  EXPECT_EQ(fields,
            "Content-Type: application/json\r\nX-Custom: kept\r\nX-Request-Id: rid-1\r\n"
            "Authorization: Bearer upstream\r\nContent-Length: 4\r\n\r\nbody")
      << head;
}

// Response heads: an interim 103 with a large field before the final answer, a final head past
// the parser's 1 KiB field arena, then a small head on the same connection and thread (the
// recycled Headers must hold exactly its fields, none left from the large one).
TEST(HttpClient, ResponseHeadsLargeAndSmallArriveExactlyAfterAnInterimAnswer) {
  std::string big_head = "HTTP/1.1 103 Early Hints\r\nLink: <" + std::string(1500, 'l') + ">\r\n\r\n" + "HTTP/1.1 200 OK\r\n";
  std::vector<std::pair<std::string, std::string>> big_fields;
  for (int i = 0; i < 40; ++i) {
    big_fields.emplace_back("X-Field-" + std::to_string(i), std::string(40, static_cast<char>('a' + i % 26)));
    big_head += big_fields.back().first + ": " + big_fields.back().second + "\r\n";
  }
  big_head += "Content-Length: 2\r\n\r\nok";
  big_fields.emplace_back("Content-Length", "2");
  Upstream up([&](int fd, int) {
    if (!read_request(fd)) return;
    send_all(fd, big_head);
    if (!read_request(fd)) return;
    send_all(fd, "HTTP/1.1 201 Created\r\nX-A: 1\r\nContent-Length: 3\r\n\r\nabc");
    wait_for_close(fd);
  });
  boost::asio::io_context ioc;
  Pool pool = make_pool(up);
  auto head_of = [&](std::vector<std::pair<std::string, std::string>>& fields, std::string& body) {
    int status = 0;
    boost::asio::co_spawn(
        ioc,
        [&]() -> Task<void> {
          auto r = co_await pool.call({"GET", "/x", nullptr, ""}, quick(5, 5, 10));
          if (!r.ok()) co_return;
          status = r.response->status();
          for (const auto& h : r.response->headers()) fields.emplace_back(h.name, h.value);
          co_await r.response->read_all(body);
        },
        boost::asio::detached);
    ioc.run();
    ioc.restart();
    return status;
  };
  std::vector<std::pair<std::string, std::string>> f1, f2;
  std::string b1, b2;
  EXPECT_EQ(head_of(f1, b1), 200);
  EXPECT_EQ(f1, big_fields);
  EXPECT_EQ(b1, "ok");
  EXPECT_EQ(head_of(f2, b2), 201);
  const std::vector<std::pair<std::string, std::string>> small = {{"X-A", "1"}, {"Content-Length", "3"}};
  EXPECT_EQ(f2, small);
  EXPECT_EQ(b2, "abc");
  EXPECT_EQ(up.accepted(), 1);
}

}  // namespace
}  // namespace lorasync::http
