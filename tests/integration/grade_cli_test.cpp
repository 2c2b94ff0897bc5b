// Black-box tests of `lorasync grade` and `lorasync bench grade` through the real binary.
#include <gtest/gtest.h>

#include <map>
#include <nlohmann/json.hpp>

#include <fstream>
#include <sstream>
#include <vector>

#include "util/files.h"
#include "util/jsonl.h"
#include "util/run_command.h"

namespace lorasync {
namespace {

using testing::run_lorasync;
using testing::shell_quote;

using testing::parse_jsonl;

TEST(GradeCli, GradesRowsFromFileToFile) {
  TempDir dir("lorasync-gradecli");
  fs::path in = dir.path() / "rows.jsonl", out = dir.path() / "verdicts.jsonl";
  {
    std::ofstream f(in);
    f << R"j({"id": "a", "completion": "so $\\boxed{\\frac{1}{2}}$.", "answer": "0.5"})j" << "\n"
      << R"j({"completion": "the answer is \\boxed{(2,1)}", "answer": "(1,2)"})j" << "\n"
      << R"j({"prediction": "$\\frac{31}{4}$", "answer": "7 3/4"})j" << "\n"
      << R"j({"completion": "no box, 42", "answer": 42})j" << "\n"
      << R"j({"completion": "\\boxed{4.4677 \\times 10^{14}}", "answer": ["4.4677 \\times 10^{14} Hz", "x"]})j" << "\n";
  }
  auto r = run_lorasync("grade --input " + shell_quote(in.string()) + " --output " +
                        shell_quote(out.string()) + " --summary");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto v = parse_jsonl(read_file(out));
  ASSERT_EQ(v.size(), 5u);
  EXPECT_EQ(v[0]["id"], "a");
  EXPECT_EQ(v[0]["index"], 0);
  EXPECT_EQ(v[0]["correct"], true);
  EXPECT_EQ(v[0]["extracted"], "\\frac{1}{2}");
  EXPECT_EQ(v[0]["reason"], "numeric_equal");
  EXPECT_EQ(v[1]["correct"], false);
  EXPECT_EQ(v[1]["reason"], "not_equal");
  EXPECT_EQ(v[2]["correct"], true);
  EXPECT_EQ(v[3]["correct"], false);
  EXPECT_EQ(v[3]["reason"], "no_box");
  EXPECT_EQ(v[4]["correct"], true);
  EXPECT_NE(r.err.find("3 correct"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("\"accuracy\":0.6"), std::string::npos) << r.err;
}

TEST(GradeCli, StdinToStdoutAndFallback) {
  std::string rows = R"j({"completion": "The answer is 12.", "answer": "12"})j" "\n";
  auto plain = run_lorasync("grade", rows);
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  EXPECT_EQ(parse_jsonl(plain.out).at(0)["correct"], false);
  auto fb = run_lorasync("grade --fallback", rows);
  ASSERT_EQ(fb.exit_code, 0) << fb.err;
  EXPECT_EQ(parse_jsonl(fb.out).at(0)["correct"], true);
}

TEST(GradeCli, MalformedRowsNameTheirLineAndTheRestIsGraded) {
  std::string rows = std::string(R"j({"completion": "\\boxed{1}", "answer": "1"})j") + "\n" +
                     "{not json\n" + "\n" + R"j({"completion": "\\boxed{1}"})j" + "\n" +
                     R"j({"completion": 5, "answer": "5"})j" + "\n" +
                     R"j({"completion": "\\boxed{2}", "answer": {"x": 1}})j" + "\n" +
                     R"j({"completion": "\\boxed{3}", "answer": "3"})j" + "\n";
  auto r = run_lorasync("grade", rows);
  EXPECT_EQ(r.exit_code, 2);
  auto v = parse_jsonl(r.out);
  ASSERT_EQ(v.size(), 6u);
  EXPECT_EQ(v[0]["correct"], true);
  EXPECT_NE(v[1]["error"].get<std::string>().find("line 2"), std::string::npos);
  EXPECT_NE(v[2]["error"].get<std::string>().find("line 4: missing field 'answer'"), std::string::npos)
      << v[2];
  EXPECT_NE(v[3]["error"].get<std::string>().find("line 5"), std::string::npos);
  EXPECT_NE(v[4]["error"].get<std::string>().find("line 6"), std::string::npos);
  EXPECT_EQ(v[5]["correct"], true);
  EXPECT_NE(r.err.find("line 2"), std::string::npos) << r.err;
}

TEST(GradeCli, MissingInputIsAnError) {
  auto r = run_lorasync("grade --input /nonexistent/rows.jsonl");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("/nonexistent/rows.jsonl"), std::string::npos) << r.err;
}

TEST(GradeCli, BenchGradeReportsThroughputWithBaseline) {
  auto r = run_lorasync("bench grade --seconds 0.05 --threads 2");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto v = parse_jsonl(r.out);
  ASSERT_EQ(v.size(), 12u);  // 3 workloads x (grades/s, p50, p99 on one thread, grades/s on 2)
  EXPECT_EQ(v[3]["metric"], "reference_self_grades_per_s_all_cores");
  EXPECT_EQ(v[3]["config"]["threads"], 2);
  for (const auto& rec : v) {
    EXPECT_EQ(rec["bench"], "grade");
    EXPECT_GT(rec["value"].get<double>(), 0);
    EXPECT_TRUE(rec.contains("baseline"));
    EXPECT_TRUE(rec.contains("ratio"));
  }
  EXPECT_EQ(v[0]["metric"], "reference_self_grades_per_s");
  EXPECT_GT(v[0]["config"]["accuracy"].get<double>(), 0.99);
}

// Math-Verify (the .venv's, scripts/math_verify_ref.py) as a same-run peer: agreement rows per
// configuration and its grades/s as the baseline of ours.
TEST(GradeCli, BenchGradeAgainstMathVerify) {
  auto r = run_lorasync("bench grade --seconds 0.05 --threads 1 --math-verify --math-verify-items 30");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::map<std::string, nlohmann::json> by_metric;
  for (const auto& rec : parse_jsonl(r.out)) by_metric[rec["metric"].get<std::string>()] = rec;
  for (const char* w : {"reference_self", "reference_rewrites", "sampled"}) {
    for (const char* c : {"rl", "default"}) {
      const auto& a = by_metric[std::string(w) + "_agreement_math_verify_" + c];
      ASSERT_TRUE(a.is_object()) << w << " " << c << "\n" << r.out;
      EXPECT_GE(a["value"].get<double>(), 0.0);
      EXPECT_LE(a["value"].get<double>(), 1.0);
      EXPECT_EQ(a["config"]["items"], 30);
    }
    const auto& speed = by_metric[std::string(w) + "_grades_per_s_vs_math_verify"];
    ASSERT_TRUE(speed.is_object()) << r.out;
    EXPECT_GT(speed["baseline"].get<double>(), 0);
  }
  EXPECT_GE(by_metric["reference_self_agreement_math_verify_rl"]["value"].get<double>(), 0.9);
}

}  // namespace
}  // namespace lorasync
