// http/client.h: an async HTTP/1.1 client with a keep-alive connection pool per upstream.
//
// One Pool per upstream URL (http or https; TLS verifies the certificate against the system store
// or `ca_file`, with SNI and host-name verification). Idle connections are reused most-recent
// first and dropped once idle longer than `keepalive_s`. At most `max_connections` are open per
// pool; callers beyond wait in FIFO order (bounded by their total timeout).
//
// Timeouts of one call: connect (TCP + TLS handshake), first byte (from the request sent to the
// status line), idle (gap between body reads), total (whole call; 0 = none). A reused connection
// that fails before any response byte is retried once on a fresh connection (the server may have
// closed it while idle) unless `fresh_connection` was asked for, which state-changing calls use
// so they are never sent twice.
// Cancellation: if CallOptions::cancel fires, the call's socket is closed at once and the call
// ends with kCancelled (the upstream sees the connection close).
//
// Thread model: calls run on the awaiting coroutine's executor; a Pool is thread-safe but bound
// to one io_context (its pooled sockets belong to the context that opened them: destroy the Pool
// before that io_context); a
// ResponseStream belongs to one coroutine. Destroying a ResponseStream whose body was read to the
// end returns its connection to the pool; otherwise the connection is closed.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include "http/async.h"
#include "http/cancel.h"
#include "http/http.h"

namespace lorasync::http {

struct ClientOptions {
  double connect_timeout_s = 5;       // TCP connect + TLS handshake
  double keepalive_s = 4;             // idle pooled connections older than this are dropped
  std::size_t max_connections = 1024; // per pool
  std::string ca_file;                // PEM bundle; empty: system store
  bool verify_peer = true;            // TLS certificate verification
};

struct CallOptions {
  double first_byte_timeout_s = 300;
  double idle_timeout_s = 120;
  double total_timeout_s = 0;         // 0: none
  bool fresh_connection = false;      // never reuse a pooled connection (state-changing calls)
  CancelSignal* cancel = nullptr;     // client went away
};

enum class CallError {
  kNone,
  kConnect,            // resolve/connect/TLS failure (nothing sent)
  kConnectTimeout,
  kPoolTimeout,        // waited for a free connection past the total timeout
  kResetBeforeStatus,  // reset or EOF before the status line
  kFirstByteTimeout,
  kIdleTimeout,
  kTotalTimeout,
  kBodyError,          // connection failed mid-body
  kProtocol,           // unparseable response
  kCancelled,
  kLocal,              // this process ran out of descriptors, buffers or memory (not the peer's fault)
};
const char* call_error_name(CallError e);
bool is_timeout(CallError e);

struct OutRequest {
  std::string_view method;
  std::string_view target;      // path + query; the pool's URL prefix is prepended
  // Sent without their hop-by-hop fields (those of RFC 9110 §7.6.1 and any a Connection field
  // lists), Host and Content-Length (the client sets both) and the names in `drop`
  // (case-insensitive); then `extra`. A proxy forwards the headers it received this way, without
  // copying them.
  const Headers* headers = nullptr;
  std::string_view body;
  std::span<const std::string_view> drop = {};
  std::span<const std::pair<std::string_view, std::string_view>> extra = {};
};

class ResponseStream {
 public:
  class Impl;
  explicit ResponseStream(std::unique_ptr<Impl> impl);
  ~ResponseStream();
  int status() const;
  const Headers& headers() const;
  std::optional<std::uint64_t> content_length() const;
  bool chunked() const;
  // Next piece of the body (<= 64 KiB) into `piece` (valid until the next call). At the end:
  // kNone with an empty piece and done() true.
  Task<CallError> read(std::string_view& piece);
  // The whole (rest of the) body, at most `limit` bytes kept (the rest is read and dropped).
  Task<CallError> read_all(std::string& out, std::size_t limit = 16u << 20);
  bool done() const;
  // The whole body has been read from the upstream (the last piece may not have been returned to
  // the caller's loop as "done" yet): the upstream's work for this call is over.
  bool body_complete() const;
  bool reused_connection() const;

 private:
  Task<CallError> read_direct(std::string_view& piece);
  std::unique_ptr<Impl> impl_;
};

struct CallResult {
  CallError error = CallError::kNone;
  std::string message;                      // what failed, for logs and 502 bodies
  std::unique_ptr<ResponseStream> response; // set when error == kNone
  bool ok() const { return error == CallError::kNone; }
};

class Pool {
 public:
  Pool(Url url, ClientOptions options);
  ~Pool();
  const Url& url() const;
  // Sends the request and reads the status line and headers.
  Task<CallResult> call(const OutRequest& request, const CallOptions& options);
  // Convenience: call + read_all.
  struct Full {
    CallError error = CallError::kNone;
    std::string message;
    int status = 0;
    Headers headers;
    std::string body;
  };
  Task<Full> fetch(const OutRequest& request, const CallOptions& options, std::size_t limit = 16u << 20);
  std::size_t idle_connections() const;
  std::size_t open_connections() const;
  void close_idle();

  class Impl;
 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace lorasync::http
