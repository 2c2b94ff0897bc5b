// `lorasync train`: the asynchronous GRPO trainer (trainer.md). Signals: the first SIGTERM/SIGINT
// asks for a checkpoint and exit 143; a second one exits at once.
// --nproc-per-node N starts N data-parallel ranks of this command (docs/trainer.md "Data-parallel ranks") with the
// standard launcher variables, rank 0's store on a port chosen here (its listening socket is
// handed to rank 0, so no other process can take it), and supervises them: the first stop
// signal goes to rank 0 (which checkpoints and stops the others), a second to every rank, a
// third kills them; a rank that dies is reported by rank and signal; the exit code is rank 0's
// (or the first failing rank's).
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "commands.h"
#include "rl/trainer.h"
#include "util/log.h"
#include "util/error.h"

namespace lorasync::cli {

namespace {

// This process's arguments without --nproc-per-node (read back from /proc/self/cmdline).
std::vector<std::string> own_args_without_nproc() {
  std::ifstream f("/proc/self/cmdline", std::ios::binary);
  const std::string all((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::vector<std::string> args;
  for (std::size_t at = 0; at < all.size();) {
    const std::size_t end = all.find('\0', at);
    args.push_back(all.substr(at, end == std::string::npos ? std::string::npos : end - at));
    at = end == std::string::npos ? all.size() : end + 1;
  }
  std::vector<std::string> out;
  for (std::size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--nproc-per-node") {
      ++i;
      continue;
    }
    if (args[i].rfind("--nproc-per-node=", 0) == 0) continue;
    out.push_back(args[i]);
  }
  return out;
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exited with code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("was killed by signal ") + std::to_string(WTERMSIG(status)) + " (" + strsignal(WTERMSIG(status)) + ")";
  return "stopped";
}

int exit_code_of(int status) { return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0); }

int launch_ranks(int nproc) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw Error(ErrorKind::kEnvironment, std::string("socket: ") + std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(fd, 512) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0)
    throw Error(ErrorKind::kEnvironment, std::string("cannot open the ranks' store port on 127.0.0.1: ") + std::strerror(errno));
  const int port = ntohs(addr.sin_port);
  const std::vector<std::string> args = own_args_without_nproc();
  // Every rank's argv and environment, built before fork (the child only calls exec).
  std::vector<std::vector<std::string>> envs(static_cast<std::size_t>(nproc));
  for (int r = 0; r < nproc; ++r) {
    auto& e = envs[static_cast<std::size_t>(r)];
    const std::map<std::string, std::string> set_here = {
        {"RANK", std::to_string(r)}, {"LOCAL_RANK", std::to_string(r)}, {"WORLD_SIZE", std::to_string(nproc)},
        {"LOCAL_WORLD_SIZE", std::to_string(nproc)}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(port)}};
    for (char** v = environ; *v; ++v) {
      const std::string kv = *v, name = kv.substr(0, kv.find('='));
      if (!set_here.count(name) && name != "LORASYNC_STORE_LISTEN_FD" && name != "TORCHELASTIC_USE_AGENT_STORE") e.push_back(kv);
    }
    for (const auto& [k, v] : set_here) e.push_back(k + "=" + v);
    if (r == 0) e.push_back("LORASYNC_STORE_LISTEN_FD=" + std::to_string(fd));  // rank 0 hosts the store on it
  }
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::vector<std::vector<char*>> envps;
  for (auto& e : envs) {
    auto& p = envps.emplace_back();
    for (auto& kv : e) p.push_back(kv.data());
    p.push_back(nullptr);
  }
  sigset_t set, none;
  sigemptyset(&set);
  sigemptyset(&none);
  for (int sig : {SIGTERM, SIGINT, SIGCHLD}) sigaddset(&set, sig);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  const pid_t launcher = ::getpid();
  std::map<pid_t, int> rank_of;
  std::vector<pid_t> pids;
  for (int r = 0; r < nproc; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) throw Error(ErrorKind::kEnvironment, std::string("fork: ") + std::strerror(errno));
    if (pid == 0) {
      ::setpgid(0, 0);  // a terminal's Ctrl-C reaches the launcher only, which forwards it
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);  // a launcher that dies stops its ranks (rank 0 checkpoints)
      if (::getppid() != launcher) ::_exit(143);
      pthread_sigmask(SIG_SETMASK, &none, nullptr);
      if (r == 0) ::fcntl(fd, F_SETFD, 0);
      ::execve("/proc/self/exe", argv.data(), envps[static_cast<std::size_t>(r)].data());
      ::_exit(127);
    }
    rank_of[pid] = r;
    pids.push_back(pid);
  }
  ::close(fd);
  std::string pid_list;
  for (std::size_t r = 0; r < pids.size(); ++r) pid_list += fmt::format("{}rank {} pid {}", r ? ", " : "", r, pids[r]);
  std::fprintf(stderr, "lorasync train: started %d data-parallel ranks (store 127.0.0.1:%d; %s)\n", nproc, port, pid_list.c_str());
  using Clock = std::chrono::steady_clock;
  std::map<int, int> status;  // rank -> wait status
  std::vector<int> failed_order;
  int signals = 0;
  auto never = Clock::time_point::max();
  auto rank0_exit = never, worker_failed = never;
  auto alive = [&](pid_t p) { return !status.count(rank_of[p]); };
  while (status.size() < pids.size()) {
    const timespec tick{0, 200'000'000};
    const int sig = sigtimedwait(&set, nullptr, &tick);
    if (sig == SIGTERM || sig == SIGINT) {
      ++signals;
      std::fprintf(stderr, "\nlorasync train: signal %d: %s\n", sig,
                   signals == 1 ? "rank 0 checkpoints and stops the run (again to stop every rank at once)"
                                : signals == 2 ? "stopping every rank (again to kill them)" : "killing every rank");
      for (pid_t p : pids) {
        if (!alive(p)) continue;
        if (rank_of[p] == 0) ::kill(p, signals >= 3 ? SIGKILL : SIGTERM);  // a second one: it exits at once
        else if (signals >= 2) ::kill(p, SIGKILL);  // the others hold nothing rank 0 has not saved
      }
    }
    for (;;) {
      int st = 0;
      const pid_t p = ::waitpid(-1, &st, WNOHANG);
      if (p <= 0) break;
      if (!rank_of.count(p)) continue;
      const int r = rank_of[p];
      status[r] = st;
      if (!(WIFEXITED(st) && WEXITSTATUS(st) == 0)) {
        failed_order.push_back(r);
        std::fprintf(stderr, "lorasync train: rank %d (pid %d) %s\n", r, static_cast<int>(p), describe_status(st).c_str());
        if (r != 0 && worker_failed == never) worker_failed = Clock::now();
      }
      if (r == 0) rank0_exit = Clock::now();
    }
    const auto now = Clock::now();
    // After rank 0, the others have a minute to hear the end of the run and leave.
    if (rank0_exit != never && now - rank0_exit > std::chrono::seconds(60)) {
      for (pid_t p : pids)
        if (alive(p)) ::kill(p, SIGKILL);
      rank0_exit = never;
    }
    // Rank 0 notices a dead rank by itself within its heartbeat limit; one that does not (still
    // joining the group, say) is asked to stop after a minute, and told twice after two.
    if (worker_failed != never && alive(pids[0]) && now - worker_failed > std::chrono::seconds(60)) {
      std::fprintf(stderr, "lorasync train: rank 0 has not stopped after a rank failed: stopping it\n");
      ::kill(pids[0], SIGTERM);
      worker_failed = now - std::chrono::seconds(30);  // again in 30 s (the second exits at once)
    }
  }
  if (exit_code_of(status[0]) != 0) return exit_code_of(status[0]);
  for (int r : failed_order) return exit_code_of(status[r]);
  return 0;
}

int run(rl::TrainArgs a) {
  if (a.api_key.empty())
    if (const char* k = std::getenv("LORASYNC_API_KEY")) a.api_key = k;
  // Stop signals are handled by one thread: the first sets the flag, a second exits at once.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::thread([set]() mutable {
    int sig = 0;
    sigwait(&set, &sig);
    std::fprintf(stderr, "\nlorasync train: signal %d: checkpointing and stopping (again to exit at once)\n", sig);
    rl::g_stop_signal = 1;
    sigwait(&set, &sig);
    std::_Exit(143);
  }).detach();
  return rl::run_trainer(a);
}

}  // namespace

void register_train(CLI::App& root, Registry& reg) {
  auto a = std::make_shared<rl::TrainArgs>();
  auto* sub = root.add_subcommand("train", "asynchronous GRPO training of a LoRA adapter against lorasync serve/proxy");
  sub->add_option("--config", a->config_path, "TOML configuration (trainer.md section 7)");
  sub->add_option("--set", a->overrides, "override section.key=value (TOML value; repeatable, applied in order)");
  auto* resume = sub->add_option("--resume", a->resume_dir, "continue from a checkpoint (default: the latest complete one)")
                     ->expected(0, 1);
  sub->add_flag("--resume-force", a->resume_force, "accept non-operational configuration changes on resume");
  sub->add_flag("--overwrite", a->overwrite, "start over in an output_dir that holds checkpoints or adapters");
  sub->add_flag("--dry-run", a->dry_run, "check the configuration, data and server capabilities, then exit");
  sub->add_option("--api-key", a->api_key, "bearer token for the server or proxy (default: $LORASYNC_API_KEY)");
  auto nproc = std::make_shared<int>(1);
  sub->add_option("--nproc-per-node", *nproc,
                  "start N data-parallel ranks on this machine (Gloo; each takes a share of every step's rows); "
                  "other launchers set RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT instead")
      ->check(CLI::Range(1, 256));
  reg.add(sub, [a, resume, nproc]() {
    a->resume = resume->count() > 0;
    if (*nproc > 1) {
      if (std::getenv("WORLD_SIZE") && std::string(std::getenv("WORLD_SIZE")) != "1")
        throw Error(ErrorKind::kInvalidInput, "--nproc-per-node with WORLD_SIZE already set: use one launcher, not two");
      return launch_ranks(*nproc);
    }
    return run(*a);
  });
}

}  // namespace lorasync::cli
