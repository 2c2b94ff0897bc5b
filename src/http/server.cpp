// The server side of src/http (one of the two Beast translation units). Responses are framed by
// hand (status line, headers, Content-Length or chunked), which keeps streaming writes to one
// gather-write per piece and avoids Beast's serializer for bodies we relay.
#include <utility>

#include <sys/socket.h>

#include <algorithm>
#include <cerrno>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>

#include "http/server.h"
#include "util/error.h"
#include "util/log.h"
#include "util/process.h"

namespace lorasync::http {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace bhttp = beast::http;
using tcp = net::ip::tcp;

namespace {

std::chrono::steady_clock::duration secs(double s) {
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(s));
}

struct Session {
  explicit Session(tcp::socket sock) : stream(std::move(sock)) {}
  beast::tcp_stream stream;
  bool busy = false;  // touched on the session's strand only
  bool closed = false;
  void close() {
    if (closed) return;
    closed = true;
    beast::error_code ec;
    stream.socket().shutdown(tcp::socket::shutdown_both, ec);
    stream.socket().close(ec);
  }
};

bool is_framing_header(std::string_view n) {
  return iequals(n, "content-length") || iequals(n, "transfer-encoding") || iequals(n, "connection") ||
         iequals(n, "keep-alive");
}

class Writer final : public ResponseWriter {
 public:
  Writer(Session& s, bool keep_alive, bool head, double write_timeout)
      : s_(s), keep_alive_(keep_alive), head_(head), write_timeout_(write_timeout) {}

  Task<bool> send(Response r) override {
    if (started_) co_return false;
    std::string hdr = header_block(r.status, r.headers, std::to_string(r.body.size()), false);
    std::array<net::const_buffer, 2> bufs{net::buffer(hdr), net::buffer(r.body.data(), head_ ? 0 : r.body.size())};
    started_ = true;
    bool ok = co_await write_bufs(bufs);
    done_ = true;
    co_return ok;
  }

  Task<bool> start(int status, const Headers& headers, std::optional<std::uint64_t> content_length) override {
    if (started_) co_return false;
    chunked_ = !content_length.has_value() && !head_;
    remaining_ = content_length;
    std::string hdr = header_block(status, headers, content_length ? std::to_string(*content_length) : "",
                                   chunked_);
    started_ = true;
    std::array<net::const_buffer, 1> bufs{net::buffer(hdr)};
    co_return co_await write_bufs(bufs);
  }

  Task<bool> write(std::string_view data) override {
    if (!started_ || done_ || close_) co_return false;
    if (data.empty() || head_) co_return true;
    if (chunked_) {
      char prefix[24];
      int n = std::snprintf(prefix, sizeof prefix, "%zx\r\n", data.size());
      std::array<net::const_buffer, 3> bufs{net::buffer(prefix, static_cast<std::size_t>(n)),
                                            net::buffer(data.data(), data.size()), net::buffer("\r\n", 2)};
      co_return co_await write_bufs(bufs);
    }
    if (remaining_) {
      if (data.size() > *remaining_) {
        abort();
        co_return false;
      }
      *remaining_ -= data.size();
    }
    std::array<net::const_buffer, 1> bufs{net::buffer(data.data(), data.size())};
    co_return co_await write_bufs(bufs);
  }

  Task<bool> finish() override {
    if (!started_ || done_ || close_) co_return false;
    done_ = true;
    if (chunked_) {
      std::array<net::const_buffer, 1> bufs{net::buffer("0\r\n\r\n", 5)};
      co_return co_await write_bufs(bufs);
    }
    if (remaining_ && *remaining_ != 0 && !head_) {
      close_ = true;  // short body: never let it look complete
      co_return false;
    }
    co_return true;
  }

  void abort() override { close_ = true; }
  bool started() const override { return started_; }
  CancelSignal& client_gone() override { return gone_; }

  bool done() const { return done_; }
  bool must_close() const { return close_ || !keep_alive_; }
  void set_closing() { keep_alive_ = false; }

 private:
  std::string header_block(int status, const Headers& h, const std::string& content_length, bool chunked) {
    std::string out;
    out.reserve(256);
    out += "HTTP/1.1 ";
    out += std::to_string(status);
    out += ' ';
    out += reason_phrase(status);
    out += "\r\n";
    for (const auto& x : h) {
      if (is_framing_header(x.name)) continue;
      out += x.name;
      out += ": ";
      out += x.value;
      out += "\r\n";
    }
    if (chunked) out += "Transfer-Encoding: chunked\r\n";
    else if (!content_length.empty()) out += "Content-Length: " + content_length + "\r\n";
    if (!keep_alive_) out += "Connection: close\r\n";
    out += "\r\n";
    return out;
  }

  template <typename Bufs>
  Task<bool> write_bufs(const Bufs& bufs) {
    if (close_) co_return false;
    beast::error_code ec;
    s_.stream.expires_after(secs(write_timeout_));
    co_await net::async_write(s_.stream, bufs, net::redirect_error(net::use_awaitable, ec));
    s_.stream.expires_never();
    if (ec) {
      close_ = true;
      gone_.fire();
      co_return false;
    }
    co_return true;
  }

  Session& s_;
  bool keep_alive_;
  bool head_;
  double write_timeout_;
  bool started_ = false, done_ = false, close_ = false, chunked_ = false;
  std::optional<std::uint64_t> remaining_;
  CancelSignal gone_;
};

struct WatchState {
  bool active = true;  // strand-only
};

}  // namespace

class Server::Impl {
 public:
  Impl(ServerOptions o, Handler h) : opts(std::move(o)), handler(std::move(h)), work(net::make_work_guard(ioc)) {}

  ServerOptions opts;
  Handler handler;
  net::io_context ioc;
  net::executor_work_guard<net::io_context::executor_type> work;
  std::optional<tcp::acceptor> acceptor;
  std::vector<std::thread> threads;
  std::uint16_t bound_port = 0;

  std::mutex mu;
  std::condition_variable cv;
  std::map<std::uint64_t, std::weak_ptr<Session>> sessions;
  std::uint64_t next_id = 0;
  std::atomic<int> active{0};
  std::atomic<bool> stopping{false};
  std::size_t conn_cap = 0;  // set by start()
  std::atomic<std::uint64_t> refused{0};
  std::chrono::steady_clock::time_point last_accept_warning{};
  bool stop_started = false, stopped = false;

  void for_each_session(const std::function<void(std::shared_ptr<Session>)>& f) {
    std::vector<std::shared_ptr<Session>> live;
    {
      std::lock_guard lk(mu);
      for (auto& [id, w] : sessions)
        if (auto s = w.lock()) live.push_back(std::move(s));
    }
    for (auto& s : live) f(s);
  }

  net::awaitable<void> accept_loop() {
    for (;;) {
      beast::error_code ec;
      tcp::socket sock =
          co_await acceptor->async_accept(net::make_strand(ioc), net::redirect_error(net::use_awaitable, ec));
      if (stopping.load()) co_return;
      if (ec) {
        if (ec == net::error::operation_aborted) co_return;
        // Out of descriptors (EMFILE/ENFILE) and the like: the connection stays in the backlog;
        // retry shortly, and say so at most once a second.
        const auto now = std::chrono::steady_clock::now();
        if (now - last_accept_warning > std::chrono::seconds(1)) {
          last_accept_warning = now;
          LS_LOG_WARN("http", "accept failed: {} ({} connections open)", ec.message(), open_connections());
        }
        net::steady_timer t(ioc, std::chrono::milliseconds(50));
        co_await t.async_wait(net::redirect_error(net::use_awaitable, ec));
        continue;
      }
      sock.set_option(tcp::no_delay(true), ec);
      auto s = std::make_shared<Session>(std::move(sock));
      std::uint64_t id = 0;
      bool full = false;
      {
        std::lock_guard lk(mu);
        full = sessions.size() >= conn_cap;
        if (!full) {
          id = ++next_id;
          sessions[id] = s;
        }
      }
      if (full) {
        refused.fetch_add(1);
        net::co_spawn(s->stream.get_executor(), refuse(s), net::detached);
        continue;
      }
      { beast::error_code e2; auto ep = s->stream.socket().remote_endpoint(e2); LS_LOG_DEBUG("http", "accepted {} port {}", id, ep.port()); }
      net::co_spawn(s->stream.get_executor(), run_session(s, id), net::detached);
    }
  }

  std::size_t open_connections() {
    std::lock_guard lk(mu);
    return sessions.size();
  }

  // At the connection cap: a canned 503 (the client learns why and when to retry; a proxy retries
  // elsewhere), then close. Written without reading the request; bounded by a 2 s timeout.
  net::awaitable<void> refuse(std::shared_ptr<Session> s) {
    static const std::string kBody = openai_error_json(503, "server at its connection limit; retry shortly");
    static const std::string kReply = std::string("HTTP/1.1 503 ") + reason_phrase(503) +
                                      "\r\nContent-Type: application/json\r\nRetry-After: 1\r\nConnection: close\r\n"
                                      "Content-Length: " + std::to_string(kBody.size()) + "\r\n\r\n" + kBody;
    beast::error_code ec;
    s->stream.expires_after(std::chrono::seconds(2));
    co_await net::async_write(s->stream, net::buffer(kReply), net::redirect_error(net::use_awaitable, ec));
    s->stream.socket().shutdown(tcp::socket::shutdown_send, ec);
    // Let the client read the answer before the close (a reset could discard it): wait briefly
    // for its end of stream, reading and discarding what it sent.
    char buf[4096];
    for (int i = 0; i < 64 && !ec; ++i)
      co_await s->stream.async_read_some(net::buffer(buf), net::redirect_error(net::use_awaitable, ec));
    s->close();
  }

  net::awaitable<void> watch(std::shared_ptr<Session> s, std::shared_ptr<WatchState> ws, Writer* w) {
    for (;;) {
      beast::error_code ec;
      co_await s->stream.socket().async_wait(tcp::socket::wait_read, net::redirect_error(net::use_awaitable, ec));
      if (!ws->active) co_return;
      if (ec) {
        if (ec != net::error::operation_aborted) w->client_gone().fire();
        co_return;
      }
      // Never block the strand here: readiness can be spurious, and a blocking peek would hold
      // this connection's strand (and the handler's wake-ups) until the client sends or leaves.
      // (Asio's synchronous receive polls until data arrives on a blocking-mode socket, so the
      // peek goes to the OS directly.)
      char c;
      const ssize_t n = ::recv(s->stream.socket().native_handle(), &c, 1, MSG_PEEK | MSG_DONTWAIT);
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
      if (n <= 0) w->client_gone().fire();
      // Otherwise the client pipelined its next request: stop watching.
      co_return;
    }
  }

  // Answers and closes. Lingering close: the client may still be sending a body we refused (413);
  // closing a socket with unread input sends a reset that can destroy the answer before the client
  // reads it, so stop sending, then read and discard what arrives (bounded in bytes and time).
  net::awaitable<void> reply_and_close(std::shared_ptr<Session> s, int status, std::string_view msg,
                                       bool retry_after = false) {
    Writer w(*s, false, false, opts.write_timeout_s);
    Response r = error_response(status, msg);
    if (retry_after) r.headers.add("Retry-After", "1");
    if (!co_await w.send(std::move(r))) co_return;
    beast::error_code ec;
    s->stream.socket().shutdown(tcp::socket::shutdown_send, ec);
    s->stream.expires_after(secs(kLingerSeconds));
    std::array<char, 16384> sink;
    std::uint64_t drained = 0;
    while (!ec && drained < kLingerBytes) {
      std::size_t n = co_await s->stream.async_read_some(net::buffer(sink), net::redirect_error(net::use_awaitable, ec));
      drained += n;
    }
  }
  static constexpr double kLingerSeconds = 2;
  static constexpr std::uint64_t kLingerBytes = 128ull << 20;

  net::awaitable<void> run_session(std::shared_ptr<Session> s, std::uint64_t id) {
    beast::flat_buffer buf;
    std::string remote;
    {
      beast::error_code ec;
      auto ep = s->stream.socket().remote_endpoint(ec);
      if (!ec) remote = ep.address().to_string() + ":" + std::to_string(ep.port());
    }
    LS_LOG_DEBUG("http", "session {} started", id);
    try {
      for (;;) {
        beast::error_code ec;
        if (buf.size() == 0) {
          s->stream.expires_after(secs(opts.idle_timeout_s));
          std::size_t n = co_await s->stream.async_read_some(buf.prepare(8192), net::redirect_error(net::use_awaitable, ec));
          if (ec) break;
          buf.commit(n);
        }
        if (s->closed) break;
        // A request that reached a keep-alive connection during shutdown gets an answer (503,
        // Connection: close, Retry-After) rather than a silent close the client cannot tell apart
        // from a failure.
        const bool refuse = stopping.load();
        s->busy = true;
        bhttp::request_parser<bhttp::string_body> parser;
        parser.header_limit(static_cast<std::uint32_t>(opts.max_header_bytes));
        // The largest limit while the header is read (Beast checks Content-Length against it
        // there), then the route's own.
        std::uint64_t body_limit = opts.max_body_bytes;
        for (const auto& [p, lim] : opts.route_body_limits) body_limit = std::max(body_limit, lim);
        parser.body_limit(body_limit);
        s->stream.expires_after(secs(opts.client_timeout_s));
        co_await bhttp::async_read_header(s->stream, buf, parser, net::redirect_error(net::use_awaitable, ec));
        if (!ec && !opts.route_body_limits.empty()) {
          const std::string_view target(parser.get().target().data(), parser.get().target().size());
          const std::string_view rpath = target.substr(0, target.find('?'));
          body_limit = opts.max_body_bytes;
          for (const auto& [p, lim] : opts.route_body_limits)
            if (rpath == p) body_limit = lim;
          const auto declared = parser.content_length();
          if (declared && *declared > body_limit) ec = bhttp::error::body_limit;
          else parser.body_limit(body_limit);
        }
        if (!ec && !parser.is_done()) {
          auto expect = parser.get().find(bhttp::field::expect);
          if (expect != parser.get().end() && iequals(std::string_view(expect->value().data(), expect->value().size()), "100-continue")) {
            co_await net::async_write(s->stream, net::buffer("HTTP/1.1 100 Continue\r\n\r\n", 25),
                                      net::redirect_error(net::use_awaitable, ec));
          }
          if (!ec) co_await bhttp::async_read(s->stream, buf, parser, net::redirect_error(net::use_awaitable, ec));
        }
        if (ec) {
          if (ec == bhttp::error::header_limit) {
            co_await reply_and_close(s, 431, "request headers exceed the limit");
          } else if (ec == bhttp::error::body_limit) {
            std::string msg = "request body exceeds " + std::to_string(body_limit) + " bytes";
            co_await reply_and_close(s, 413, msg);
          } else if (ec == beast::error::timeout) {
            co_await reply_and_close(s, 408, "request not received within the client timeout");
          } else if (ec != bhttp::error::end_of_stream && ec != bhttp::error::partial_message &&
                     ec != net::error::eof && ec != net::error::connection_reset &&
                     ec != net::error::operation_aborted) {
            std::string msg = "malformed HTTP request: " + ec.message();
            co_await reply_and_close(s, 400, msg);
          }
          break;
        }
        s->stream.expires_never();
        if (refuse) {
          co_await reply_and_close(s, 503, "the server is shutting down; retry on another replica", true);
          break;
        }
        LS_LOG_DEBUG("http", "session {} read request", id);
        auto& msg = parser.get();
        Request req;
        req.method = std::string(msg.method_string());
        req.target = std::string(msg.target());
        for (const auto& f : msg) req.headers.add(std::string(f.name_string()), std::string(f.value()));
        req.body = std::move(msg.body());
        req.remote = remote;
        const bool keep_alive = msg.keep_alive() && !stopping.load();
        Writer w(*s, keep_alive, req.method == "HEAD", opts.write_timeout_s);
        auto ws = std::make_shared<WatchState>();
        active.fetch_add(1);
        net::co_spawn(s->stream.get_executor(), watch(s, ws, &w), net::detached);
        std::string failure;
        try {
          co_await handler(req, w);
        } catch (const std::exception& e) {
          failure = e.what();
        }
        if (!failure.empty() || !w.done()) {
          if (!failure.empty()) LS_LOG_ERROR("http", "handler failed on {} {}: {}", req.method, req.target, failure);
          // (No conditional expressions inside co_await arguments: g++ 12 double-destroys them.)
          std::string what = "internal error: ";
          what += failure.empty() ? std::string("handler produced no response") : failure;
          Response r = error_response(500, what);
          if (!w.started()) co_await w.send(std::move(r));
          else if (!w.done()) w.abort();
        }
        ws->active = false;
        s->stream.socket().cancel(ec);
        s->busy = false;
        if (active.fetch_sub(1) == 1) {
          std::lock_guard lk(mu);
          cv.notify_all();
        }
        if (w.must_close() || stopping.load()) break;
      }
    } catch (const std::exception& e) {
      LS_LOG_DEBUG("http", "session ended: {}", e.what());
    }
    s->close();
    std::lock_guard lk(mu);
    sessions.erase(id);
    cv.notify_all();
  }
};

Server::Server(ServerOptions options, Handler handler)
    : impl_(std::make_unique<Impl>(std::move(options), std::move(handler))) {}

Server::~Server() {
  if (impl_ && !impl_->threads.empty()) stop(0);
}

void Server::start() {
  auto& I = *impl_;
  beast::error_code ec;
  auto addr = net::ip::make_address(I.opts.host, ec);
  if (ec) throw Error(ErrorKind::kInvalidInput, "bad listen address '" + I.opts.host + "': " + ec.message());
  tcp::endpoint ep(addr, I.opts.port);
  I.acceptor.emplace(I.ioc);
  I.acceptor->open(ep.protocol(), ec);
  if (!ec) I.acceptor->set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) I.acceptor->bind(ep, ec);
  if (!ec) I.acceptor->listen(net::socket_base::max_listen_connections, ec);
  if (ec) throw_env("cannot listen on {}:{}: {}", I.opts.host, I.opts.port, ec.message());
  I.bound_port = I.acceptor->local_endpoint().port();
  I.conn_cap = I.opts.max_connections ? I.opts.max_connections : connection_budget();
  net::co_spawn(I.ioc, I.accept_loop(), net::detached);
  int n = std::max(1, I.opts.threads);
  for (int i = 0; i < n; ++i)
    I.threads.emplace_back([&I] {
      try {
        I.ioc.run();
      } catch (const std::exception& e) {
        LS_LOG_ERROR("http", "io thread failed: {}", e.what());
      }
    });
}

std::uint16_t Server::port() const { return impl_->bound_port; }
std::size_t Server::open_connections() const { return impl_->open_connections(); }
std::size_t Server::max_connections() const { return impl_->conn_cap; }
std::uint64_t Server::refused_connections() const { return impl_->refused.load(); }
int Server::active_requests() const { return impl_->active.load(); }
boost::asio::io_context& Server::io() { return impl_->ioc; }

void Server::spawn(std::function<Task<void>()> fn) {
  net::co_spawn(net::make_strand(impl_->ioc),
                [fn = std::move(fn)]() -> net::awaitable<void> {
                  try {
                    co_await fn();
                  } catch (const std::exception& e) {
                    LS_LOG_ERROR("http", "background task failed: {}", e.what());
                  }
                },
                net::detached);
}

void Server::stop(double grace_s) {
  auto& I = *impl_;
  {
    std::unique_lock lk(I.mu);
    if (I.stop_started) {
      I.cv.wait(lk, [&] { return I.stopped; });
      return;
    }
    I.stop_started = true;
  }
  I.stopping.store(true);
  net::post(I.ioc, [&I] {
    beast::error_code ec;
    if (I.acceptor) I.acceptor->close(ec);
  });
  // Idle keep-alive connections stay open while in-flight requests finish: a request that
  // arrives on one now is answered 503 (Connection: close, Retry-After) instead of meeting a close
  // that races with it and looks like a failed replica. All close when the grace period ends.
  {
    std::unique_lock lk(I.mu);
    I.cv.wait_for(lk, std::chrono::duration<double>(grace_s), [&] { return I.active.load() == 0; });
  }
  I.for_each_session([](std::shared_ptr<Session> s) { net::post(s->stream.get_executor(), [s] { s->close(); }); });
  I.work.reset();
  I.ioc.stop();
  for (auto& t : I.threads)
    if (t.joinable()) t.join();
  I.threads.clear();
  std::lock_guard lk(I.mu);
  I.stopped = true;
  I.cv.notify_all();
}

void Server::wait() {
  auto& I = *impl_;
  std::unique_lock lk(I.mu);
  I.cv.wait(lk, [&] { return I.stopped; });
}

}  // namespace lorasync::http
