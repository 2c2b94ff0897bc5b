// `lorasync bench grade`: verifier throughput (grades/s) and p99 time per grade.
//
// Workloads, all built deterministically from the reference answers of shared/data/*.jsonl:
//   reference_self      each answer boxed inside a sentence, graded against itself
//   reference_rewrites  the spec's rewrites (dfrac, \left( \right), spaces, trailing period,
//                       "x = " prefix) against the answer
//   sampled             sampled-style completions (a few hundred words of reasoning with inline
//                       maths, then a box: correct, rewritten or another row's answer; some after
//                       </think>, some without a box)
// With --math-verify, Math-Verify (scripts/math_verify_ref.py, in the project's .venv) grades the
// first 1,500 items of each workload too: agreement per configuration (as RL trainers call it, and
// its default), and its grades/s as a same-run peer baseline: both sides timed on those same items,
// one call at a time, --math-verify-passes passes each (ours half before Math-Verify's run, half
// after), the best pass of each.
// Each workload is timed on one thread (grades/s, p50, p99) and, with --threads N > 1 (default: all
// cores), by N threads grading concurrently (`*_grades_per_s_all_cores`, over wall time).
// Baseline, same run, same inputs: extraction of the box plus the canonical-string check alone
// (what a Hendrycks-style normaliser costs; with the same raw-equality shortcut the verifier
// takes), timed in turns with the verifier (baseline, verifier, verifier, baseline: half of
// --seconds each), each side's figures over all its calls. ratio = full verifier / baseline: for grades/s it is at most ~1 (below 1 is the price
// of the maths), for the times at least ~1.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "commands.h"
#include "reward/extract.h"
#include "reward/grade.h"
#include "util/bench_report.h"
#include "util/error.h"
#include "util/files.h"

namespace lorasync::cli {
namespace {

struct BenchGradeOptions {
  std::string data_dir = std::string(LORASYNC_SOURCE_DIR) + "/../shared/data";
  double seconds = 1.0;  // minimum time per workload and method
  std::uint64_t seed = 1;
  int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));  // all cores
  bool math_verify = false;  // also grade with Math-Verify (the .venv's) and report agreement
  std::string python = std::string(LORASYNC_SOURCE_DIR) + "/.venv/bin/python";
  std::size_t math_verify_items = 1500;  // per workload (Math-Verify grades ~1k/s)
  int math_verify_passes = 3;  // timed passes over those items on each side (the best of each)
};

struct Item {
  std::string completion;
  std::string reference;
};

std::vector<std::string> load_answers(const std::string& dir) {
  namespace fs = std::filesystem;
  if (!fs::is_directory(dir)) throw_not_found("--data-dir: '{}' is not a directory", dir);
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".jsonl") files.push_back(e.path());
  std::sort(files.begin(), files.end());
  std::vector<std::string> out;
  for (const auto& f : files) {
    std::ifstream in(f);
    std::string line;
    while (std::getline(in, line)) {
      if (line.empty()) continue;
      auto j = nlohmann::json::parse(line);
      const auto& a = j.at("answer");
      const auto& first = a.is_array() ? a.at(0) : a;
      out.push_back(first.is_string() ? first.get<std::string>() : first.dump());
    }
  }
  if (out.empty()) throw_not_found("--data-dir: no answers in '{}'", dir);
  return out;
}

std::string replace_all(std::string s, std::string_view from, std::string_view to) {
  std::size_t p = 0;
  while ((p = s.find(from, p)) != std::string::npos) {
    s.replace(p, from.size(), to);
    p += to.size();
  }
  return s;
}

std::string boxed_sentence(const std::string& a) { return "So the answer is $\\boxed{" + a + "}$."; }

std::string reasoning(std::mt19937_64& rng) {
  static const char* kSentences[] = {
      "Let $x$ be the unknown quantity, so that $2x + 3 = 11$ and hence $x = 4$. ",
      "We expand $(a+b)^2 = a^2 + 2ab + b^2$ and compare coefficients. ",
      "By the Pythagorean theorem, $c = \\sqrt{a^2 + b^2} = \\sqrt{9 + 16} = 5$. ",
      "Wait, let me double-check the arithmetic: $\\frac{3}{4} + \\frac{1}{8} = \\frac{7}{8}$. ",
      "Summing the series gives $\\sum_{k=1}^{n} k = \\frac{n(n+1)}{2}$. ",
      "Hmm, that does not look right, so we try another approach. ",
      "The discriminant is $b^2 - 4ac = 25 - 24 = 1 > 0$, so there are two real roots. "};
  std::string s;
  int n = 20 + static_cast<int>(rng() % 40);
  for (int k = 0; k < n; ++k) s += kSentences[rng() % std::size(kSentences)];
  return s;
}

std::vector<Item> build(const std::string& workload, const std::vector<std::string>& answers,
                        std::uint64_t seed) {
  std::vector<Item> items;
  std::mt19937_64 rng(seed);
  for (std::size_t i = 0; i < answers.size(); ++i) {
    const std::string& a = answers[i];
    if (workload == "reference_self") {
      items.push_back({boxed_sentence(a), a});
    } else if (workload == "reference_rewrites") {
      items.push_back({boxed_sentence(replace_all(a, "\\frac", "\\dfrac")), a});
      if (a.find("\\left") == std::string::npos)
        items.push_back({boxed_sentence(replace_all(replace_all(a, "(", "\\left("), ")", "\\right)")), a});
      items.push_back({boxed_sentence(" " + replace_all(a, "+", " + ") + " "), a});
      items.push_back({boxed_sentence(a + "."), a});
      if (a.find('=') == std::string::npos && a.find("\\ge") == std::string::npos &&
          a.find("\\le") == std::string::npos)
        items.push_back({boxed_sentence("x = " + a), a});
    } else {
      if (i % 3 != 0) continue;  // a third of the rows: completions are long
      std::string body = reasoning(rng);
      const std::string& other = answers[rng() % answers.size()];
      bool integer = !a.empty() && a.find_first_not_of("0123456789") == std::string::npos && a.size() < 12;
      if (integer && rng() % 2 == 0) {
        // Answers that need the maths: 2n/2, n.0, n/1 + 0, a wrong neighbour.
        static const char* kForms[] = {"\\frac{2*%}{2}", "%.0", "\\dfrac{%}{1}+0", "%+1", "\\sqrt{%^2}"};
        std::string f = kForms[rng() % std::size(kForms)];
        items.push_back({body + boxed_sentence(replace_all(f, "%", a)), a});
        continue;
      }
      switch (rng() % 6) {
        case 0: items.push_back({body + boxed_sentence(a), a}); break;
        case 1: items.push_back({body + boxed_sentence(replace_all(a, "\\frac", "\\dfrac")), a}); break;
        case 2: items.push_back({body + boxed_sentence(other), a}); break;
        case 3: items.push_back({"<think>" + body + "</think>" + boxed_sentence(a), a}); break;
        case 4: items.push_back({body + "The answer is " + a + ".", a}); break;
        default: items.push_back({body + boxed_sentence("x = " + other), a}); break;
      }
    }
  }
  return items;
}

std::string_view trimmed(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\n' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\n' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

struct Measured {
  double grades_per_s = 0, p50_us = 0, p99_us = 0;
  long long n = 0, correct = 0;
  std::vector<double> samples;  // us per grade
  double busy = 0;              // seconds in the calls
};

// Grades the items in order, one call at a time, for at least `min_seconds`, adding to `m`.
template <typename F>
void measure_into(Measured& m, const std::vector<Item>& items, double min_seconds, F&& one) {
  double start = now_seconds();
  do {
    for (const Item& it : items) {
      double t0 = now_seconds();
      bool ok = one(it);
      double dt = now_seconds() - t0;
      m.busy += dt;
      m.samples.push_back(dt * 1e6);
      m.correct += ok ? 1 : 0;
      ++m.n;
    }
  } while (now_seconds() - start < min_seconds);
  m.grades_per_s = m.busy > 0 ? static_cast<double>(m.n) / m.busy : 0;
  m.p50_us = percentile(m.samples, 50);
  m.p99_us = percentile(m.samples, 99);
}

// The verifier and its baseline over the same items, alternated A B B A (half the time each turn),
// so that a drift of the machine's pace hurts both alike: {full, base}, each over all its calls.
template <typename F, typename G>
std::pair<Measured, Measured> measure_alternately(const std::vector<Item>& items, double min_seconds, F&& full_fn,
                                                  G&& base_fn) {
  Measured full, base;
  measure_into(base, items, min_seconds / 2, base_fn);
  measure_into(full, items, min_seconds / 2, full_fn);
  measure_into(full, items, min_seconds / 2, full_fn);
  measure_into(base, items, min_seconds / 2, base_fn);
  return {full, base};
}

// All cores: `threads` threads grade the same items concurrently for at least `min_seconds`;
// {grades, wall seconds}.
template <typename F>
std::pair<double, double> measure_parallel(const std::vector<Item>& items, double min_seconds, int threads, F one) {
  std::atomic<long long> n{0};
  const double start = now_seconds();
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t)
    ts.emplace_back([&, t] {
      std::size_t i = static_cast<std::size_t>(t) * 7919 % std::max<std::size_t>(1, items.size());
      long long local = 0;
      do {
        for (std::size_t k = 0; k < 256; ++k, ++local) {
          one(items[i]);
          if (++i == items.size()) i = 0;
        }
      } while (now_seconds() - start < min_seconds);
      n += local;
    });
  for (auto& t : ts) t.join();
  return {static_cast<double>(n.load()), now_seconds() - start};
}

// One pass over the first `n` items, one call at a time: the seconds the calls took (as
// scripts/math_verify_ref.py times Math-Verify's).
template <typename F>
double timed_pass(const std::vector<Item>& items, std::size_t n, F&& one) {
  double spent = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const double t0 = now_seconds();
    (void)one(items[i]);
    spent += now_seconds() - t0;
  }
  return spent;
}

// Math-Verify (scripts/math_verify_ref.py, config "rl" or "default") over the first `n` items,
// `passes` times: its verdicts (the first pass's) and the seconds its parse + verify calls took in
// each pass.
struct Reference {
  std::vector<bool> correct;
  std::vector<double> seconds_per_pass;
  std::string version;
};

Reference run_math_verify(const BenchGradeOptions& o, const std::vector<Item>& items, std::size_t n,
                          const std::string& config, int passes) {
  namespace fs = std::filesystem;
  TempDir dir("lorasync-bench-grade");
  const fs::path in = dir.path() / "rows.jsonl", out = dir.path() / "verdicts.jsonl";
  {
    std::ofstream f(in);
    for (std::size_t i = 0; i < n; ++i)
      f << nlohmann::json{{"completion", items[i].completion}, {"answer", items[i].reference}}.dump(
               -1, ' ', false, nlohmann::json::error_handler_t::replace)
        << "\n";
  }
  const std::string cmd = "'" + o.python + "' '" + std::string(LORASYNC_SOURCE_DIR) + "/scripts/math_verify_ref.py' --config " +
                          config + " --input '" + in.string() + "' --output '" + out.string() + "' --passes " +
                          std::to_string(passes) + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) throw_not_found("--math-verify: cannot start {}", o.python);
  std::string text;
  char buf[4096];
  while (std::size_t k = std::fread(buf, 1, sizeof buf, p)) text.append(buf, k);
  if (pclose(p) != 0) throw_not_found("--math-verify: the reference failed (run scripts/setup?): {}", text);
  auto summary = nlohmann::json::parse(text.substr(text.rfind('{')), nullptr, false);
  if (summary.is_discarded()) throw_not_found("--math-verify: unreadable reference output: {}", text);
  Reference r;
  if (summary.contains("grade_s_per_pass")) r.seconds_per_pass = summary["grade_s_per_pass"].get<std::vector<double>>();
  else r.seconds_per_pass = {summary["grade_s"].get<double>()};
  r.version = summary["version"].get<std::string>();
  std::ifstream f(out);
  std::string line;
  while (std::getline(f, line))
    if (!line.empty()) r.correct.push_back(nlohmann::json::parse(line)["correct"].get<bool>());
  if (r.correct.size() != n) throw_not_found("--math-verify: {} verdicts for {} rows", r.correct.size(), n);
  return r;
}

int run(const BenchGradeOptions& o) {
  std::vector<std::string> answers = load_answers(o.data_dir);
  BenchReporter rep;
  for (const char* workload : {"reference_self", "reference_rewrites", "sampled"}) {
    std::vector<Item> items = build(workload, answers, o.seed);
    auto base_fn = [](const Item& it) {
      auto box = reward::extract_last_boxed(reward::after_think(it.completion));
      return box && (trimmed(*box) == trimmed(it.reference) || reward::canonical_string_equal(*box, it.reference));
    };
    auto full_fn = [](const Item& it) { return reward::grade(it.completion, it.reference).correct; };
    const auto [full, base] = measure_alternately(items, o.seconds, full_fn, base_fn);
    nlohmann::json cfg = {{"workload", workload},
                          {"items", items.size()},
                          {"grades_timed", full.n},
                          {"accuracy", full.n ? static_cast<double>(full.correct) / full.n : 0.0},
                          {"baseline", "extract + canonical string check"},
                          {"baseline_accuracy", base.n ? static_cast<double>(base.correct) / base.n : 0.0},
                          {"threads", 1}};
    std::string w = workload;
    rep.emit({"grade", w + "_grades_per_s", full.grades_per_s, "grades/s", base.grades_per_s, cfg});
    rep.emit({"grade", w + "_p50_us", full.p50_us, "us", base.p50_us, cfg});
    rep.emit({"grade", w + "_p99_us", full.p99_us, "us", base.p99_us, cfg});
    if (o.threads > 1) {
      // Alternated as on one thread (base, full, full, base), grades over wall time on each side.
      double bn = 0, bw = 0, fn = 0, fw = 0;
      for (const bool full_turn : {false, true, true, false}) {
        const auto [graded, wall] = full_turn ? measure_parallel(items, o.seconds / 2, o.threads, full_fn)
                                              : measure_parallel(items, o.seconds / 2, o.threads, base_fn);
        (full_turn ? fn : bn) += graded;
        (full_turn ? fw : bw) += wall;
      }
      const double bp = bw > 0 ? bn / bw : 0, fp = fw > 0 ? fn / fw : 0;
      cfg["threads"] = o.threads;
      rep.emit({"grade", w + "_grades_per_s_all_cores", fp, "grades/s", bp, cfg});
    }
    if (o.math_verify) {
      const std::size_t n = std::min(items.size(), o.math_verify_items);
      const int passes = std::max(1, o.math_verify_passes);
      for (const char* config : {"rl", "default"}) {
        // Only the RL configuration is timed: ours' passes over the same n items, half before
        // Math-Verify's run and half after, so that a drift of the machine's pace hurts both alike.
        const bool timed = std::string(config) == "rl";
        std::vector<double> ours_s;
        if (timed)
          for (int k = 0; k < (passes + 1) / 2; ++k) ours_s.push_back(timed_pass(items, n, full_fn));
        Reference ref = run_math_verify(o, items, n, config, timed ? passes : 1);
        if (timed)
          for (int k = (passes + 1) / 2; k < passes; ++k) ours_s.push_back(timed_pass(items, n, full_fn));
        std::size_t agree = 0;
        for (std::size_t i = 0; i < n; ++i) agree += full_fn(items[i]) == ref.correct[i] ? 1 : 0;
        nlohmann::json mcfg = {{"workload", workload}, {"items", n}, {"math_verify", ref.version},
                               {"math_verify_config", config}, {"threads", 1}};
        rep.emit({"grade", w + "_agreement_math_verify_" + config, static_cast<double>(agree) / static_cast<double>(n),
                  "fraction", std::nullopt, mcfg});
        if (timed) {
          auto rates = [n](const std::vector<double>& secs) {
            nlohmann::json a = nlohmann::json::array();
            for (double s : secs) a.push_back(s > 0 ? static_cast<double>(n) / s : 0.0);
            return a;
          };
          const double ours_best = *std::min_element(ours_s.begin(), ours_s.end());
          const double ref_best = *std::min_element(ref.seconds_per_pass.begin(), ref.seconds_per_pass.end());
          mcfg["passes"] = passes;
          mcfg["statistic"] = "best pass of each over the same items, one call at a time";
          mcfg["ours_per_pass"] = rates(ours_s);
          mcfg["math_verify_per_pass"] = rates(ref.seconds_per_pass);
          rep.emit({"grade", w + "_grades_per_s_vs_math_verify", static_cast<double>(n) / ours_best, "grades/s",
                    static_cast<double>(n) / ref_best, mcfg});
        }
      }
    }
  }
  rep.print_table();
  return 0;
}

}  // namespace

void register_bench_grade(CLI::App& bench, Registry& reg) {
  auto o = std::make_shared<BenchGradeOptions>();
  auto* sub = bench.add_subcommand("grade", "maths verifier: grades/s and p99 per grade");
  sub->add_option("--data-dir", o->data_dir, "directory of *.jsonl rows with 'answer'")->capture_default_str();
  sub->add_option("--seconds", o->seconds, "minimum time per workload and method")->capture_default_str();
  sub->add_option("--seed", o->seed, "seed of the sampled-completion generator")->capture_default_str();
  sub->add_flag("--math-verify", o->math_verify,
               "also grade each workload's first items with Math-Verify (the .venv's; RL and default "
               "configurations): agreement, and its grades/s as a baseline");
  sub->add_option("--python", o->python, "Python with math-verify (scripts/setup's .venv)")->capture_default_str();
  sub->add_option("--math-verify-items", o->math_verify_items,
                  "items per workload graded by Math-Verify (and by ours for the grades/s against it)")
      ->capture_default_str();
  sub->add_option("--math-verify-passes", o->math_verify_passes,
                  "timed passes over those items on each side; the best of each is compared")
      ->capture_default_str()
      ->check(CLI::Range(1, 20));
  sub->add_option("--threads", o->threads, "threads of the all-cores rows (1 = single-threaded rows only)")
      ->capture_default_str();
  reg.add(sub, [o] { return run(*o); });
}

}  // namespace lorasync::cli
