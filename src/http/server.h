// http/server.h: an HTTP/1.1 server on Boost.Beast/Asio with C++20 coroutines.
//
// Thread model: one io_context run by `threads` threads. Each accepted connection is one coroutine
// on its own strand (with one thread, on the io_context's executor: the thread serialises it
// already); its handler calls and every client call the handler makes run on that executor.
// Keep-alive: requests on a connection are served one after another.
// Framing: our own strict HTTP/1.1 request parser (http/parse.h: what is refused, with which status).
// Limits: headers > max_header_bytes -> 431; body > max_body_bytes -> 413 as soon as
// Content-Length or the bytes read exceed it (then the connection closes). A request's headers and
// body must arrive within client_timeout (else 408); an idle keep-alive connection closes after
// idle_timeout. Timeouts are enforced by one sweeper per server, so they fire up to one tick late
// (an eighth of the shortest timeout, 5-250 ms).
// Connections: at most max_connections open; past it a new one is answered 503 and closed. An
// accept that fails (out of descriptors) is retried after 50 ms, logged at most once a second.
// Client disconnect: every connection is in an epoll set of the server's (EPOLLRDHUP only, so no
// system call per request); the peer closing or resetting while the handler runs (also before any
// response byte) fires ResponseWriter::client_gone().
// Shutdown: stop() closes the acceptor and idle connections, lets running requests finish (their
// connections then close) for up to `grace` seconds, then closes everything and joins the threads.
// A server may instead run on an io_context of the caller's (ServerOptions::io), shared with other
// servers on one thread.
// Thread-safety: Server members are thread-safe; a ResponseWriter belongs to its handler call.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "http/async.h"
#include "http/cancel.h"
#include "http/http.h"

namespace boost::asio {
class io_context;
}

namespace lorasync::http {

struct ServerOptions {
  std::string host = "127.0.0.1";                // listen address
  std::uint16_t port = 0;                        // 0: any free port (see Server::port())
  int threads = 1;                               // io_context threads
  // Not null: the server runs on this io_context instead of its own. The caller runs it on one
  // thread (`threads` must be 1), calls stop() while that thread still runs it, then stops it,
  // joins the thread and destroys the io_context before destroying the Server (its pending
  // handlers refer to the server). Several servers then share one thread, which serves their
  // events in the order they come (bench::StubFleet).
  boost::asio::io_context* io = nullptr;
  std::size_t max_header_bytes = 64 * 1024;      // 431 beyond
  std::uint64_t max_body_bytes = 64ull << 20;    // 413 beyond
  // Paths (no query) whose body limit is another (an adapter push: larger than any JSON body).
  std::vector<std::pair<std::string, std::uint64_t>> route_body_limits;
  double client_timeout_s = 60;                  // headers + body of one request
  double idle_timeout_s = 75;                    // idle keep-alive connection
  double write_timeout_s = 60;                   // one write to a client that stopped reading
  // Open connections at most; past it a new connection gets 503 (Retry-After: 1,
  // Connection: close) and is closed, instead of the process running out of descriptors.
  // 0: util connection_budget(), from the open-file limit.
  std::size_t max_connections = 0;
};

// How a handler answers. Either send() once, or start() + write()* + finish(). Writes return
// false when the client is gone (then stop producing). abort() closes the connection without a
// valid end of body (so a truncated stream never looks complete).
class ResponseWriter {
 public:
  virtual ~ResponseWriter() = default;
  virtual Task<bool> send(Response response) = 0;
  // Headers now; body framed by `content_length` if given, else chunked (SSE works either way).
  // `headers` are copied before start() first suspends (a caller may reuse them once co_await
  // returns, or pass scratch headers another coroutine of this thread will overwrite later).
  virtual Task<bool> start(int status, const Headers& headers,
                           std::optional<std::uint64_t> content_length) = 0;
  virtual Task<bool> write(std::string_view data) = 0;
  virtual Task<bool> finish() = 0;
  virtual void abort() = 0;
  virtual bool started() const = 0;          // any response byte went out
  virtual CancelSignal& client_gone() = 0;   // fires when the client disconnects
};

// The request is owned by the server for the duration of the call; the handler may move its body.
using Handler = std::function<Task<void>(Request&, ResponseWriter&)>;

class Server {
 public:
  Server(ServerOptions options, Handler handler);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds and listens (Environment error on failure), then starts the threads.
  void start();
  std::uint16_t port() const;
  // Graceful stop (idempotent); returns when the threads have exited.
  void stop(double grace_s);
  // Blocks until stop() finished (from another thread or a signal handler thread).
  void wait();
  // Requests being handled now.
  int active_requests() const;
  // Open connections now; the cap in force (after start()); connections refused at the cap.
  std::size_t open_connections() const;
  std::size_t max_connections() const;
  std::uint64_t refused_connections() const;

  // The server's io_context, e.g. to co_spawn background coroutines (probes).
  boost::asio::io_context& io();
  // co_spawns `fn` on a new strand of the server's io_context (exceptions are logged).
  void spawn(std::function<Task<void>()> fn);

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace lorasync::http
