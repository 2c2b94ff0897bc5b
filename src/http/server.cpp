// The server side of src/http, on plain Asio sockets. Requests are framed by http/parse.h (our
// parser: views into a per-connection buffer that is reused from request to request, so a
// keep-alive request allocates only what the handler keeps); responses are framed by hand (status
// line, headers, Content-Length or chunked), each piece one gather-write. Timeouts are deadlines
// in the session, checked by one sweeper timer for the whole server instead of a timer armed and
// cancelled around every read and write.
#include <utility>

#include <sys/epoll.h>
#include <sys/socket.h>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <future>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "http/parse.h"
#include "http/server.h"
#include "util/error.h"
#include "util/log.h"
#include "util/process.h"

namespace lorasync::http {

namespace net = boost::asio;
using tcp = net::ip::tcp;
using error_code = boost::system::error_code;

namespace {

using Clock = std::chrono::steady_clock;
constexpr std::int64_t kNoDeadline = std::numeric_limits<std::int64_t>::max();
constexpr std::size_t kReadChunk = 16 * 1024;

std::int64_t now_ticks() { return Clock::now().time_since_epoch().count(); }
std::int64_t after(double s) {
  return now_ticks() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s)).count();
}

// Bytes read from the connection and not yet consumed (the rest of a head, a pipelined request).
class InBuf {
 public:
  std::string_view view() const { return {data_.get() + begin_, end_ - begin_}; }
  std::size_t size() const { return end_ - begin_; }
  void consume(std::size_t n) {
    begin_ += n;
    if (begin_ == end_) begin_ = end_ = 0;
  }
  // At least `n` writable bytes after the data (compacting, then growing).
  net::mutable_buffer prepare(std::size_t n) {
    if (cap_ - end_ < n) {
      const std::size_t have = end_ - begin_;
      if (cap_ - have >= n && begin_ > 0) {
        std::memmove(data_.get(), data_.get() + begin_, have);
      } else {
        const std::size_t cap = std::max(cap_ * 2, have + n);
        auto next = std::make_unique_for_overwrite<char[]>(cap);
        if (have) std::memcpy(next.get(), data_.get() + begin_, have);
        data_ = std::move(next);
        cap_ = cap;
      }
      begin_ = 0;
      end_ = have;
    }
    return net::buffer(data_.get() + end_, n);
  }
  void commit(std::size_t n) { end_ += n; }
  // A connection kept alive after one large head should not keep its buffer forever.
  void shrink() {
    if (begin_ == end_ && cap_ > 4 * kReadChunk) {
      data_.reset();
      cap_ = begin_ = end_ = 0;
    }
  }

 private:
  std::unique_ptr<char[]> data_;
  std::size_t cap_ = 0, begin_ = 0, end_ = 0;
};

class Writer;

struct Session {
  explicit Session(tcp::socket s) : sock(std::move(s)) {}
  tcp::socket sock;
  // The deadline of the read or write in progress (steady-clock ticks), set on the session's
  // strand and read by the sweeper, which cancels the operation once it has passed.
  std::atomic<std::int64_t> deadline{kNoDeadline};
  bool timed_out = false;  // strand-only: the pending operation was cancelled by its deadline
  bool busy = false;       // strand-only
  bool closed = false;
  // Strand-only. The writer of the handler running (null between requests), and whether the
  // hang-up watch has seen the peer close its side or the connection fail.
  Writer* active_writer = nullptr;
  bool peer_gone = false;
  InBuf in;
  void arm(double seconds) { deadline.store(after(seconds), std::memory_order_relaxed); }
  void disarm() { deadline.store(kNoDeadline, std::memory_order_relaxed); }
  void close() {
    if (closed) return;
    closed = true;
    error_code ec;
    sock.shutdown(tcp::socket::shutdown_both, ec);
    sock.close(ec);
  }
};

bool is_framing_header(std::string_view n) {
  return iequals(n, "content-length") || iequals(n, "transfer-encoding") || iequals(n, "connection") ||
         iequals(n, "keep-alive");
}

class Writer final : public ResponseWriter {
 public:
  // `head_buf`: where the response head is built (the session's, reused across its responses).
  Writer(Session& s, bool keep_alive, bool head, double write_timeout, std::string& head_buf)
      : s_(s), keep_alive_(keep_alive), head_(head), write_timeout_(write_timeout), pending_(head_buf) {
    pending_.clear();
  }

  Task<bool> send(Response r) override {
    if (started_) co_return false;
    header_block(r.status, r.headers, r.body.size(), false);
    std::array<net::const_buffer, 2> bufs{net::buffer(pending_), net::buffer(r.body.data(), head_ ? 0 : r.body.size())};
    started_ = true;
    bool ok = co_await write_bufs(bufs);
    pending_.clear();
    done_ = true;
    co_return ok;
  }

  // A response with a Content-Length keeps its header until the first piece of the body (or
  // finish), so both leave in one write: one segment and one wake-up of the client fewer.
  // A chunked response (a stream: SSE) sends its header at once.
  Task<bool> start(int status, const Headers& headers, std::optional<std::uint64_t> content_length) override {
    if (started_) co_return false;
    chunked_ = !content_length.has_value() && !head_;
    remaining_ = content_length;
    header_block(status, headers, content_length.value_or(0), chunked_);
    started_ = true;
    if (!chunked_) co_return true;
    std::array<net::const_buffer, 1> bufs{net::buffer(pending_)};
    bool ok = co_await write_bufs(bufs);
    pending_.clear();
    co_return ok;
  }

  Task<bool> write(std::string_view data) override {
    if (!started_ || done_ || close_) co_return false;
    if (data.empty() || head_) co_return true;
    if (chunked_) {
      char prefix[24];
      char* end = std::to_chars(prefix, prefix + 20, data.size(), 16).ptr;
      *end++ = '\r';
      *end++ = '\n';
      std::array<net::const_buffer, 3> bufs{net::buffer(prefix, static_cast<std::size_t>(end - prefix)),
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
    std::array<net::const_buffer, 2> bufs{net::buffer(pending_), net::buffer(data.data(), data.size())};
    bool ok = co_await write_bufs(bufs);
    pending_.clear();
    co_return ok;
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
    if (!pending_.empty()) {  // no body (or HEAD): the header alone
      std::array<net::const_buffer, 1> bufs{net::buffer(pending_)};
      bool ok = co_await write_bufs(bufs);
      pending_.clear();
      co_return ok;
    }
    co_return true;
  }

  void abort() override { close_ = true; }
  bool started() const override { return started_; }
  CancelSignal& client_gone() override { return gone_; }

  bool done() const { return done_; }
  bool must_close() const { return close_ || !keep_alive_; }

 private:
  void header_block(int status, const Headers& h, std::uint64_t content_length, bool chunked) {
    std::string& out = pending_;
    out.clear();
    out += "HTTP/1.1 ";
    char num[24];
    out.append(num, std::to_chars(num, num + sizeof num, status).ptr);
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
    if (chunked) {
      out += "Transfer-Encoding: chunked\r\n";
    } else {
      out += "Content-Length: ";
      out.append(num, std::to_chars(num, num + sizeof num, content_length).ptr);
      out += "\r\n";
    }
    if (!keep_alive_) out += "Connection: close\r\n";
    out += "\r\n";
  }

  template <typename Bufs>
  Task<bool> write_bufs(const Bufs& bufs) {
    if (close_) co_return false;
    error_code ec;
    s_.arm(write_timeout_);
    co_await net::async_write(s_.sock, bufs, net::redirect_error(net::use_awaitable, ec));
    s_.disarm();
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
  std::string& pending_;  // the response head not yet written
  CancelSignal gone_;
};

}  // namespace

class Server::Impl {
 public:
  Impl(ServerOptions o, Handler h)
      : opts(std::move(o)),
        handler(std::move(h)),
        ioc(opts.io ? *opts.io : own_ioc.emplace(opts.threads <= 1 ? 1 : BOOST_ASIO_CONCURRENCY_HINT_DEFAULT)),
        work(net::make_work_guard(ioc)) {
    if (opts.io && opts.threads != 1)
      throw Error(ErrorKind::kInvalidInput, "a server on the caller's io_context has one thread (threads = 1)");
  }

  ServerOptions opts;
  Handler handler;
  std::optional<net::io_context> own_ioc;  // unless opts.io
  net::io_context& ioc;
  net::executor_work_guard<net::io_context::executor_type> work;
  std::optional<tcp::acceptor> acceptor;
  std::vector<std::thread> threads;
  std::uint16_t bound_port = 0;
  Clock::duration sweep_tick{};

  std::mutex mu;
  std::condition_variable cv;
  std::map<std::uint64_t, std::weak_ptr<Session>> sessions;
  std::uint64_t next_id = 0;
  std::atomic<int> active{0};
  std::atomic<bool> stopping{false};
  std::size_t conn_cap = 0;  // set by start()
  std::atomic<std::uint64_t> refused{0};
  std::chrono::steady_clock::time_point last_accept_warning{};
  // The hang-up watch's epoll set (hup_wait), on a strand of its own; reset by stop() under `mu`.
  std::optional<net::posix::stream_descriptor> hup;
  std::shared_ptr<bool> hup_live = std::make_shared<bool>(true);  // false once stop() closed it (its strand)
  std::chrono::steady_clock::time_point last_hup_warning{};  // under `mu`
  bool stop_started = false, stopped = false;

  void for_each_session(const std::function<void(std::shared_ptr<Session>)>& f) {
    std::vector<std::shared_ptr<Session>> live;
    {
      std::lock_guard lk(mu);
      live.reserve(sessions.size());
      for (auto& [id, w] : sessions)
        if (auto s = w.lock()) live.push_back(std::move(s));
    }
    for (auto& s : live) f(s);
  }

  // Every tick: cancels the pending operation of each session past its deadline (on the
  // session's strand, where the deadline is checked again: the operation may have finished).
  net::awaitable<void> sweep_loop() {
    net::steady_timer t(ioc);
    for (;;) {
      error_code ec;
      t.expires_after(sweep_tick);
      co_await t.async_wait(net::redirect_error(net::use_awaitable, ec));
      if (ec) co_return;
      const std::int64_t now = now_ticks();
      for_each_session([now](std::shared_ptr<Session> s) {
        if (s->deadline.load(std::memory_order_relaxed) > now) return;
        net::post(s->sock.get_executor(), [s] {
          if (s->closed || s->deadline.load(std::memory_order_relaxed) > now_ticks()) return;
          s->timed_out = true;
          s->disarm();
          error_code e;
          s->sock.cancel(e);
        });
      });
    }
  }

  // A connection's executor. With several I/O threads, a strand per connection. With one, the
  // io_context's own executor: the thread already serialises everything, and a strand, too large
  // for any_io_executor's inline storage, cost a heap allocation (and a reference count) at each
  // of the twenty or so executor conversions of a proxied request.
  net::any_io_executor connection_executor() {
    if (opts.threads <= 1) return ioc.get_executor();
    return net::make_strand(ioc);
  }

  net::awaitable<void> accept_loop() {
    for (;;) {
      error_code ec;
      tcp::socket sock =
          co_await acceptor->async_accept(connection_executor(), net::redirect_error(net::use_awaitable, ec));
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
          hup_add(*s, id);
        }
      }
      if (full) {
        refused.fetch_add(1);
        net::co_spawn(s->sock.get_executor(), refuse(s), net::detached);
        continue;
      }
      net::co_spawn(s->sock.get_executor(), run_session(s, id), net::detached);
    }
  }

  std::size_t open_connections() {
    std::lock_guard lk(mu);
    return sessions.size();
  }

  // At the connection cap: a canned 503 (the client learns why and when to retry; a proxy retries
  // elsewhere), then close. Written without reading the request; bounded by a 2 s timer (the
  // session is not in the sweeper's list).
  net::awaitable<void> refuse(std::shared_ptr<Session> s) {
    static const std::string kBody = openai_error_json(503, "server at its connection limit; retry shortly");
    static const std::string kReply = std::string("HTTP/1.1 503 ") + reason_phrase(503) +
                                      "\r\nContent-Type: application/json\r\nRetry-After: 1\r\nConnection: close\r\n"
                                      "Content-Length: " + std::to_string(kBody.size()) + "\r\n\r\n" + kBody;
    net::steady_timer limit(s->sock.get_executor(), std::chrono::seconds(2));
    limit.async_wait([s](const error_code& e) {
      if (!e) s->close();
    });
    error_code ec;
    co_await net::async_write(s->sock, net::buffer(kReply), net::redirect_error(net::use_awaitable, ec));
    s->sock.shutdown(tcp::socket::shutdown_send, ec);
    // Let the client read the answer before the close (a reset could discard it): wait briefly
    // for its end of stream, reading and discarding what it sent.
    char buf[4096];
    for (int i = 0; i < 64 && !ec; ++i)
      co_await s->sock.async_read_some(net::buffer(buf), net::redirect_error(net::use_awaitable, ec));
    limit.cancel();
    s->close();
  }

  // The hang-up watch: notices a client leaving while its handler runs, without a system call per
  // request. Every connection is added once, when accepted, to an epoll set of the server's own
  // with EPOLLRDHUP alone, edge-triggered (errors and hang-ups are always reported): arriving
  // data does not wake it, the peer's FIN or reset does. That set's descriptor is waited on
  // through the io_context; a closed socket leaves the set by itself. (A one-byte peeking receive
  // per request did this before: a receive that failed with EAGAIN on every request, an
  // operation allocated and a cancellation, about 4 % of the proxy's CPU per request.)
  // Events name the session by id; the session's strand then fires the running handler's
  // client_gone() or, between requests, leaves it to the session's next read, which sees the end
  // of stream itself (Asio's own registration of the socket gets its edge).
  void hup_wait() {
    hup->async_wait(net::posix::stream_descriptor::wait_read, [this, live = hup_live](const error_code& ec) {
      // Closed or reset by stop(), on this strand: a wait that had completed before may still run
      // after it (the server may be gone by then), so `live` is read before anything of the server.
      if (ec || !*live) return;
      // Re-armed before draining: with several I/O threads, a hang-up arriving between the last
      // drain and a later re-arm could have its edge taken by another thread's reactor with no
      // wait queued, and be seen only at the next hang-up. (A wake that finds nothing is harmless.)
      hup_wait();
      epoll_event evs[64];
      for (;;) {
        const int n = ::epoll_wait(hup->native_handle(), evs, 64, 0);
        for (int i = 0; i < n; ++i) hup_seen(evs[i].data.u64);
        if (n < 64) break;
      }
    });
  }

  void hup_seen(std::uint64_t id) {
    std::shared_ptr<Session> s;
    {
      std::lock_guard lk(mu);
      auto it = sessions.find(id);
      if (it != sessions.end()) s = it->second.lock();
    }
    if (!s) return;
    net::post(s->sock.get_executor(), [s] {
      if (s->closed || s->peer_gone) return;
      s->peer_gone = true;
      if (s->active_writer) s->active_writer->client_gone().fire();
    });
  }

  // Under `mu`, with the session just entered in `sessions`.
  void hup_add(Session& s, std::uint64_t id) {
    if (!hup) return;  // stopping
    epoll_event ev{};
    ev.events = EPOLLRDHUP | EPOLLET;
    ev.data.u64 = id;
    if (::epoll_ctl(hup->native_handle(), EPOLL_CTL_ADD, s.sock.native_handle(), &ev) != 0) {
      const auto now = std::chrono::steady_clock::now();
      if (now - last_hup_warning > std::chrono::seconds(1)) {
        last_hup_warning = now;
        LS_LOG_WARN("http", "cannot watch connection {} for hang-ups ({}): a client leaving mid-request goes unnoticed",
                    id, std::strerror(errno));
      }
    }
  }

  // Answers and closes. Lingering close: the client may still be sending a body we refused (413);
  // closing a socket with unread input sends a reset that can destroy the answer before the client
  // reads it, so stop sending, then read and discard what arrives (bounded in bytes and time).
  net::awaitable<void> reply_and_close(std::shared_ptr<Session> s, int status, std::string_view msg,
                                       bool retry_after = false) {
    std::string head_buf;
    Writer w(*s, false, false, opts.write_timeout_s, head_buf);
    Response r = error_response(status, msg);
    if (retry_after) r.headers.add("Retry-After", "1");
    if (!co_await w.send(std::move(r))) co_return;
    error_code ec;
    s->sock.shutdown(tcp::socket::shutdown_send, ec);
    s->arm(kLingerSeconds);
    std::array<char, 16384> sink;
    std::uint64_t drained = 0;
    while (!ec && drained < kLingerBytes) {
      std::size_t n = co_await s->sock.async_read_some(net::buffer(sink), net::redirect_error(net::use_awaitable, ec));
      drained += n;
    }
    s->disarm();
  }
  static constexpr double kLingerSeconds = 2;
  static constexpr std::uint64_t kLingerBytes = 128ull << 20;

  std::uint64_t body_limit_for(std::string_view target) const {
    const std::string_view rpath = target.substr(0, target.find('?'));
    for (const auto& [p, lim] : opts.route_body_limits)
      if (rpath == p) return lim;
    return opts.max_body_bytes;
  }

  // Reads the body (Content-Length, already checked against `limit`, or chunked) into req.body,
  // what the session's buffer already holds first. Returns 0, or the status of a refusal with
  // `perr` set; `ec` set when the connection failed.
  net::awaitable<int> read_body(Session& s, std::optional<std::uint64_t> content_length, bool chunked,
                                std::uint64_t limit, Request& req, ParseError& perr, error_code& ec) {
    if (content_length) {
      const std::uint64_t len = *content_length;
      const std::size_t have = static_cast<std::size_t>(std::min<std::uint64_t>(len, s.in.size()));
      req.body.assign(s.in.view().substr(0, have));
      s.in.consume(have);
      if (have < len) {
        req.body.resize(static_cast<std::size_t>(len));
        co_await net::async_read(s.sock, net::buffer(req.body.data() + have, static_cast<std::size_t>(len) - have),
                                 net::redirect_error(net::use_awaitable, ec));
      }
      co_return 0;
    }
    if (!chunked) co_return 0;
    ChunkedDecoder dec(limit, opts.max_header_bytes);
    for (;;) {
      std::size_t used = 0;
      const ParseStatus st = dec.feed(s.in.view(), req.body, used, perr);
      s.in.consume(used);
      if (st == ParseStatus::kDone) co_return 0;
      if (st == ParseStatus::kError) co_return perr.status;
      const std::size_t n = co_await s.sock.async_read_some(s.in.prepare(4 * kReadChunk),
                                                            net::redirect_error(net::use_awaitable, ec));
      if (ec) co_return 0;
      s.in.commit(n);
    }
  }

  net::awaitable<void> run_session(std::shared_ptr<Session> s, std::uint64_t id) {
    std::string remote;
    {
      error_code ec;
      auto ep = s->sock.remote_endpoint(ec);
      if (!ec) remote = ep.address().to_string() + ":" + std::to_string(ep.port());
    }
    LS_LOG_DEBUG("http", "session {} started ({})", id, remote);
    // Reused from request to request: their buffers keep their capacity.
    Request req;
    req.remote = remote;
    RequestHead head;
    ParseError perr;
    std::string head_buf;
    try {
      for (;;) {
        error_code ec;
        if (s->in.size() == 0) {
          s->in.shrink();
          s->arm(opts.idle_timeout_s);
          std::size_t n = co_await s->sock.async_read_some(s->in.prepare(kReadChunk), net::redirect_error(net::use_awaitable, ec));
          if (ec) break;  // the client closed, or the idle timeout
          s->in.commit(n);
        }
        if (s->closed) break;
        // A request that reached a keep-alive connection during shutdown gets an answer (503,
        // Connection: close, Retry-After) rather than a silent close the client cannot tell apart
        // from a failure.
        const bool refuse = stopping.load();
        s->busy = true;
        // The head and the body must arrive within the client timeout.
        s->arm(opts.client_timeout_s);
        ParseStatus st;
        std::size_t scanned = 0;
        for (;;) {
          st = parse_request_head(s->in.view(), opts.max_header_bytes, scanned, head, perr);
          if (st != ParseStatus::kIncomplete) break;
          scanned = s->in.size();
          std::size_t n = co_await s->sock.async_read_some(s->in.prepare(kReadChunk), net::redirect_error(net::use_awaitable, ec));
          if (ec) break;
          s->in.commit(n);
        }
        if (ec) {
          // A client that left mid-head gets nothing; one too slow gets 408.
          if (s->timed_out) co_await reply_and_close(s, 408, "request not received within the client timeout");
          break;
        }
        if (st == ParseStatus::kError) {
          co_await reply_and_close(s, perr.status, perr.message);
          break;
        }
        req.method.assign(head.method);
        req.target.assign(head.target);
        {
          std::size_t k = 0;
          for (const auto& [name, value] : head.fields) req.headers.put_at(k++, name, value);
          req.headers.truncate(k);
        }
        req.body.clear();
        const bool keep_alive_asked = head.keep_alive;
        const bool chunked = head.chunked;
        const auto content_length = head.content_length;
        const bool expect_continue = head.expect_continue;
        s->in.consume(head.head_bytes);  // the views in `head` are dead from here on
        head.clear();
        const std::uint64_t body_limit = body_limit_for(req.target);
        if (content_length && *content_length > body_limit) {
          std::string msg = "request body exceeds " + std::to_string(body_limit) + " bytes";
          co_await reply_and_close(s, 413, msg);
          break;
        }
        if (refuse) {
          co_await reply_and_close(s, 503, "the server is shutting down; retry on another replica", true);
          break;
        }
        const bool body_pending = chunked || (content_length && *content_length > s->in.size());
        if (expect_continue && body_pending) {
          co_await net::async_write(s->sock, net::buffer("HTTP/1.1 100 Continue\r\n\r\n", 25),
                                    net::redirect_error(net::use_awaitable, ec));
          if (ec) break;
        }
        const int refusal = co_await read_body(*s, content_length, chunked, body_limit, req, perr, ec);
        if (ec) {
          if (s->timed_out) co_await reply_and_close(s, 408, "request not received within the client timeout");
          break;
        }
        if (refusal != 0) {
          co_await reply_and_close(s, refusal, perr.message);
          break;
        }
        s->disarm();
        LS_LOG_DEBUG("http", "session {} read request", id);
        const bool keep_alive = keep_alive_asked && !stopping.load();
        Writer w(*s, keep_alive, req.method == "HEAD", opts.write_timeout_s, head_buf);
        active.fetch_add(1);
        s->active_writer = &w;
        // Gone before its handler started (a FIN right behind the request): as if it left now.
        if (s->peer_gone) w.client_gone().fire();
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
        s->active_writer = nullptr;
        s->busy = false;
        if (active.fetch_sub(1) == 1) {
          std::lock_guard lk(mu);
          cv.notify_all();
        }
        if (w.must_close() || s->peer_gone || stopping.load()) break;
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
  error_code ec;
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
  // Timeouts fire within one tick of their deadline: an eighth of the shortest, 5-250 ms.
  const double shortest = std::min({I.opts.client_timeout_s, I.opts.idle_timeout_s, I.opts.write_timeout_s,
                                    Impl::kLingerSeconds});
  I.sweep_tick = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(std::clamp(shortest / 8, 0.005, 0.25)));
  const int hup_fd = ::epoll_create1(EPOLL_CLOEXEC);
  if (hup_fd < 0) throw_env("cannot create the hang-up watch's epoll set: {}", std::strerror(errno));
  I.hup.emplace(net::make_strand(I.ioc), hup_fd);
  I.hup_wait();
  net::co_spawn(I.ioc, I.accept_loop(), net::detached);
  net::co_spawn(net::make_strand(I.ioc), I.sweep_loop(), net::detached);
  // On the caller's io_context, the caller's thread runs it.
  const int n = I.opts.io ? 0 : std::max(1, I.opts.threads);
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
  if (I.opts.io && I.acceptor) {
    // On the caller's io_context, which outlives nothing of ours: the acceptor goes now, on the
    // io_context's thread (which must still run it), not after that io_context is destroyed.
    std::promise<void> gone;
    net::post(I.ioc, [&I, &gone] {
      error_code ec;
      I.acceptor->close(ec);
      I.acceptor.reset();
      gone.set_value();
    });
    gone.get_future().wait();
  } else {
    net::post(I.ioc, [&I] {
      error_code ec;
      if (I.acceptor) I.acceptor->close(ec);
    });
  }
  // Idle keep-alive connections stay open while in-flight requests finish: a request that
  // arrives on one now is answered 503 (Connection: close, Retry-After) instead of meeting a close
  // that races with it and looks like a failed replica. All close when the grace period ends.
  {
    std::unique_lock lk(I.mu);
    I.cv.wait_for(lk, std::chrono::duration<double>(grace_s), [&] { return I.active.load() == 0; });
  }
  // The hang-up watch goes after the grace period (clients that leave meanwhile are still noticed),
  // on its strand, while the io_context still runs (a caller's outlives nothing of ours).
  if (I.hup) {
    auto hup_gone = std::make_shared<std::promise<void>>();
    auto done = hup_gone->get_future();
    net::post(I.hup->get_executor(), [&I, hup_gone] {
      {
        std::lock_guard lk(I.mu);
        *I.hup_live = false;
        I.hup.reset();
      }
      hup_gone->set_value();
    });
    // Bounded, should the io_context not be running (as for the connections below).
    done.wait_for(std::chrono::seconds(1));
  }
  // Every connection is closed before the io_context stops (a close posted and not yet run when it
  // stops would leave the peer waiting until the server is destroyed). Bounded, should the
  // io_context not be running (a caller's, against ServerOptions::io's contract).
  auto pending = std::make_shared<std::atomic<int>>(0);
  I.for_each_session([&I, &pending](std::shared_ptr<Session> s) {
    pending->fetch_add(1);
    net::post(s->sock.get_executor(), [s, pending, &I] {
      s->close();
      if (pending->fetch_sub(1) == 1) {
        std::lock_guard lk(I.mu);
        I.cv.notify_all();
      }
    });
  });
  {
    std::unique_lock lk(I.mu);
    I.cv.wait_for(lk, std::chrono::seconds(1), [&] { return pending->load() == 0; });
  }
  I.work.reset();
  if (!I.opts.io) I.ioc.stop();  // else the caller's, which other servers may share
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
