#include "util/process.h"

#include <malloc.h>

namespace lorasync {

void configure_process() {
  static bool done = false;
  if (done) return;
  done = true;
  // 1 GiB: buffers below this come from the heap and stay mapped after free.
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  mallopt(M_TOP_PAD, 64 << 20);
}

}  // namespace lorasync
