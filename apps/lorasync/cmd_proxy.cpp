// `lorasync proxy`: the routing proxy (src/proxy, ../shared/spec/proxy.md), and the hidden
// `lorasync stub-replica` used by proxy tests and benchmarks (bench/proxy).
// Settings: flag > environment > default (CLI11 envname); validation exits 2.
#include <csignal>
#include <pthread.h>
#include <thread>

#include "bench/proxy/stub_replica.h"
#include "commands.h"
#include "proxy/proxy.h"
#include "util/log.h"

namespace lorasync::cli {

namespace {

// Blocks SIGINT/SIGTERM in every thread and waits for one on a dedicated thread.
void wait_for_signal_then(const std::function<void()>& on_signal) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  int sig = 0;
  sigwait(&set, &sig);
  LS_LOG_INFO("proxy", "signal {}: shutting down", sig);
  on_signal();
}

void block_signals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

int run_proxy(proxy::ProxyConfig cfg, const std::string& log_level) {
  if (!log_level.empty()) log::set_level(log_level);
  proxy::resolve_config(cfg);
  block_signals();
  proxy::Proxy p(cfg);
  p.start();
  std::printf("{\"listening\": \"%s:%u\"}\n", cfg.host.c_str(), static_cast<unsigned>(p.port()));
  std::fflush(stdout);
  wait_for_signal_then([&] { p.stop(); });
  return 0;
}

}  // namespace

void register_proxy(CLI::App& root, Registry& reg) {
  auto c = std::make_shared<proxy::ProxyConfig>();
  auto level = std::make_shared<std::string>();
  auto* s = root.add_subcommand("proxy", "routing proxy in front of inference replicas (prefix affinity, fleet-wide adapters)");
  s->add_option("--listen", c->listen, "HOST:PORT")->envname("PROXY_LISTEN")->capture_default_str();
  s->add_option("--upstream", c->upstreams, "replica URL (repeatable; replaces UPSTREAM_URLS)");
  s->add_option("--upstream-token-env", c->upstream_token_env, "variable with the upstream bearer token")->envname("PROXY_UPSTREAM_TOKEN_ENV")->capture_default_str();
  s->add_option("--upstream-ca-file", c->upstream_ca_file, "PEM CA bundle for https upstreams")->envname("PROXY_UPSTREAM_CA_FILE");
  s->add_option("--api-key-env", c->api_key_env, "variable with the inbound API key (enables auth)")->envname("PROXY_API_KEY_ENV");
  s->add_flag("--allow-insecure-upstream-token", c->allow_insecure_upstream_token, "allow the token over http to non-loopback hosts")->envname("PROXY_ALLOW_INSECURE_TOKEN");
  s->add_flag("--strict-broadcast", c->strict_broadcast, "broadcast to all replicas, not only those in service")->envname("PROXY_STRICT_BROADCAST");
  s->add_option("--block-size", c->block_size)->envname("PROXY_BLOCK_SIZE")->capture_default_str();
  s->add_option("--imbalance", c->imbalance)->envname("PROXY_IMBALANCE")->capture_default_str();
  s->add_option("--spill-wait", c->spill_wait,
                "seconds a request that would spill for imbalance waits for its replica's load to come back within --imbalance (answers being counted) before it spills; 0 = spill at once")
      ->envname("PROXY_SPILL_WAIT_S")->capture_default_str();
  s->add_option("--max-tracked-blocks", c->max_tracked_blocks)->envname("PROXY_MAX_TRACKED_BLOCKS")->capture_default_str();
  s->add_option("--adapter-retry-interval", c->adapter_retry_interval)->envname("PROXY_LORA_RETRY_S")->capture_default_str();
  s->add_option("--adapter-load-deadline", c->adapter_load_deadline)->envname("PROXY_LORA_LOAD_TIMEOUT_S")->capture_default_str();
  s->add_option("--adapter-attempt-timeout", c->adapter_attempt_timeout)->envname("PROXY_LORA_ATTEMPT_TIMEOUT_S")->capture_default_str();
  s->add_option("--connect-timeout", c->connect_timeout)->envname("PROXY_CONNECT_TIMEOUT_S")->capture_default_str();
  s->add_option("--first-byte-timeout", c->first_byte_timeout)->envname("PROXY_FIRST_BYTE_TIMEOUT_S")->capture_default_str();
  s->add_option("--idle-timeout", c->idle_timeout)->envname("PROXY_IDLE_TIMEOUT_S")->capture_default_str();
  s->add_option("--total-timeout", c->total_timeout, "0 = none")->envname("PROXY_TOTAL_TIMEOUT_S")->capture_default_str();
  s->add_option("--control-timeout", c->control_timeout)->envname("PROXY_CONTROL_TIMEOUT_S")->capture_default_str();
  s->add_option("--client-timeout", c->client_timeout)->envname("PROXY_CLIENT_TIMEOUT_S")->capture_default_str();
  s->add_option("--eject-after", c->eject_after)->envname("PROXY_EJECT_AFTER")->capture_default_str();
  s->add_option("--recover-after", c->recover_after)->envname("PROXY_RECOVER_AFTER")->capture_default_str();
  s->add_option("--eject-cooldown", c->eject_cooldown)->envname("PROXY_EJECT_COOLDOWN_S")->capture_default_str();
  s->add_option("--probe-interval", c->probe_interval)->envname("PROXY_PROBE_INTERVAL_S")->capture_default_str();
  s->add_option("--probe-timeout", c->probe_timeout)->envname("PROXY_PROBE_TIMEOUT_S")->capture_default_str();
  s->add_option("--reconcile-interval", c->reconcile_interval, "0 = off")->envname("PROXY_RECONCILE_INTERVAL_S")->capture_default_str();
  s->add_option("--conn-limit", c->conn_limit)->envname("PROXY_CONN_LIMIT")->capture_default_str();
  s->add_option("--upstream-keepalive", c->upstream_keepalive)->envname("PROXY_UPSTREAM_KEEPALIVE_S")->capture_default_str();
  s->add_option("--threads", c->threads, "0 = min(4, cores)")->envname("PROXY_THREADS")->capture_default_str();
  s->add_option("--unload-drain-timeout", c->unload_drain_timeout)->envname("PROXY_UNLOAD_DRAIN_S")->capture_default_str();
  s->add_option("--cached-tokens-header", c->cached_tokens_header)->envname("PROXY_CACHED_TOKENS_HEADER");
  s->add_option("--max-retries", c->max_retries)->envname("PROXY_MAX_RETRIES")->capture_default_str();
  s->add_option("--health-quorum", c->health_quorum, "0 = all")->envname("PROXY_HEALTH_QUORUM")->capture_default_str();
  s->add_option("--max-body-bytes", c->max_body_bytes)->envname("PROXY_MAX_BODY_BYTES")->capture_default_str();
  s->add_option("--max-push-bytes", c->max_push_bytes, "largest adapter push body (the proxy keeps a copy of each registered one)")
      ->envname("PROXY_MAX_PUSH_BYTES")->capture_default_str();
  s->add_option("--max-connections", c->max_connections, "client connections at most; more get 503 (0 = what the open-file limit leaves after --conn-limit)")
      ->envname("PROXY_MAX_CONNECTIONS")->capture_default_str();
  s->add_option("--stats-log-interval", c->stats_log_interval, "0 = off")->envname("PROXY_STATS_EVERY_S")->capture_default_str();
  s->add_option("--shutdown-grace", c->shutdown_grace)->envname("PROXY_SHUTDOWN_GRACE_S")->capture_default_str();
  s->add_option("--proxy-log-level", *level, "log level for the proxy")->envname("PROXY_LOG_LEVEL");
  reg.add(s, [c, level] { return run_proxy(*c, *level); });

  auto so = std::make_shared<bench::StubOptions>();
  auto* st = root.add_subcommand("stub-replica", "fake inference replica for proxy tests and benchmarks");
  st->group("");  // hidden
  st->add_option("--host", so->host)->capture_default_str();
  st->add_option("--port", so->port)->capture_default_str();
  st->add_option("--index", so->index)->capture_default_str();
  st->add_option("--latency", so->latency_s, "seconds per completion")->capture_default_str();
  st->add_option("--latency-spread", so->latency_spread, "each completion uniform in latency x [1 - S, 1 + S]")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  st->add_option("--no-adapter-found-first", so->no_adapter_found_first)->capture_default_str();
  st->add_option("--load-fail-status", so->load_fail_status)->capture_default_str();
  auto load_delay = std::make_shared<double>(0.0);
  st->add_option("--load-delay", *load_delay, "seconds before a load answers")->capture_default_str();
  st->add_option("--threads", so->threads)->capture_default_str();
  st->add_option("--nice", so->nice, "the server threads' nice value (0: unchanged)")->capture_default_str()->check(CLI::Range(-20, 19));
  reg.add(st, [so, load_delay] {
    block_signals();
    bench::StubReplica stub(*so);
    stub.load_delay_s = *load_delay;
    stub.start();
    std::printf("{\"listening\": \"%s:%u\"}\n", so->host.c_str(), static_cast<unsigned>(stub.port()));
    std::fflush(stdout);
    wait_for_signal_then([&] { stub.stop(); });
    return 0;
  });
}

}  // namespace lorasync::cli
