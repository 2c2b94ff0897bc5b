// util/log.h: component-tagged logging on spdlog ("[engine] ...").
// Thread-safety: thread-safe (spdlog's multi-threaded sinks).
#pragma once

#include <spdlog/spdlog.h>

#include <string>

namespace lorasync::log {

// Sets the global level from a name: trace, debug, info, warn, error, off. Throws InvalidInput.
void set_level(const std::string& name);

// Logs go to stderr; stdout is for command results (JSON).
void init_stderr();

}  // namespace lorasync::log

#define LS_LOG_DEBUG(component, ...) ::spdlog::debug("[" component "] " __VA_ARGS__)
#define LS_LOG_INFO(component, ...) ::spdlog::info("[" component "] " __VA_ARGS__)
#define LS_LOG_WARN(component, ...) ::spdlog::warn("[" component "] " __VA_ARGS__)
#define LS_LOG_ERROR(component, ...) ::spdlog::error("[" component "] " __VA_ARGS__)
