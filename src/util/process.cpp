#include "util/process.h"

#include <malloc.h>
#include <sys/resource.h>

#include <algorithm>

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
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = std::min<rlim_t>(rl.rlim_max, 1 << 20);
    setrlimit(RLIMIT_NOFILE, &rl);  // best effort: the limit stays as it was on failure
  }
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

}  // namespace lorasync
