// tests/util/jsonl.h: JSON lines (blank lines skipped) from a command's output or from a file of a
// run folder (metrics.jsonl, groups.jsonl), for black-box checks.
#pragma once

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace lorasync::testing {

inline std::vector<nlohmann::json> parse_jsonl(std::istream& in) {
  std::vector<nlohmann::json> out;
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  return out;
}

inline std::vector<nlohmann::json> parse_jsonl(const std::string& text) {
  std::istringstream in(text);
  return parse_jsonl(in);
}

inline std::vector<nlohmann::json> read_jsonl(const std::filesystem::path& p) {
  std::ifstream f(p);
  return parse_jsonl(f);
}

}  // namespace lorasync::testing
