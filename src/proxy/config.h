// proxy/config.h: the settings of `lorasync proxy` (proxy.md §6) and their validation.
// Flag > environment > default is done by the CLI layer (CLI11 envname); resolve_config() checks
// every value, parses the URLs and reads the secrets from the environment. Failures are
// InvalidInput naming the setting (the binary exits 2).
// Thread-safety: a resolved ProxyConfig is immutable and shared read-only.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "http/http.h"

namespace lorasync::proxy {

struct ProxyConfig {
  std::string listen = "127.0.0.1:8000";       // --listen HOST:PORT
  std::vector<std::string> upstreams;          // --upstream (repeatable) / UPSTREAM_URLS
  std::string upstream_token_env = "HF_TOKEN"; // variable holding the upstream bearer token
  std::string upstream_ca_file;                // PEM bundle for https upstreams; empty: system
  std::string api_key_env;                     // variable holding the inbound key; empty: no auth
  bool allow_insecure_upstream_token = false;  // token over http to a non-loopback host
  bool strict_broadcast = false;               // broadcasts target all replicas, not only in service
  std::int64_t block_size = 16;                // ids per block (text: 4x bytes)
  std::int64_t imbalance = 8;                  // max load difference for an affinity pick
  double spill_wait = 0.002;                   // s a would-be imbalance spill waits for the loads to even out
  std::int64_t max_tracked_blocks = 500000;    // ownership table bound
  double adapter_retry_interval = 0.5;         // s between "No adapter found" retries
  double adapter_load_deadline = 300;          // s for one load across the fleet
  double adapter_attempt_timeout = 60;         // s per load attempt
  double connect_timeout = 5, first_byte_timeout = 300, idle_timeout = 120, total_timeout = 1800;
  double control_timeout = 120;                // s per broadcast call
  double client_timeout = 60;                  // s for a request's headers and body to arrive
  std::int64_t eject_after = 3, recover_after = 2;
  double eject_cooldown = 5;                   // s, doubled per consecutive ejection up to 60
  double probe_interval = 5, probe_timeout = 2, reconcile_interval = 10;
  std::int64_t conn_limit = 1024;              // upstream connections in total
  double upstream_keepalive = 4;               // s an idle upstream connection is kept
  std::int64_t threads = 0;                    // 0: min(4, cores)
  double unload_drain_timeout = 0;             // s to wait for in-flight requests on unload
  std::string cached_tokens_header;            // response header carrying cached tokens
  std::int64_t max_retries = 2;
  std::int64_t health_quorum = 0;              // 0: all replicas
  std::int64_t max_body_bytes = 64ll << 20;
  std::int64_t max_push_bytes = 1ll << 30;     // an adapter push's body (413 beyond)
  std::int64_t max_connections = 0;            // client connections; 0: open-file limit - conn_limit
  double stats_log_interval = 60, shutdown_grace = 30;

  // Filled by resolve_config().
  std::string host;
  std::uint16_t port = 0;
  std::vector<http::Url> urls;
  std::string upstream_token;  // never logged
  std::string api_key;         // never logged
};

// Validates and resolves (reads UPSTREAM_URLS when `upstreams` is empty, the token and key
// variables). Throws InvalidInput naming the setting.
void resolve_config(ProxyConfig& c);

}  // namespace lorasync::proxy
