// rl/dist.cpp: c10d's TCPStore and Gloo process group behind rl/dist.h. The Gloo headers come from
// Debian's libgloo-dev (the wheel ships libtorch with Gloo built in, not its headers); only
// c10d's own types cross the boundary, so the two versions never share a layout.
#include "rl/dist.h"

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <thread>

#include "util/error.h"
#include "util/log.h"

namespace lorasync::rl {

#ifdef LORASYNC_DIST_NCCL
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, const std::string& prefix,
                                                    int rank, int world, std::chrono::milliseconds timeout);  // dist_nccl.cpp
#endif

namespace {

using Clock = std::chrono::steady_clock;
// Values larger than this go as numbered chunks: the libuv TCPStore server (the default) refuses
// payloads over 8 MiB by dropping the connection.
constexpr std::size_t kChunkBytes = std::size_t{4} << 20;

std::optional<long> env_int(const char* name, long lo, long hi) {
  const char* v = std::getenv(name);
  if (!v || !*v) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const long x = std::strtol(v, &end, 10);
  if (errno != 0 || *end != '\0' || x < lo || x > hi)
    throw_invalid("environment variable {}={} is not an integer in [{}, {}]", name, v, lo, hi);
  return x;
}

std::chrono::milliseconds ms(double s) { return std::chrono::milliseconds(static_cast<std::int64_t>(s * 1000)); }

std::vector<std::uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }

}  // namespace

std::optional<DistEnv> DistEnv::from_environment() {
  const auto world = env_int("WORLD_SIZE", 1, 4096);
  if (!world || *world == 1) return std::nullopt;
  DistEnv e;
  e.world = static_cast<int>(*world);
  const auto rank = env_int("RANK", 0, *world - 1);
  if (!rank) throw_invalid("WORLD_SIZE={} is set but RANK is not: a launcher sets both (torchrun, or --nproc-per-node)", e.world);
  e.rank = static_cast<int>(*rank);
  e.local_rank = static_cast<int>(env_int("LOCAL_RANK", 0, 4095).value_or(e.rank));
  if (const char* a = std::getenv("MASTER_ADDR"); a && *a) e.master_addr = a;
  const auto port = env_int("MASTER_PORT", 1, 65535);
  if (!port) throw_invalid("WORLD_SIZE={} is set but MASTER_PORT is not: rank 0's store address is MASTER_ADDR:MASTER_PORT", e.world);
  e.master_port = static_cast<int>(*port);
  if (e.rank == 0) e.listen_fd = static_cast<int>(env_int("LORASYNC_STORE_LISTEN_FD", 0, 1 << 20).value_or(-1));
  if (e.listen_fd >= 0) ::unsetenv("LORASYNC_STORE_LISTEN_FD");  // not for the processes rank 0 starts
  // A launcher that restarts the ranks keeps its store: each attempt has its own keys.
  e.key_prefix = "lorasync/" + std::to_string(env_int("TORCHELASTIC_RESTART_COUNT", 0, 1 << 20).value_or(0)) + "/";
  if (const char* a = std::getenv("TORCHELASTIC_USE_AGENT_STORE")) e.agent_store = std::string(a) == "True" || std::string(a) == "1";
  return e;
}

DistOptions DistOptions::from_environment() {
  DistOptions o;
  if (auto t = env_int("LORASYNC_DIST_TIMEOUT_S", 1, 7 * 86400)) o.timeout_s = static_cast<double>(*t);
  if (auto t = env_int("LORASYNC_DIST_SILENT_S", 1, 86400)) o.silent_after_s = static_cast<double>(*t);
  return o;
}

struct DistGroup::Impl {
  DistEnv env;
  DistOptions opts;
  c10::intrusive_ptr<c10d::Store> store;      // the trainer thread's connection
  c10::intrusive_ptr<c10d::Store> hb_store;   // the heartbeat's (and liveness checks')
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg;
  c10::intrusive_ptr<c10d::Backend> nccl;  // CUDA ranks, where built with NCCL
  std::mutex hb_mu;  // hb_store, seen, moved_at
  std::vector<std::int64_t> seen;
  std::vector<Clock::time_point> moved_at;
  std::atomic<bool> quit{false};
  std::thread heartbeat;

  std::string hb_key(int r) const { return env.key_prefix + "hb/" + std::to_string(r); }

  ~Impl() {
    quit = true;
    if (heartbeat.joinable()) heartbeat.join();
  }
};

DistGroup::DistGroup(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DistGroup::~DistGroup() = default;

std::unique_ptr<DistGroup> DistGroup::connect(const DistEnv& env, const DistOptions& opts) {
  auto im = std::make_unique<Impl>();
  im->env = env;
  im->opts = opts;
  c10d::TCPStoreOptions so;
  so.port = static_cast<std::uint16_t>(env.master_port);
  so.isServer = env.rank == 0 && !env.agent_store;
  so.numWorkers = static_cast<std::size_t>(env.world);
  so.waitWorkers = false;
  so.timeout = ms(opts.timeout_s);
  if (so.isServer && env.listen_fd >= 0) {
    ::fcntl(env.listen_fd, F_SETFD, FD_CLOEXEC);  // the store's socket stays in this process
    so.masterListenFd = env.listen_fd;
  }
  try {
    auto tcp = c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
    im->store = tcp;
    im->hb_store = tcp->clone();
    auto gopts = c10d::ProcessGroupGloo::Options::create(ms(opts.timeout_s));
    const std::string& a = env.master_addr;
    if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname)
      gopts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
    else if (a == "127.0.0.1" || a == "localhost" || a == "::1")  // one machine: loopback, whatever the hostname resolves to
      gopts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    else
      gopts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>(env.key_prefix + "gloo", im->store);
    im->pg = c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, env.rank, env.world, gopts);
  } catch (const std::exception& e) {
    throw Error(ErrorKind::kUnavailable,
                fmt::format("rank {} of {}: could not join the data-parallel group at {}:{} within {:.0f} s: {}", env.rank,
                            env.world, env.master_addr, env.master_port, opts.timeout_s, e.what()));
  }
  im->seen.assign(static_cast<std::size_t>(env.world), -1);
  im->moved_at.assign(static_cast<std::size_t>(env.world), Clock::now());
  Impl* raw = im.get();
  im->heartbeat = std::thread([raw] {
    while (!raw->quit.load()) {
      try {
        std::lock_guard lk(raw->hb_mu);
        raw->hb_store->add(raw->hb_key(raw->env.rank), 1);
      } catch (const std::exception& e) {
        LS_LOG_WARN("dist", "rank {}: heartbeat failed: {}", raw->env.rank, e.what());
      }
      for (int i = 0; i < 10 && !raw->quit.load(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  });
  LS_LOG_INFO("dist", "rank {} of {} joined (store {}:{}{})", env.rank, env.world, env.master_addr, env.master_port,
              so.isServer ? ", hosted here" : "");
  return std::unique_ptr<DistGroup>(new DistGroup(std::move(im)));
}

std::string DistGroup::use_device(c10::Device device) {
  if (!device.is_cuda()) return "gloo";
  const char* want = std::getenv("LORASYNC_DIST_BACKEND");
  if (want && std::string(want) == "gloo") return "gloo (LORASYNC_DIST_BACKEND)";
#ifdef LORASYNC_DIST_NCCL
  if (!impl_->nccl)
    impl_->nccl = make_nccl_backend(impl_->store, impl_->env.key_prefix, rank(), world(), ms(impl_->opts.timeout_s));
  return "nccl";
#else
  if (want && std::string(want) == "nccl") throw_invalid("LORASYNC_DIST_BACKEND=nccl but this build has no NCCL (nccl.h was not found)");
  return "gloo (this build has no NCCL)";
#endif
}

int DistGroup::rank() const { return impl_->env.rank; }
int DistGroup::world() const { return impl_->env.world; }

// Values are tagged: 'v' + bytes inline, or 'c' + the number of chunks stored under key#i.
void DistGroup::set(const std::string& key, const std::string& value) {
  const std::string k = impl_->env.key_prefix + key;
  try {
    if (value.size() <= kChunkBytes) {
      impl_->store->set(k, bytes_of("v" + value));
      return;
    }
    const std::size_t n = (value.size() + kChunkBytes - 1) / kChunkBytes;
    for (std::size_t i = 0; i < n; ++i) impl_->store->set(k + "#" + std::to_string(i), bytes_of(value.substr(i * kChunkBytes, kChunkBytes)));
    impl_->store->set(k, bytes_of("c" + std::to_string(n)));  // last: a reader sees every chunk
  } catch (const std::exception& e) {
    throw Error(ErrorKind::kUnavailable, describe_failure("writing " + key + " to the store", e));
  }
}

namespace {

std::size_t chunk_count(const std::string& tagged, const std::string& key) {
  try {
    return static_cast<std::size_t>(std::stoull(tagged.substr(1)));
  } catch (const std::exception&) {
    throw_invalid("store value {} has a corrupt chunk count", key);
  }
}

}  // namespace

void DistGroup::erase(const std::string& key) {
  const std::string k = impl_->env.key_prefix + key;
  try {
    if (!impl_->store->check({k})) return;
    const auto v = impl_->store->get(k);
    if (!v.empty() && v[0] == 'c') {
      const std::size_t n = chunk_count(std::string(v.begin(), v.end()), key);
      for (std::size_t i = 0; i < n; ++i) impl_->store->deleteKey(k + "#" + std::to_string(i));
    }
    impl_->store->deleteKey(k);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(ErrorKind::kUnavailable, describe_failure("deleting " + key + " from the store", e));
  }
}

std::optional<std::string> DistGroup::get_wait(const std::string& key, int watch, const std::function<bool()>& give_up) {
  const std::string k = impl_->env.key_prefix + key;
  auto pause = std::chrono::milliseconds(1);
  auto last_check = Clock::now();
  for (;;) {
    try {
      if (impl_->store->check({k})) {
        const auto v = impl_->store->get(k);
        if (v.empty()) throw_invalid("store value {} is empty", key);
        if (v[0] == 'v') return std::string(v.begin() + 1, v.end());
        if (v[0] != 'c') throw_invalid("store value {} has an unknown tag", key);
        const std::size_t n = chunk_count(std::string(v.begin(), v.end()), key);
        std::string out;
        for (std::size_t i = 0; i < n; ++i) {
          const auto c = impl_->store->get(k + "#" + std::to_string(i));
          out.append(c.begin(), c.end());
        }
        return out;
      }
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      throw Error(ErrorKind::kUnavailable, describe_failure("reading " + key + " from the store", e));
    }
    if (give_up && give_up()) return std::nullopt;
    if (watch >= 0 && Clock::now() - last_check > std::chrono::seconds(1)) {
      last_check = Clock::now();
      for (int r : silent_ranks())
        if (r == watch)
          throw Error(ErrorKind::kUnavailable,
                      fmt::format("rank {} stopped answering (no heartbeat for {:.0f} s) while rank {} waited for {}", r,
                                  impl_->opts.silent_after_s, rank(), key));
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(20));
  }
}

void DistGroup::allreduce_sum(at::Tensor& flat) {
  LS_CHECK(flat.is_contiguous(), "allreduce_sum needs a contiguous tensor");
  if (flat.is_cuda() && impl_->nccl) {
    std::vector<at::Tensor> ts{flat};
    try {
      impl_->nccl->allreduce(ts)->wait();  // the current stream waits for NCCL's
    } catch (const std::exception& e) {
      throw Error(ErrorKind::kUnavailable, describe_failure("the gradient all-reduce (NCCL)", e));
    }
    return;
  }
  at::Tensor host = flat.is_cpu() ? flat : flat.to(torch::kCPU);
  std::vector<at::Tensor> ts{host};
  try {
    impl_->pg->allreduce(ts)->wait();
  } catch (const std::exception& e) {
    throw Error(ErrorKind::kUnavailable, describe_failure("the gradient all-reduce", e));
  }
  if (!flat.is_cpu()) flat.copy_(host);
}

std::vector<std::vector<double>> DistGroup::allgather(const std::vector<double>& mine) {
  auto in = torch::tensor(mine, torch::kFloat64);
  std::vector<at::Tensor> inputs{in};
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < world(); ++r) outputs[0].push_back(torch::empty_like(in));
  try {
    impl_->pg->allgather(outputs, inputs)->wait();
  } catch (const std::exception& e) {
    throw Error(ErrorKind::kUnavailable, describe_failure("the statistics all-gather", e));
  }
  std::vector<std::vector<double>> out;
  for (const auto& t : outputs[0]) out.emplace_back(t.data_ptr<double>(), t.data_ptr<double>() + t.numel());
  return out;
}

std::vector<int> DistGroup::silent_ranks() {
  std::vector<int> out;
  std::lock_guard lk(impl_->hb_mu);
  const auto now = Clock::now();
  for (int r = 0; r < world(); ++r) {
    if (r == rank()) continue;
    std::int64_t v = -1;
    try {
      v = impl_->hb_store->add(impl_->hb_key(r), 0);
    } catch (const std::exception&) {
      v = impl_->seen[static_cast<std::size_t>(r)];  // the store itself is gone: nothing moves
    }
    auto& seen = impl_->seen[static_cast<std::size_t>(r)];
    auto& at = impl_->moved_at[static_cast<std::size_t>(r)];
    if (v != seen) seen = v, at = now;
    else if (std::chrono::duration<double>(now - at).count() > impl_->opts.silent_after_s) out.push_back(r);
  }
  return out;
}

std::string DistGroup::describe_failure(const std::string& what, const std::exception& e) {
  // A peer that died is seen by the collective at once, by its heartbeat only after
  // silent_after_s: wait that long (bounded) for the heartbeats to say who it was.
  std::vector<int> silent = silent_ranks();
  const auto until = Clock::now() + ms(impl_->opts.silent_after_s + 2);
  while (silent.empty() && Clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
    silent = silent_ranks();
  }
  std::string who;
  for (int r : silent) who += (who.empty() ? "" : ", ") + std::to_string(r);
  std::string msg = e.what();
  if (const auto nl = msg.find('\n'); nl != std::string::npos) msg.resize(nl);  // c10 appends a C++ stack
  if (silent.empty())
    return fmt::format("rank {}: {} failed ({}); every other rank still has a heartbeat", rank(), what, msg);
  return fmt::format("rank{} stopped answering (no heartbeat for {:.0f} s): rank {}: {} failed ({})",
                     silent.size() > 1 ? "s " + who : " " + who, impl_->opts.silent_after_s, rank(), what, msg);
}

}  // namespace lorasync::rl
