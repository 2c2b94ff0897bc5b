// util/json_lines.h: reading JSON-lines files that another process may be appending to (metrics.jsonl,
// a TRL driver's timeline): empty lines and lines that do not parse (a line being written) are
// skipped. Thread-safety: pure function.
#pragma once

#include <nlohmann/json.hpp>

#include <filesystem>
#include <vector>

namespace lorasync {

// Every complete JSON line of `path` (none when the file does not exist).
std::vector<nlohmann::json> read_jsonl(const std::filesystem::path& path);

}  // namespace lorasync
