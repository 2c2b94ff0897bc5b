// util/process.h: process-wide start-up settings.
// Thread-safety: call configure_process() once at start-up, before other threads exist.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace lorasync {

// Raises glibc malloc's mmap and trim thresholds so large tensor buffers are reused instead of
// handed back to the OS on every free (1.4-1.7x faster LoRA training steps measured here).
// Also raises the open-file soft limit to the hard limit (servers hold one descriptor per
// connection; Debian's default soft limit is 1024), and ignores SIGPIPE (a write to a closed
// socket or pipe fails with EPIPE instead of ending the process).
void configure_process();

// The executable to start `lorasync <command>` children with: the `lorasync` front beside this
// executable when this is lorasync-engine (the front runs the proxy without libtorch and execs the
// engine for the rest), else this executable; "/proc/self/exe" itself if that link is unreadable.
std::string lorasync_executable();

// Descriptors this process may open (RLIMIT_NOFILE's soft limit; 1024 if unknown).
std::size_t open_file_limit();
// Descriptors a server may spend on connections: what the open-file limit leaves after a reserve
// for everything else (model files, logs, pools), at least 16.
std::size_t connection_budget();

// This process's container memory limit and usage in bytes (cgroup v2, then v1); -1 when there
// is none (or "max").
std::int64_t cgroup_memory_limit();
std::int64_t cgroup_memory_usage();

}  // namespace lorasync
