// The client side of src/http (the other Beast translation unit). Requests are framed by hand;
// responses are parsed by Beast's response_parser<buffer_body>, which decodes chunked framing and
// lets the caller relay each piece as soon as it is read; its header fields come from an arena
// in the call's state and are copied into recycled Headers (no allocation per field).
#include <utility>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <limits>
#include <mutex>
#include <new>
#include <tuple>

#include "http/client.h"
#include "util/error.h"
#include "util/log.h"

namespace lorasync::http {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace bhttp = beast::http;
using tcp = net::ip::tcp;
using Clock = std::chrono::steady_clock;

const char* call_error_name(CallError e) {
  switch (e) {
    case CallError::kNone: return "none";
    case CallError::kConnect: return "connect_error";
    case CallError::kConnectTimeout: return "connect_timeout";
    case CallError::kPoolTimeout: return "pool_timeout";
    case CallError::kResetBeforeStatus: return "reset_before_status";
    case CallError::kFirstByteTimeout: return "first_byte_timeout";
    case CallError::kIdleTimeout: return "idle_timeout";
    case CallError::kTotalTimeout: return "total_timeout";
    case CallError::kBodyError: return "body_error";
    case CallError::kProtocol: return "protocol_error";
    case CallError::kCancelled: return "cancelled";
    case CallError::kLocal: return "local_resources";
  }
  return "?";
}

bool is_timeout(CallError e) {
  return e == CallError::kConnectTimeout || e == CallError::kPoolTimeout || e == CallError::kFirstByteTimeout ||
         e == CallError::kIdleTimeout || e == CallError::kTotalTimeout;
}

namespace {

constexpr std::size_t kPiece = 64 * 1024;

Clock::duration secs(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

struct Conn {
  std::unique_ptr<beast::tcp_stream> tcp;
  std::unique_ptr<beast::ssl_stream<beast::tcp_stream>> tls;
  beast::flat_buffer buf;
  // Body pieces are read into this buffer, allocated once per connection (not zero-filled, not
  // per response: a relayed request used to pay a 64 KiB allocation and memset).
  std::unique_ptr<char[]> piece;
  // The request head being sent, built here so its capacity serves the connection's next request.
  std::string head;
  Clock::time_point idle_since{};
  bool broken = false;
  beast::tcp_stream& lowest() { return tls ? beast::get_lowest_layer(*tls) : *tcp; }
  bool has_stream() const { return tls || tcp; }
  void close() {
    broken = true;
    if (!has_stream()) return;  // never connected (the connect step itself failed)
    beast::error_code ec;
    lowest().socket().shutdown(tcp::socket::shutdown_both, ec);
    lowest().socket().close(ec);
  }
};

template <typename F>
auto on_stream(Conn& c, F&& f) {
  if (c.tls) return f(*c.tls);
  return f(*c.tcp);
}

}  // namespace

class Pool::Impl : public std::enable_shared_from_this<Pool::Impl> {
 public:
  Impl(Url u, ClientOptions o) : url(std::move(u)), opts(std::move(o)) {
    if (url.tls()) {
      ssl.emplace(net::ssl::context::tls_client);
      ssl->set_verify_mode(opts.verify_peer ? net::ssl::verify_peer : net::ssl::verify_none);
      beast::error_code ec;
      if (!opts.ca_file.empty()) ssl->load_verify_file(opts.ca_file, ec);
      else ssl->set_default_verify_paths(ec);
      if (ec) throw_env("cannot load CA certificates '{}': {}", opts.ca_file, ec.message());
    }
  }

  struct Waiter {
    explicit Waiter(net::any_io_executor ex) : timer(std::move(ex)) {}
    bool granted = false;
    std::unique_ptr<Conn> conn;  // a handed-over idle connection, or null: open a new one
    net::steady_timer timer;     // the waiting coroutine's; cancelled on its executor to wake it
  };

  Url url;
  ClientOptions opts;
  std::optional<net::ssl::context> ssl;
  mutable std::mutex mu;
  std::vector<std::unique_ptr<Conn>> idle;  // most recent at the back
  std::size_t open = 0;                     // open connections + reserved slots
  std::deque<std::shared_ptr<Waiter>> waiters;

  // A connection (reused) or null with a reserved slot (open a new one). nullopt: timed out, or
  // (*cancelled set) the caller's client left while it waited for a slot: it stops waiting at
  // once, and a slot granted meanwhile goes to the next waiter.
  Task<std::optional<std::unique_ptr<Conn>>> acquire(bool fresh, Clock::time_point deadline, CancelSignal* cancel,
                                                     bool* cancelled) {
    std::shared_ptr<Waiter> w;
    auto ex = co_await net::this_coro::executor;
    {
      std::lock_guard lk(mu);
      auto now = Clock::now();
      while (!idle.empty()) {
        std::unique_ptr<Conn> c = std::move(idle.back());
        idle.pop_back();
        if (fresh || now - c->idle_since > secs(opts.keepalive_s)) {
          c->close();
          --open;
          continue;
        }
        co_return std::optional<std::unique_ptr<Conn>>(std::move(c));
      }
      if (open < opts.max_connections) {
        ++open;
        co_return std::optional<std::unique_ptr<Conn>>(std::unique_ptr<Conn>());
      }
      w = std::make_shared<Waiter>(ex);
      waiters.push_back(w);
    }
    // Wait in FIFO order. release() grants the slot under `mu` and posts the timer's cancellation
    // to this coroutine's executor (its strand): the wake-up runs after the wait below has been
    // issued, so none is lost and nothing polls. The bounded wait only guards an executor that is
    // not a strand. A departing client cancels the timer too (its callback runs on this strand).
    net::steady_timer& timer = w->timer;
    std::optional<CancelSignal::Id> sub;
    if (cancel) sub = cancel->subscribe([&timer] { timer.cancel(); });
    struct Unsub {
      CancelSignal* c;
      std::optional<CancelSignal::Id>& id;
      ~Unsub() {
        if (c && id) c->unsubscribe(*id);
      }
    } unsub{cancel, sub};
    for (;;) {
      if (cancel && cancel->fired()) {
        std::unique_ptr<Conn> back;
        bool had_slot = false;
        {
          std::lock_guard lk(mu);
          if (w->granted) {
            had_slot = true;
            back = std::move(w->conn);
          } else {
            std::erase(waiters, w);
          }
        }
        if (had_slot) release(std::move(back), true);  // pass the slot on
        *cancelled = true;
        co_return std::nullopt;
      }
      {
        std::lock_guard lk(mu);
        if (w->granted) {
          std::unique_ptr<Conn> c = std::move(w->conn);
          if (c && fresh) {
            c->close();
            c.reset();
          }
          co_return std::optional<std::unique_ptr<Conn>>(std::move(c));
        }
        if (Clock::now() >= deadline) {
          std::erase(waiters, w);
          co_return std::nullopt;
        }
      }
      timer.expires_after(std::min<Clock::duration>(std::chrono::seconds(1), deadline - Clock::now()));
      beast::error_code ec;
      co_await timer.async_wait(net::redirect_error(net::use_awaitable, ec));
    }
  }

  void release(std::unique_ptr<Conn> c, bool reusable) {
    std::lock_guard lk(mu);
    if (!reusable && c) {
      c->close();
      c.reset();
    }
    if (!waiters.empty()) {
      auto w = waiters.front();
      waiters.pop_front();
      w->granted = true;
      w->conn = std::move(c);  // the slot moves to the waiter either way
      net::post(w->timer.get_executor(), [w] { w->timer.cancel(); });
      return;
    }
    if (c) {
      c->idle_since = Clock::now();
      idle.push_back(std::move(c));
    } else {
      --open;
    }
  }

  // Out of descriptors, buffers or memory in this process: its fault, not the peer's.
  static bool is_local_resource_error(const boost::system::error_code& ec) {
    return ec == net::error::no_descriptors || ec == boost::system::errc::too_many_files_open_in_system ||
           ec == net::error::no_buffer_space || ec == net::error::no_memory;
  }

  // connect_impl, with anything it throws (a resolver or socket that cannot be created when the
  // process is out of descriptors) turned into an error: kLocal for resource exhaustion.
  Task<CallError> connect(Conn& c, Clock::time_point deadline, std::string& msg) {
    CallError e = CallError::kConnect;
    try {
      e = co_await connect_impl(c, deadline, msg);
    } catch (const boost::system::system_error& x) {
      msg = "connect to " + url.str() + " failed: " + x.what();
      e = is_local_resource_error(x.code()) ? CallError::kLocal : CallError::kConnect;
    } catch (const std::bad_alloc&) {
      msg = "connect to " + url.str() + " failed: out of memory";
      e = CallError::kLocal;
    }
    co_return e;
  }

  Task<CallError> connect_impl(Conn& c, Clock::time_point deadline, std::string& msg) {
    auto ex = co_await net::this_coro::executor;
    beast::error_code ec;
    tcp::resolver res(ex);
    auto results = co_await res.async_resolve(url.host, std::to_string(url.port),
                                              net::redirect_error(net::use_awaitable, ec));
    if (ec) {
      msg = "cannot resolve " + url.host + ": " + ec.message();
      co_return CallError::kConnect;
    }
    if (ssl) c.tls = std::make_unique<beast::ssl_stream<beast::tcp_stream>>(ex, *ssl);
    else c.tcp = std::make_unique<beast::tcp_stream>(ex);
    auto limit = std::min(Clock::now() + secs(opts.connect_timeout_s), deadline);
    c.lowest().expires_at(limit);
    co_await c.lowest().async_connect(results, net::redirect_error(net::use_awaitable, ec));
    if (ec) {
      if (is_local_resource_error(ec)) {
        msg = "connect to " + url.str() + " failed locally (" + ec.message() + "): this process is out of resources";
        co_return CallError::kLocal;
      }
      msg = "connect to " + url.str() + " failed: " + ec.message();
      co_return ec == beast::error::timeout ? CallError::kConnectTimeout : CallError::kConnect;
    }
    c.lowest().socket().set_option(tcp::no_delay(true), ec);
    if (c.tls) {
      if (!SSL_set_tlsext_host_name(c.tls->native_handle(), url.host.c_str())) {
        msg = "cannot set SNI host name";
        co_return CallError::kConnect;
      }
      if (opts.verify_peer) c.tls->set_verify_callback(net::ssl::host_name_verification(url.host));
      co_await c.tls->async_handshake(net::ssl::stream_base::client, net::redirect_error(net::use_awaitable, ec));
      if (ec) {
        msg = "TLS handshake with " + url.str() + " failed: " + ec.message();
        co_return ec == beast::error::timeout ? CallError::kConnectTimeout : CallError::kConnect;
      }
    }
    c.lowest().expires_never();
    co_return CallError::kNone;
  }
};

namespace {

// The header fields Beast's parser keeps for one response come from this arena, which lives with
// the call's parser: they were one malloc each. Fields past its 1 KiB come from the heap.
class FieldArena {
 public:
  void* allocate(std::size_t n, std::size_t align) {
    if (align > alignof(std::max_align_t)) throw std::bad_alloc();  // Beast asks for 8
    const std::size_t at = (used_ + align - 1) & ~(align - 1);
    if (at + n <= sizeof buf_) {
      used_ = at + n;
      return buf_ + at;
    }
    return ::operator new(n);
  }
  void deallocate(void* p) noexcept {
    const auto a = reinterpret_cast<std::uintptr_t>(p), b = reinterpret_cast<std::uintptr_t>(buf_);
    if (a >= b && a < b + sizeof buf_) return;  // reclaimed with the arena
    ::operator delete(p);
  }
  // Only when nothing allocated from it is alive (before a new parser).
  void reset() noexcept { used_ = 0; }

 private:
  alignas(std::max_align_t) unsigned char buf_[1024];
  std::size_t used_ = 0;
};

template <typename T>
struct ArenaAllocator {
  using value_type = T;
  FieldArena* arena;
  explicit ArenaAllocator(FieldArena* a) noexcept : arena(a) {}
  template <typename U>
  ArenaAllocator(const ArenaAllocator<U>& o) noexcept : arena(o.arena) {}  // NOLINT: rebinding converts implicitly
  T* allocate(std::size_t n) { return static_cast<T*>(arena->allocate(n * sizeof(T), alignof(T))); }
  void deallocate(T* p, std::size_t) noexcept { arena->deallocate(p); }
  template <typename U>
  bool operator==(const ArenaAllocator<U>& o) const noexcept {
    return arena == o.arena;
  }
};

using ResponseParser = bhttp::response_parser<bhttp::buffer_body, ArenaAllocator<char>>;

// Response heads are copied into Headers recycled per thread: their vectors and strings keep their
// capacity, so the copy allocates nothing once warm (it was one allocation per field name or value
// past 15 bytes, and the vector's growth).
struct SpareHeaders {
  std::vector<Headers> spare;
  Headers take() {
    if (spare.empty()) return {};
    Headers h = std::move(spare.back());
    spare.pop_back();
    return h;
  }
  void give(Headers&& h) noexcept {
    if (spare.size() >= 256) return;
    // A large head (up to the 1 MiB header limit) is not kept for the life of the thread.
    std::size_t bytes = h.items().capacity() * sizeof(Header);
    for (const auto& f : h) bytes += f.name.capacity() + f.value.capacity();
    if (bytes > 8192) return;
    try {
      spare.push_back(std::move(h));
    } catch (...) {  // out of memory: it is simply freed
    }
  }
};
thread_local SpareHeaders spare_headers;

}  // namespace

class ResponseStream::Impl {
 public:
  std::shared_ptr<Pool::Impl> pool;
  std::unique_ptr<Conn> conn;
  FieldArena arena;                      // before the parser, which allocates from it
  std::optional<ResponseParser> parser;  // in place: no allocation of its own
  Headers headers = spare_headers.take();
  int status = 0;
  bool reused = false;
  bool finished = false;
  CallOptions opts;
  Clock::time_point deadline;
  CancelSignal::Id cancel_id = 0;
  // A body of known length (Content-Length, not chunked) is read straight from the socket into the
  // connection's piece buffer, bypassing the parser: `direct` is decided at the first read().
  enum class Direct { kUndecided, kNo, kYes } direct = Direct::kUndecided;
  std::uint64_t direct_left = 0;  // its bytes not read yet
  bool direct_keep = false;       // the connection may be reused after it (the head's keep-alive)

  ~Impl() {
    finish(false);
    parser.reset();
    spare_headers.give(std::move(headers));
  }

  void finish(bool reusable) {
    if (!conn) return;
    if (opts.cancel && cancel_id) opts.cancel->unsubscribe(cancel_id);
    cancel_id = 0;
    if (!conn->has_stream()) {  // the connect step failed before a socket existed
      conn.reset();
      pool->release(nullptr, false);
      return;
    }
    bool keep = reusable && !conn->broken && conn->buf.size() == 0;
    conn->lowest().expires_never();
    pool->release(std::move(conn), keep);
  }

  CallError timeout_kind(CallError phase) const {
    return Clock::now() + std::chrono::milliseconds(1) >= deadline ? CallError::kTotalTimeout : phase;
  }

  // The next body read may wait until the idle timeout or the call's deadline, whichever is first.
  void arm_body_read() { conn->lowest().expires_at(std::min(Clock::now() + secs(opts.idle_timeout_s), deadline)); }

  // A body read that failed: the call's error (cancelled, a timeout, or a broken body); the
  // connection is closed and not reused.
  CallError fail_body_read(const beast::error_code& ec) {
    const CallError e = (opts.cancel && opts.cancel->fired()) ? CallError::kCancelled
                        : ec == beast::error::timeout        ? timeout_kind(CallError::kIdleTimeout)
                                                             : CallError::kBodyError;
    conn->close();
    finish(false);
    return e;
  }
};

ResponseStream::ResponseStream(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ResponseStream::~ResponseStream() = default;
int ResponseStream::status() const { return impl_->status; }
const Headers& ResponseStream::headers() const { return impl_->headers; }
std::optional<std::uint64_t> ResponseStream::content_length() const {
  auto cl = impl_->parser->content_length();
  if (cl) return *cl;
  return std::nullopt;
}
bool ResponseStream::chunked() const { return impl_->parser->chunked(); }
bool ResponseStream::done() const { return impl_->finished; }
bool ResponseStream::body_complete() const {
  if (impl_->direct == Impl::Direct::kYes) return impl_->direct_left == 0;
  return impl_->finished || (impl_->parser && impl_->parser->is_done());
}
bool ResponseStream::reused_connection() const { return impl_->reused; }

Task<CallError> ResponseStream::read(std::string_view& piece) {
  auto& I = *impl_;
  piece = {};
  if (I.finished) co_return CallError::kNone;
  if (!I.conn) co_return CallError::kBodyError;
  if (!I.conn->piece) I.conn->piece = std::make_unique_for_overwrite<char[]>(kPiece);
  if (I.direct == Impl::Direct::kUndecided) {
    // Right after the head: the parser has consumed none of the body yet (it stops at the head's
    // end; what the head's read brought of the body is still in conn->buf).
    I.direct = Impl::Direct::kNo;
    const auto cl = I.parser->content_length();
    if (I.parser->is_header_done() && !I.parser->is_done() && !I.parser->chunked() && cl && *cl > 0) {
      I.direct = Impl::Direct::kYes;
      I.direct_left = *cl;
      I.direct_keep = I.parser->get().keep_alive();
    }
  }
  if (I.direct == Impl::Direct::kYes) co_return co_await read_direct(piece);
  for (;;) {
    if (I.parser->is_done()) {
      I.finished = true;
      // A body delimited by the end of the connection leaves nothing to reuse, whatever the
      // headers said about keep-alive.
      I.finish(I.parser->get().keep_alive() && !I.parser->need_eof());
      co_return CallError::kNone;
    }
    auto& body = I.parser->get().body();
    char* const buf = I.conn->piece.get();
    body.data = buf;
    body.size = kPiece;
    beast::error_code ec;
    I.arm_body_read();
    Conn& c = *I.conn;
    co_await on_stream(c, [&](auto& s) {
      return bhttp::async_read_some(s, c.buf, *I.parser, net::redirect_error(net::use_awaitable, ec));
    });
    if (ec == bhttp::error::need_buffer) ec = {};
    if (ec) co_return I.fail_body_read(ec);
    std::size_t n = kPiece - body.size;
    if (n > 0) {
      piece = std::string_view(buf, n);
      co_return CallError::kNone;
    }
  }
}

// A body of known length, straight from the socket: the bytes the head's read brought along, then
// one read of the rest (up to the piece buffer), so that an answer of a few KiB is one piece: one
// receive and one write to the client, not one of each per 512 bytes (Beast's read_some reads at
// most what its buffer holds, 512 bytes after a short head) with a copy through the parser's buffer.
Task<CallError> ResponseStream::read_direct(std::string_view& piece) {
  auto& I = *impl_;
  if (I.direct_left == 0) {
    // The whole body was returned: the connection goes back now, not with the last piece, which
    // lives in its buffer until this call.
    I.finished = true;
    I.finish(I.direct_keep);
    co_return CallError::kNone;
  }
  Conn& c = *I.conn;
  char* const buf = c.piece.get();
  std::size_t n = 0;
  if (c.buf.size() > 0) {
    n = static_cast<std::size_t>(std::min<std::uint64_t>({c.buf.size(), I.direct_left, kPiece}));
    net::buffer_copy(net::buffer(buf, n), c.buf.data());
    c.buf.consume(n);
    I.direct_left -= n;
  }
  if (I.direct_left > 0 && n < kPiece) {
    const auto want = static_cast<std::size_t>(std::min<std::uint64_t>(I.direct_left, kPiece - n));
    beast::error_code ec;
    I.arm_body_read();
    const std::size_t got = co_await on_stream(c, [&](auto& s) {
      return s.async_read_some(net::buffer(buf + n, want), net::redirect_error(net::use_awaitable, ec));
    });
    if (ec) co_return I.fail_body_read(ec);
    n += got;
    I.direct_left -= got;
  }
  piece = std::string_view(buf, n);
  co_return CallError::kNone;
}

Task<CallError> ResponseStream::read_all(std::string& out, std::size_t limit) {
  for (;;) {
    std::string_view p;
    CallError e = co_await read(p);
    if (e != CallError::kNone) co_return e;
    if (p.empty() && done()) co_return CallError::kNone;
    if (out.size() < limit) out.append(p.substr(0, limit - out.size()));
  }
}

Pool::Pool(Url url, ClientOptions options) : impl_(std::make_shared<Impl>(std::move(url), std::move(options))) {}
Pool::~Pool() = default;
const Url& Pool::url() const { return impl_->url; }

std::size_t Pool::idle_connections() const {
  std::lock_guard lk(impl_->mu);
  return impl_->idle.size();
}
std::size_t Pool::open_connections() const {
  std::lock_guard lk(impl_->mu);
  return impl_->open;
}
void Pool::close_idle() {
  std::lock_guard lk(impl_->mu);
  for (auto& c : impl_->idle) {
    c->close();
    --impl_->open;
  }
  impl_->idle.clear();
}

Task<CallResult> Pool::call(const OutRequest& rq, const CallOptions& o) {
  auto P = impl_;
  const auto deadline = o.total_timeout_s > 0 ? Clock::now() + secs(o.total_timeout_s) : Clock::time_point::max();
  auto build_head = [&](std::string& head) {
    head.clear();
    head.append(rq.method).append(" ").append(P->url.prefix).append(rq.target).append(" HTTP/1.1\r\nHost: ");
    head.append(P->url.host_header()).append("\r\n");
    if (rq.headers) {
      const bool connection = rq.headers->has("connection");
      for (const auto& h : *rq.headers) {
        if (iequals(h.name, "host") || iequals(h.name, "content-length") || is_hop_by_hop(h.name)) continue;
        if (std::any_of(rq.drop.begin(), rq.drop.end(), [&](std::string_view d) { return iequals(d, h.name); })) continue;
        if (connection && listed_in_connection(*rq.headers, h.name)) continue;
        head.append(h.name).append(": ").append(h.value).append("\r\n");
      }
    }
    for (const auto& [name, value] : rq.extra) head.append(name).append(": ").append(value).append("\r\n");
    const bool body_method = !rq.body.empty() || rq.method == "POST" || rq.method == "PUT" || rq.method == "PATCH";
    if (body_method) {
      char num[24];
      const auto end = std::to_chars(num, num + sizeof num, rq.body.size()).ptr;
      head.append("Content-Length: ").append(num, static_cast<std::size_t>(end - num)).append("\r\n");
    }
    head.append("\r\n");
  };

  bool fresh = o.fresh_connection;
  for (int attempt = 0;; ++attempt) {
    CallResult out;
    if (o.cancel && o.cancel->fired()) {
      out.error = CallError::kCancelled;
      out.message = "client went away";
      co_return out;
    }
    bool cancelled = false;
    auto got = co_await P->acquire(fresh, deadline, o.cancel, &cancelled);
    if (cancelled) {
      out.error = CallError::kCancelled;
      out.message = "client went away while waiting for a connection";
      co_return out;
    }
    if (!got) {
      out.error = CallError::kPoolTimeout;
      out.message = "no free connection to " + P->url.str() + " within the total timeout";
      co_return out;
    }
    auto impl = std::make_unique<ResponseStream::Impl>();
    impl->pool = P;
    impl->opts = o;
    impl->deadline = deadline;
    impl->reused = static_cast<bool>(*got);
    impl->conn = std::move(*got);
    if (!impl->conn) {
      impl->conn = std::make_unique<Conn>();
      CallError e = co_await P->connect(*impl->conn, deadline, out.message);
      if (e != CallError::kNone) {
        impl->conn->broken = true;
        impl->finish(false);
        out.error = (o.cancel && o.cancel->fired()) ? CallError::kCancelled : e;
        co_return out;
      }
    }
    Conn* conn = impl->conn.get();
    if (o.cancel) impl->cancel_id = o.cancel->subscribe([conn] { conn->close(); });

    beast::error_code ec;
    conn->lowest().expires_at(std::min(Clock::now() + secs(o.first_byte_timeout_s), deadline));
    build_head(conn->head);
    std::array<net::const_buffer, 2> bufs{net::buffer(conn->head), net::buffer(rq.body.data(), rq.body.size())};
    co_await on_stream(*conn, [&](auto& s) {
      return net::async_write(s, bufs, net::redirect_error(net::use_awaitable, ec));
    });
    // Interim 1xx answers (100 Continue, 103 Early Hints) are skipped: the final status follows.
    for (int interim = 0; !ec && interim < 8; ++interim) {
      impl->parser.reset();  // an interim answer's parser and its fields go first: the arena is reused
      impl->arena.reset();
      impl->parser.emplace(std::piecewise_construct, std::make_tuple(),
                           std::make_tuple(ArenaAllocator<char>(&impl->arena)));
      impl->parser->header_limit(1u << 20);
      impl->parser->body_limit(std::numeric_limits<std::uint64_t>::max());
      if (rq.method == "HEAD") impl->parser->skip(true);
      co_await on_stream(*conn, [&](auto& s) {
        return bhttp::async_read_header(s, conn->buf, *impl->parser, net::redirect_error(net::use_awaitable, ec));
      });
      if (ec) break;
      const int st = static_cast<int>(impl->parser->get().result_int());
      if (st < 100 || st >= 200 || st == 101) break;
    }
    if (ec) {
      const bool client_left = o.cancel && o.cancel->fired();
      bool reset = ec == net::error::eof || ec == bhttp::error::end_of_stream || ec == net::error::connection_reset ||
                   ec == net::error::broken_pipe || ec == bhttp::error::partial_message;
      out.message = "upstream " + P->url.str() + ": " + ec.message();
      out.error = client_left                        ? CallError::kCancelled
                  : ec == beast::error::timeout      ? impl->timeout_kind(CallError::kFirstByteTimeout)
                  : reset                            ? CallError::kResetBeforeStatus
                  : ec.category() == beast::error_code(bhttp::error::bad_version).category() ? CallError::kProtocol
                                                     : CallError::kResetBeforeStatus;
      bool was_reused = impl->reused;
      conn->close();
      impl->finish(false);
      if (out.error == CallError::kResetBeforeStatus && was_reused && !o.fresh_connection && attempt == 0) {
        fresh = true;  // the server closed an idle connection: once more on a fresh one
        continue;
      }
      co_return out;
    }
    auto& msg = impl->parser->get();
    impl->status = static_cast<int>(msg.result_int());
    std::size_t k = 0;  // the recycled headers, assigned in place
    for (const auto& f : msg)
      impl->headers.put_at(k++, std::string_view(f.name_string().data(), f.name_string().size()),
                           std::string_view(f.value().data(), f.value().size()));
    impl->headers.truncate(k);
    out.response = std::make_unique<ResponseStream>(std::move(impl));
    co_return out;
  }
}

Task<Pool::Full> Pool::fetch(const OutRequest& rq, const CallOptions& o, std::size_t limit) {
  Full f;
  CallResult r = co_await call(rq, o);
  if (!r.ok()) {
    f.error = r.error;
    f.message = std::move(r.message);
    co_return f;
  }
  f.status = r.response->status();
  f.headers = r.response->headers();
  f.error = co_await r.response->read_all(f.body, limit);
  if (f.error != CallError::kNone) f.message = std::string("reading the body failed: ") + call_error_name(f.error);
  co_return f;
}

}  // namespace lorasync::http
