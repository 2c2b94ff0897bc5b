// Linked into every sanitizer test: creates spdlog's registry and default logger before main(),
// so before any thread starts. The Debian spdlog is not built with TSan, so TSan cannot see the
// lazy initialisation's guard when the first log call happens on one thread while another is
// already running (a report against spdlog's own internals, not ours).
#include <spdlog/spdlog.h>

namespace {
struct InitLogging {
  InitLogging() { (void)spdlog::default_logger_raw()->level(); }
} init_logging;
}  // namespace
