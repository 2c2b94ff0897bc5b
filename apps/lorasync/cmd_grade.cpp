// `lorasync grade`: the maths verifier over JSONL rows.
//
// Input rows: {"completion": "...full model output..."} or {"prediction": "...an answer..."},
// plus "answer": a string, a number, or a list of acceptable answers (any match is correct); an
// optional "id" is copied to the verdict. "completion" is graded as training does (last \boxed{};
// no box -> incorrect, unless --fallback); "prediction" is a bare answer (grade_answer in grade.h).
// Output: one JSONL verdict per row: {"index", "line", ["id"], "correct", "extracted", "reason"}.
// Error policy: a malformed row (bad JSON, missing fields, wrong types) gets a verdict line with
// "error" naming its line number, a message on stderr, and grading goes on; the exit status is 2
// at the end when any row was malformed, 0 otherwise (1 on I/O failure).
// --summary: accuracy and reason counts on stderr, as a readable line and a JSON line.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "commands.h"
#include "reward/grade.h"
#include "util/error.h"

namespace lorasync::cli {
namespace {

struct GradeCmdOptions {
  std::string input = "-";   // JSONL rows; "-" = stdin
  std::string output = "-";  // JSONL verdicts; "-" = stdout
  bool summary = false;      // accuracy on stderr at the end
  bool fallback = false;     // evaluation-only extraction when a completion has no box
};

// A JSON answer (string, number) as text; InvalidInput otherwise.
std::string answer_text(const nlohmann::json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_number_integer()) return std::to_string(v.get<long long>());
  if (v.is_number_unsigned()) return std::to_string(v.get<unsigned long long>());
  if (v.is_number_float()) return v.dump();
  throw_invalid("'answer' must be a string, a number or a list of them, got {}", v.type_name());
}

std::vector<std::string> answers_of(const nlohmann::json& row) {
  auto it = row.find("answer");
  if (it == row.end()) throw_invalid("missing field 'answer'");
  std::vector<std::string> out;
  if (it->is_array()) {
    if (it->empty()) throw_invalid("'answer' is an empty list");
    for (const auto& v : *it) out.push_back(answer_text(v));
  } else {
    out.push_back(answer_text(*it));
  }
  return out;
}

int run(const GradeCmdOptions& o) {
  std::ifstream in_file;
  std::istream* in = &std::cin;
  if (o.input != "-") {
    in_file.open(o.input);
    if (!in_file) throw_not_found("--input: cannot open '{}'", o.input);
    in = &in_file;
  }
  std::ofstream out_file;
  std::ostream* out = &std::cout;
  if (o.output != "-") {
    out_file.open(o.output, std::ios::trunc);
    if (!out_file) throw_env("--output: cannot open '{}' for writing: {}", o.output, errno_text());
    out = &out_file;
  }
  reward::GradeOptions gopt;
  gopt.fallback = o.fallback;

  std::string line;
  long long line_no = 0, index = 0, n_correct = 0, n_errors = 0;
  std::map<std::string, long long> reasons;
  while (std::getline(*in, line)) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json verdict = {{"index", index}, {"line", line_no}};
    try {
      nlohmann::json row = nlohmann::json::parse(line);
      if (!row.is_object()) throw_invalid("a row must be a JSON object");
      if (auto id = row.find("id"); id != row.end()) verdict["id"] = *id;
      std::vector<std::string> answers = answers_of(row);
      reward::GradeResult r;
      if (auto c = row.find("completion"); c != row.end()) {
        if (!c->is_string()) throw_invalid("'completion' must be a string");
        r = reward::grade(c->get_ref<const std::string&>(), answers, gopt);
      } else if (auto p = row.find("prediction"); p != row.end()) {
        if (!p->is_string()) throw_invalid("'prediction' must be a string");
        r = reward::grade_answer(p->get_ref<const std::string&>(), answers, gopt);
      } else {
        throw_invalid("missing field 'completion' (or 'prediction')");
      }
      verdict["correct"] = r.correct;
      verdict["extracted"] = r.extracted;
      verdict["reason"] = r.reason;
      n_correct += r.correct ? 1 : 0;
      ++reasons[r.reason];
    } catch (const nlohmann::json::exception& e) {
      ++n_errors;
      verdict["correct"] = false;
      verdict["error"] = fmt::format("line {}: malformed JSON: {}", line_no, e.what());
    } catch (const Error& e) {
      ++n_errors;
      verdict["correct"] = false;
      verdict["error"] = fmt::format("line {}: {}", line_no, e.what());
    }
    if (verdict.contains("error"))
      std::fprintf(stderr, "lorasync grade: %s\n", verdict["error"].get<std::string>().c_str());
    // Invalid UTF-8 in a completion must not kill the run: replace it in the output.
    *out << verdict.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << '\n';
    ++index;
  }
  out->flush();
  if (!*out) throw_env("--output: write to '{}' failed", o.output);
  if (o.summary) {
    long long graded = index - n_errors;
    double acc = graded > 0 ? static_cast<double>(n_correct) / static_cast<double>(graded) : 0.0;
    std::fprintf(stderr, "graded %lld rows: %lld correct (accuracy %.4f), %lld malformed\n", graded,
                 n_correct, acc, n_errors);
    nlohmann::json s = {{"summary", true}, {"rows", index}, {"graded", graded},
                        {"correct", n_correct}, {"accuracy", acc}, {"malformed", n_errors},
                        {"reasons", reasons}};
    std::fprintf(stderr, "%s\n", s.dump().c_str());
  }
  return n_errors > 0 ? 2 : 0;
}

}  // namespace

void register_grade(CLI::App& root, Registry& reg) {
  auto o = std::make_shared<GradeCmdOptions>();
  auto* sub = root.add_subcommand(
      "grade", "grade maths answers: JSONL {completion|prediction, answer} in, verdicts out");
  sub->add_option("--input", o->input, "JSONL rows ('-' = stdin)")->capture_default_str();
  sub->add_option("--output", o->output, "JSONL verdicts ('-' = stdout)")->capture_default_str();
  sub->add_flag("--summary", o->summary, "print accuracy and reason counts on stderr");
  sub->add_flag("--fallback", o->fallback,
                "evaluation only: without a box, use 'the answer is ...', the last math span, the "
                "last number");
  reg.add(sub, [o] { return run(*o); });
}

}  // namespace lorasync::cli
