// Every reference answer of ../shared/data/*.jsonl verifies against itself, boxed inside a
// sentence, and against the spec's simple rewrites; the ones that cannot are listed with the
// reason, and they must stay under 1%.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "reward/grade.h"

namespace lorasync::reward {
namespace {

namespace fs = std::filesystem;

struct Row {
  std::string file;
  int line = 0;
  std::vector<std::string> answers;
};

std::string to_answer(const nlohmann::json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_number_integer()) return std::to_string(v.get<long long>());
  return v.dump();
}

std::vector<Row> load_rows() {
  std::vector<Row> rows;
  fs::path dir = fs::path(LORASYNC_SHARED_DIR) / "data";
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(dir))
    if (entry.path().extension() == ".jsonl") files.push_back(entry.path());
  std::sort(files.begin(), files.end());
  for (const fs::path& f : files) {
    std::ifstream in(f);
    std::string line;
    int n = 0;
    while (std::getline(in, line)) {
      ++n;
      if (line.empty()) continue;
      auto j = nlohmann::json::parse(line);
      Row r{f.filename().string(), n, {}};
      const auto& a = j.at("answer");
      if (a.is_array())
        for (const auto& x : a) r.answers.push_back(to_answer(x));
      else
        r.answers.push_back(to_answer(a));
      rows.push_back(std::move(r));
    }
  }
  return rows;
}

std::string replace_all(std::string s, std::string_view from, std::string_view to) {
  std::size_t p = 0;
  while ((p = s.find(from, p)) != std::string::npos) {
    s.replace(p, from.size(), to);
    p += to.size();
  }
  return s;
}

std::string trim(std::string s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.erase(s.begin());
  return s;
}

std::string strip_dollars(std::string s) {
  s = trim(s);
  if (s.size() >= 2 && s.front() == '$' && s.back() == '$') s = s.substr(1, s.size() - 2);
  return s;
}

// The spec's simple rewrites of an answer.
std::vector<std::pair<std::string, std::string>> rewrites(const std::string& raw) {
  std::string a = strip_dollars(raw);
  std::vector<std::pair<std::string, std::string>> out;
  out.emplace_back("self", a);
  out.emplace_back("dfrac", replace_all(a, "\\frac", "\\dfrac"));
  std::string spaced;
  for (char c : a) {
    spaced += c;
    if (c == '+' || c == '=' || c == ',') spaced += ' ';
  }
  out.emplace_back("spaces", " " + spaced + " ");
  out.emplace_back("period", a + ".");
  std::string lr = replace_all(replace_all(a, "(", "\\left("), ")", "\\right)");
  if (lr.find("\\left\\left") == std::string::npos && lr.find("\\right\\right") == std::string::npos &&
      lr.find("\\left(") != std::string::npos)
    out.emplace_back("left_right", lr);
  bool has_relation = a.find('=') != std::string::npos || a.find('<') != std::string::npos ||
                      a.find('>') != std::string::npos || a.find("\\le") != std::string::npos ||
                      a.find("\\ge") != std::string::npos || a.find("\\in") != std::string::npos;
  if (!has_relation) out.emplace_back("x_equals", "x = " + a);
  return out;
}

TEST(RewardData, ReferenceAnswersVerifyAgainstThemselvesAndRewrites) {
  std::vector<Row> rows = load_rows();
  ASSERT_GT(rows.size(), 3000u) << "data under " << LORASYNC_SHARED_DIR;
  int checks = 0, failures = 0;
  std::vector<std::string> listed;
  for (const Row& row : rows) {
    for (const std::string& answer : row.answers) {
      for (const auto& [kind, text] : rewrites(answer)) {
        std::string completion = "Putting everything together, the answer is $\\boxed{" + text + "}$.";
        GradeResult r = grade(completion, answer);
        ++checks;
        if (!r.correct) {
          ++failures;
          listed.push_back(row.file + ":" + std::to_string(row.line) + " [" + kind + "] answer '" +
                           trim(answer) + "' rewrite '" + text + "' -> " + r.reason);
        }
      }
      // The raw answer as a bare prediction (no box): the grade_answer path.
      GradeResult bare = grade_answer(answer, answer);
      ++checks;
      if (!bare.correct) {
        ++failures;
        listed.push_back(row.file + ":" + std::to_string(row.line) + " [bare] '" + answer + "' -> " +
                         bare.reason);
      }
    }
  }
  for (const std::string& l : listed) std::printf("cannot verify: %s\n", l.c_str());
  std::printf("reference self-checks: %d, failures: %d (%.3f%%)\n", checks, failures,
              100.0 * failures / std::max(checks, 1));
  EXPECT_LT(failures * 100, checks) << "more than 1% of the reference self-checks fail";
}

TEST(RewardData, ListReferencesAcceptAnyMember) {
  std::vector<Row> rows = load_rows();
  int multi = 0;
  for (const Row& row : rows) {
    if (row.answers.size() < 2) continue;
    ++multi;
    const std::string& last = row.answers.back();
    GradeResult r = grade("\\boxed{" + strip_dollars(last) + "}", row.answers);
    EXPECT_TRUE(r.correct) << row.file << ":" << row.line << " " << last << " -> " << r.reason;
  }
  EXPECT_GT(multi, 0);
}

}  // namespace
}  // namespace lorasync::reward
