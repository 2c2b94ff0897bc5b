// tests/util/jsonl.h: reads a JSON-lines file (blank lines skipped) for black-box checks of run
// folders (metrics.jsonl, groups.jsonl).
#pragma once

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace lorasync::testing {

inline std::vector<nlohmann::json> read_jsonl(const std::filesystem::path& p) {
  std::vector<nlohmann::json> out;
  std::ifstream f(p);
  std::string line;
  while (std::getline(f, line))
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  return out;
}

}  // namespace lorasync::testing
