// proc_stats.h: what the benches read of a child process from /proc (Linux): its CPU time and a
// memory figure of its status file. Used by `bench proxy` and `bench startup`.
// Thread-safety: pure functions (they read /proc).
#pragma once

#include <sys/types.h>

#include <string_view>
#include <utility>

namespace lorasync::cli {

// The process's user and system CPU as the kernel reports them in /proc/PID/stat (utime, stime:
// clock ticks, every thread, live and ended). The kernel splits its precise run time between the
// two by the ratio of the timer ticks that found the process in each mode, so over a short span
// the ratio is an estimate. {0, 0} when the file cannot be read.
std::pair<double, double> proc_user_sys_ticks(pid_t pid);

// CPU seconds of every thread of `pid`, from the scheduler's nanosecond counters
// (/proc/PID/task/*/schedstat: time on the CPU first). /proc/PID/stat counts 10 ms ticks, which
// for a few hundredths of a millisecond per request, or a start of a few ms, is too coarse; it is
// the fallback. 0 when neither can be read.
double proc_cpu_s(pid_t pid);

// A "kB" field of /proc/PID/status (VmRSS, VmHWM, ...) in MiB; 0 when it cannot be read.
double proc_status_mib(pid_t pid, std::string_view field);

}  // namespace lorasync::cli
