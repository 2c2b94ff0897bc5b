// libFuzzer: the HTTP/1.1 server (http/server.h) that fronts serve and the proxy, fed raw bytes
// over a real loopback connection: request lines, headers (limits, Expect, Connection, framing),
// bodies (Content-Length, chunked, over the limit), pipelining, truncation. One server for the
// whole run; per input: connect, send, half-close, read until the server closes.
// Checked: the server answers every input with zero or more well-formed status lines and closes
// within 5 s (a hang is a finding), the handler never sees a body over the limit, and the server
// keeps serving (the next input connects). ASan and UBSan watch the session code.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <utility>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "http/server.h"

namespace {

constexpr std::uint64_t kMaxBody = 4096;

lorasync::http::Server& server() {
  static std::unique_ptr<lorasync::http::Server> s = [] {
    lorasync::http::ServerOptions o;
    o.max_header_bytes = 2048;
    o.max_body_bytes = kMaxBody;
    o.client_timeout_s = 2;
    o.idle_timeout_s = 2;
    o.write_timeout_s = 2;
    o.max_connections = 64;
    auto srv = std::make_unique<lorasync::http::Server>(
        o, [](lorasync::http::Request& req, lorasync::http::ResponseWriter& w) -> lorasync::http::Task<void> {
          if (req.body.size() > kMaxBody) std::abort();  // the limit must hold before the handler
          std::string echo = req.method + " " + std::string(req.path()) + "?" + std::string(req.query()) + " " +
                             std::to_string(req.headers.size()) + " " + std::to_string(req.body.size());
          if (req.path() == "/stream") {  // chunked, the SSE way
            lorasync::http::Headers h;
            h.add("Content-Type", "text/event-stream");
            if (!co_await w.start(200, h, std::nullopt)) co_return;
            if (!co_await w.write("data: " + echo + "\n\n")) co_return;
            co_await w.finish();
            co_return;
          }
          co_await w.send(lorasync::http::json_response(200, "{\"echo\":" + std::to_string(echo.size()) + "}"));
        });
    srv->start();
    return srv;
  }();
  return *s;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::uint16_t port = server().port();
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) std::abort();
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  // libFuzzer's watchdog (SIGALRM) interrupts blocking calls: EINTR is retried everywhere.
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    int err = errno;
    if (err == EINTR) {  // the connection goes on in the background: wait for it
      pollfd p{fd, POLLOUT, 0};
      while (::poll(&p, 1, 5000) < 0 && errno == EINTR) {
      }
      socklen_t len = sizeof err;
      getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    }
    if (err != 0) {  // the server must still accept
      std::fprintf(stderr, "connect failed: %s (%zu connections open, %llu refused)\n", std::strerror(err),
                   server().open_connections(), static_cast<unsigned long long>(server().refused_connections()));
      std::abort();
    }
  }
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  std::size_t off = 0;
  while (off < size) {
    const ssize_t n = ::send(fd, data + off, size - off, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // the server closed early (a 413 or 400): fine
    off += static_cast<std::size_t>(n);
  }
  ::shutdown(fd, SHUT_WR);
  std::string got;
  char buf[8192];
  for (;;) {
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n == 0) break;
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) std::abort();  // no close within 5 s: a hang
      break;                                                      // reset: fine
    }
    got.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  // Every answer starts with a status line.
  if (!got.empty() && got.compare(0, 9, "HTTP/1.1 ") != 0) std::abort();
  return 0;
}
