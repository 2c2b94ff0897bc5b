#include "util/process.h"

#include <malloc.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <fstream>
#include <string>
#include <string_view>

namespace lorasync {

void configure_process() {
  static bool done = false;
  if (done) return;
  done = true;
  // Buffers up to 32 MiB come from the heap and stay mapped after free, so a repeated large
  // allocation (a tensor, an HTTP body) does not page-fault its memory in again every time. 32 MiB
  // is the most glibc accepts (HEAP_MAX_SIZE / 2 on 64-bit: a larger value is refused, and setting
  // any of these options also turns off glibc's own adaptive threshold, which would leave every
  // allocation above 128 KiB a fresh mmap).
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  mallopt(M_TOP_PAD, 64 << 20);
  // A write to a socket whose peer is gone fails with EPIPE instead of killing the process. The
  // sockets of libraries we do not control (c10d's store, Gloo) send without MSG_NOSIGNAL: a
  // data-parallel rank whose peer was killed died of SIGPIPE before it could report the peer and
  // write its checkpoint.
  std::signal(SIGPIPE, SIG_IGN);
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = std::min<rlim_t>(rl.rlim_max, 1 << 20);
    setrlimit(RLIMIT_NOFILE, &rl);  // best effort: the limit stays as it was on failure
  }
}

std::string lorasync_executable() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return "/proc/self/exe";
  std::string self(buf, static_cast<std::size_t>(n));
  // An executable replaced on disk while it runs (a rebuild) reads "<path> (deleted)".
  constexpr std::string_view kDeleted = " (deleted)";
  if (self.size() > kDeleted.size() && self.ends_with(kDeleted)) self.resize(self.size() - kDeleted.size());
  const auto slash = self.rfind('/');
  const std::string dir = slash == std::string::npos ? std::string(".") : self.substr(0, slash);
  const std::string name = slash == std::string::npos ? self : self.substr(slash + 1);
  if (name == "lorasync-engine") {
    const std::string front = dir + "/lorasync";
    if (::access(front.c_str(), X_OK) == 0) return front;
  }
  return self;
}

std::size_t open_file_limit() {
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return 1024;
  return static_cast<std::size_t>(rl.rlim_cur);
}

std::size_t connection_budget() {
  const std::size_t n = open_file_limit();
  const std::size_t reserve = 64 + n / 8;
  return std::max<std::size_t>(16, n > reserve ? n - reserve : 0);
}

namespace {

// The first of `files` holding a number ("max" and absent files are skipped), or -1.
std::int64_t first_number(std::initializer_list<const char*> files) {
  for (const char* f : files) {
    std::ifstream in(f);
    std::string v;
    if (!(in >> v) || v == "max") continue;
    try {
      return std::stoll(v);
    } catch (const std::exception&) {
    }
  }
  return -1;
}

}  // namespace

std::int64_t cgroup_memory_limit() {
  return first_number({"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"});
}

std::int64_t cgroup_memory_usage() {
  return first_number({"/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory/memory.usage_in_bytes"});
}

}  // namespace lorasync
