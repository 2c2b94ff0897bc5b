#include "util/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include "util/error.h"

namespace lorasync::log {

void init_stderr() {
  static bool done = false;
  if (done) return;
  done = true;
  auto logger = spdlog::stderr_color_mt("lorasync");
  logger->set_pattern("%Y-%m-%d %H:%M:%S.%e %^%l%$ %v");
  spdlog::set_default_logger(logger);
}

void set_level(const std::string& name) {
  auto level = spdlog::level::from_str(name);
  if (level == spdlog::level::off && name != "off")
    throw_invalid("log level must be one of trace, debug, info, warn, error, off; got '{}'", name);
  spdlog::set_level(level);
}

}  // namespace lorasync::log
