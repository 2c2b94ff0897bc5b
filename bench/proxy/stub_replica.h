// bench/proxy/stub_replica.h: a fake inference replica for proxy tests and `bench proxy`.
//
// Speaks the subset of http-api.md the proxy uses: completions (JSON shaped as `lorasync serve`
// answers them, completion_body.h, or SSE), adapter load and
// unload (optionally answering "No adapter found" for the first K load tries, or a fixed failure
// status), /v1/models, /health (status settable), /pause, /resume, /reset_prefix_cache,
// /server_info. It simulates a prefix cache over the same chained block hashes as the proxy
// (unbounded, cleared by /reset_prefix_cache) and reports usage.cached_prompt_tokens, plus the
// service time it spent in the X-Stub-Service-Us header (so a benchmark can subtract it).
// Every call is logged (method, target, Authorization, X-Request-Id, the completions answered
// before it) for tests; a test may hold completions (hang) and adapter loads (hold_loads).
// Thread-safety: all members are thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "http/server.h"
#include "proxy/hash128.h"

namespace lorasync::bench {

struct StubOptions {
  int index = 0;                  // reported in /server_info and X-Stub-Index
  std::string host = "127.0.0.1";
  std::uint16_t port = 0;
  int threads = 1;
  double latency_s = 0;           // service time of a completion
  // Each completion's service time drawn uniformly from latency_s x [1 - spread, 1 + spread]
  // (0: every completion takes latency_s). Generation lengths vary; with a fixed service time a
  // closed-loop client replays each wave of requests in the previous wave's exact order.
  double latency_spread = 0;
  std::uint64_t seed = 1;          // of the spread's draws (a counter hashed with it and index)
  // The server threads' nice value (Linux, per thread; each sets it at its first request), 0:
  // unchanged. The stubs stand for replicas on their own machines; on a 2-core host they compete
  // with the proxy and the load generator for CPU, and a replica thread that waits for its turn
  // answers in a burst afterwards. Below 0 needs CAP_SYS_NICE (see nice_applied()).
  int nice = 0;
  double prefill_s_per_1k = 0;    // extra service time per 1k uncached prompt tokens
  int no_adapter_found_first = 0; // first K load tries answer 404 No adapter found
  int load_fail_status = 0;       // != 0: every load answers this status
  int sse_events = 4;             // events in a streamed completion
  double sse_interval_s = 0;      // gap between events
  std::size_t block_size = 16;
};

struct StubCall {
  std::string method, target, authorization, request_id, body;
  int headers_authorization = 0;  // how many Authorization headers arrived
  std::vector<std::string> header_names;
  // Completions answered before this call arrived (their answer's last bytes handed to the
  // server): the order of events for tests, e.g. an unload that must come after a request's end.
  std::uint64_t completions_answered = 0;
};

// The factor on latency_s of a completion's service time: uniform in [1 - spread, 1 + spread],
// a pure function of (seed, index, draw) (1 when spread is 0).
double service_time_factor(std::uint64_t seed, int index, std::uint64_t draw, double spread);

class StubReplica {
 public:
  // `io` not null: served on that io_context (StubFleet's thread), not on a thread of its own.
  explicit StubReplica(StubOptions o, boost::asio::io_context* io = nullptr);
  ~StubReplica();
  void start();
  void stop();
  std::uint16_t port() const;
  std::string url() const;

  // Runtime controls.
  std::atomic<int> health_status{200};
  std::atomic<bool> hang{false};          // completions never answer (until the client leaves)
  std::atomic<double> latency_s{0};
  std::atomic<int> load_fail_status{0};
  std::atomic<double> load_delay_s{0};    // a load answers after this long (a slow disk)
  std::atomic<bool> hold_loads{false};    // loads wait unanswered while set (a disk held by a test)
  // Adapter push (docs/http-api.md): a prepare answers this status when != 0; a commit fails
  // (1: the connection is closed without an answer, as a replica that died; 2: 500).
  std::atomic<int> prepare_fail_status{0};
  std::atomic<int> commit_fault{0};
  // Completions for a model that is neither the base ("m" or "base") nor loaded answer 404.
  std::atomic<bool> strict_models{false};

  std::vector<StubCall> calls() const;
  std::vector<std::string> loaded() const;
  std::vector<std::string> prepared() const;  // pushed, not committed
  void forget_adapters();                 // simulate a restart without state
  void add_adapter(const std::string& name);  // loaded behind the proxy's back
  bool paused() const { return paused_.load(); }  // the last of /pause and /resume was /pause
  std::uint64_t prompt_tokens() const { return prompt_tokens_.load(); }
  std::uint64_t cached_tokens() const { return cached_tokens_.load(); }
  std::uint64_t completions() const { return completions_.load(); }
  // Non-streamed completion bodies answered: their bytes and their choices (completion_body.h).
  std::uint64_t body_bytes() const { return body_bytes_.load(); }
  std::uint64_t choices() const { return choices_.load(); }
  int open_completions() const { return open_completions_.load(); }
  std::uint64_t client_gone_seen() const { return client_gone_.load(); }
  // StubOptions::nice: 0 not tried yet (or nice 0), 1 set, -1 refused (no CAP_SYS_NICE for a value below 0).
  int nice_applied() const { return nice_applied_.load(); }

 private:
  http::Task<void> handle(http::Request& req, http::ResponseWriter& w);

  StubOptions opts_;
  std::unique_ptr<http::Server> server_;
  mutable std::mutex mu_;
  std::vector<StubCall> calls_;
  std::vector<std::string> loaded_;
  std::vector<std::string> prepared_;
  std::set<std::pair<std::uint64_t, std::uint64_t>> cache_;
  int load_tries_ = 0;
  std::atomic<bool> paused_{false};
  std::atomic<std::uint64_t> prompt_tokens_{0}, cached_tokens_{0}, completions_{0}, client_gone_{0};
  std::atomic<std::uint64_t> body_bytes_{0}, choices_{0};
  std::atomic<std::uint64_t> completions_answered_{0};  // StubCall::completions_answered
  std::atomic<int> open_completions_{0};
  std::atomic<std::uint64_t> draws_{0};  // service-time draws so far (latency_spread)
  std::atomic<int> nice_applied_{0};
};

// Replicas served by one thread between them (http::ServerOptions::io), so that their answers
// leave in the order their service times end, as replicas on machines of their own would send
// them. With a thread per replica on a host with fewer free cores than busy threads (2 cores here,
// shared with the proxy and the load generator), the scheduler decides the order instead: one
// replica's thread waits for a core while the other's sends a whole wave of answers, and a proxy
// fast enough to act on each answer at once sees one replica drain while the other stays full
// (docs/proxy.md, "What interleaving does to the unmatched share").
// Thread-safety: start() and stop() from one thread; the replicas' members as StubReplica's.
class StubFleet {
 public:
  // `n` replicas with `o`'s options, replica i with index i; `one_thread` false: each on threads
  // of its own (StubOptions::threads), as separate StubReplicas.
  StubFleet(const StubOptions& o, int n, bool one_thread = true);
  ~StubFleet();
  StubFleet(const StubFleet&) = delete;
  StubFleet& operator=(const StubFleet&) = delete;
  void start();
  void stop();  // idempotent
  std::size_t size() const { return stubs_.size(); }
  StubReplica& operator[](std::size_t i) { return *stubs_.at(i); }
  std::vector<std::string> urls() const;

 private:
  // Destroyed (stopped and joined first) before the replicas: its pending handlers refer to them.
  // Null without one_thread.
  std::unique_ptr<boost::asio::io_context> io_;
  std::vector<std::unique_ptr<StubReplica>> stubs_;
  std::thread thread_;
  bool started_ = false, stopped_ = false;
};

}  // namespace lorasync::bench
