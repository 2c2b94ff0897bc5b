// demo/task.cpp: problem templates, worked steps, split assignment.
#include "demo/task.h"

#include <fmt/format.h>

#include <array>
#include <nlohmann/json.hpp>
#include <numeric>
#include <unordered_set>

#include "util/error.h"

namespace lorasync::demo {

namespace {

// SplitMix64: tiny, portable, good enough for drawing problems.
class Rng {
 public:
  explicit Rng(std::uint64_t seed) : s_(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (s_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [lo, hi] (modulo bias is negligible for these ranges).
  int uniform(int lo, int hi) {
    return lo + static_cast<int>(next() % static_cast<std::uint64_t>(hi - lo + 1));
  }
  double unit() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  template <typename T, std::size_t N>
  const T& pick(const std::array<T, N>& a) {
    return a[next() % N];
  }

 private:
  std::uint64_t s_;
};

std::uint64_t mix(std::uint64_t a, std::uint64_t b) {
  Rng r(a ^ (b * 0xD6E8FEB86659FD93ull));
  return r.next();
}

std::uint64_t hash_text(const std::string& s) {
  std::uint64_t h = 0xCBF29CE484222325ull;  // FNV-1a
  for (unsigned char c : s) h = (h ^ c) * 0x100000001B3ull;
  return h;
}

// One problem in every eighth signature bucket is held out.
constexpr std::uint64_t kHeldoutBuckets = 8;

Split split_of(const std::string& signature, std::uint64_t seed) {
  return mix(hash_text(signature), seed ^ 0x5851F42D4C957F2Dull) % kHeldoutBuckets == 0
             ? Split::kHeldout
             : Split::kTrain;
}

constexpr std::array<const char*, 12> kNames = {"Mia",  "Tom", "Ana",  "Leo", "Sara", "Ben",
                                                "Nora", "Sam", "Lily", "Max", "Zoe",  "Omar"};
constexpr std::array<const char*, 8> kItems = {"apples",   "pens",  "books",   "cards",
                                               "stickers", "coins", "marbles", "shells"};
// Operand ranges: small enough that the demo's tiny model learns the facts in ~1000 SFT steps
// (addends up to kMaxAddend, one-digit factors, intermediates up to kMaxValue). With addends up
// to 60 it reached only ~15% greedy accuracy in the same budget.
constexpr int kMaxAddend = 20;
constexpr int kMaxValue = 100;
constexpr const char* kTimes = "\xC3\x97";  // U+00D7 MULTIPLICATION SIGN

std::string S(int v) {
  return std::to_string(v);
}

// A problem before its final style is chosen: text, signature, steps, result.
struct Draft {
  std::string kind, problem, signature, steps, answer, final_value;
};

// 2-3 operands of + - ×, at most one ×, × before + and -; every intermediate in [0, kMaxValue].
bool draft_expr(Rng& rng, Draft& d) {
  const int n_ops = rng.uniform(1, 2);
  std::vector<char> ops;
  int n_mul = 0;
  for (int i = 0; i < n_ops; ++i) {
    const double u = rng.unit();
    char op = u < 0.40 ? '+' : u < 0.75 ? '-' : '*';
    if (op == '*' && n_mul++ > 0) op = '+';
    ops.push_back(op);
  }
  std::vector<int> v(static_cast<std::size_t>(n_ops + 1));
  for (std::size_t i = 0; i < v.size(); ++i) {
    const bool mul_left = i < ops.size() && ops[i] == '*';
    const bool mul_right = i > 0 && ops[i - 1] == '*';
    v[i] = mul_left || mul_right ? rng.uniform(2, 9) : rng.uniform(2, kMaxAddend);
  }
  auto op_text = [](char op) { return op == '*' ? std::string(kTimes) : std::string(1, op); };
  d.kind = "expr";
  d.problem = std::string("Compute ").append(S(v[0]));
  d.signature = std::string("expr|").append(S(v[0]));
  for (std::size_t i = 0; i < ops.size(); ++i) {
    d.problem += fmt::format(" {} {}", op_text(ops[i]), v[i + 1]);
    d.signature += fmt::format("{}{}", ops[i], v[i + 1]);
  }
  d.problem += ".";
  // Reduce the product first, then left to right.
  std::vector<int> vals = v;
  std::vector<char> rest = ops;
  for (std::size_t i = 0; i < rest.size(); ++i)
    if (rest[i] == '*') {
      const int p = vals[i] * vals[i + 1];
      d.steps += S(vals[i]) + " " + kTimes + " " + S(vals[i + 1]) + " = " + S(p) + ". ";
      vals[i] = p;
      vals.erase(vals.begin() + static_cast<std::ptrdiff_t>(i) + 1);
      rest.erase(rest.begin() + static_cast<std::ptrdiff_t>(i));
      break;
    }
  int acc = vals[0];
  for (std::size_t i = 0; i < rest.size(); ++i) {
    const int r = rest[i] == '+' ? acc + vals[i + 1] : acc - vals[i + 1];
    if (r < 0 || r > kMaxValue) return false;
    d.steps += S(acc) + " " + std::string(1, rest[i]) + " " + S(vals[i + 1]) + " = " + S(r) + ". ";
    acc = r;
  }
  if (acc > kMaxValue) return false;
  d.steps.pop_back();
  d.answer = d.final_value = S(acc);
  return true;
}

bool draft_word(Rng& rng, Draft& d) {
  const std::string name = rng.pick(kNames);
  const std::string item = rng.pick(kItems);
  const int t = rng.uniform(0, 5);
  int a = rng.uniform(2, kMaxAddend), b = rng.uniform(2, 15), c = rng.uniform(2, 12), r = 0;
  d.kind = "word";
  switch (t) {
    case 0:
      r = a + b;
      d.problem = name + " has " + S(a) + " " + item + " and buys " + S(b) + " more. How many " +
                  item + " does " + name + " have now?";
      d.steps = S(a) + " + " + S(b) + " = " + S(r) + ".";
      break;
    case 1:
      r = a - b;
      d.problem = name + " has " + S(a) + " " + item + " and gives " + S(b) +
                  " to a friend. How many " + item + " are left?";
      d.steps = S(a) + " - " + S(b) + " = " + S(r) + ".";
      break;
    case 2:
      a = rng.uniform(2, 9), b = rng.uniform(2, 9), r = a * b;
      d.problem = name + " buys " + S(a) + " bags with " + S(b) + " " + item +
                  " in each. How many " + item + " does " + name + " buy?";
      d.steps = S(a) + " " + kTimes + " " + S(b) + " = " + S(r) + ".";
      break;
    case 3: {
      const int m = a + b;
      r = m - c;
      d.problem = name + " has " + S(a) + " " + item + ", buys " + S(b) +
                  " more and then gives away " + S(c) + ". How many " + item + " does " + name +
                  " have now?";
      d.steps =
          S(a) + " + " + S(b) + " = " + S(m) + ". " + S(m) + " - " + S(c) + " = " + S(r) + ".";
      break;
    }
    case 4: {
      a = rng.uniform(2, 9), b = rng.uniform(2, 9);
      const int p = a * b;
      r = p + c;
      d.problem = "There are " + S(a) + " boxes of " + S(b) + " " + item + " and " + S(c) +
                  " more " + item + " on a table. How many " + item + " are there in total?";
      d.steps = S(a) + " " + kTimes + " " + S(b) + " = " + S(p) + ". " + S(p) + " + " + S(c) +
                " = " + S(r) + ".";
      break;
    }
    default: {
      const int m = a - b;
      r = m + c;
      if (m < 0) return false;
      d.problem = name + " had " + S(a) + " " + item + ", lost " + S(b) + " and found " + S(c) +
                  ". How many " + item + " does " + name + " have now?";
      d.steps =
          S(a) + " - " + S(b) + " = " + S(m) + ". " + S(m) + " + " + S(c) + " = " + S(r) + ".";
      break;
    }
  }
  if (r < 0) return false;
  d.signature = "word" + S(t) + "|" + S(a) + "|" + S(b) + "|" + (t >= 3 ? S(c) : "");
  d.answer = d.final_value = S(r);
  return true;
}

bool draft_equation(Rng& rng, Draft& d) {
  const int t = rng.uniform(0, 3);
  d.kind = "equation";
  int x = 0, a = 0, b = 0, c = 0;
  switch (t) {
    case 0:  // x + b = c
      x = rng.uniform(1, kMaxAddend), b = rng.uniform(2, 15), c = x + b;
      d.problem = "Solve for x: x + " + S(b) + " = " + S(c) + ".";
      d.steps = "x = " + S(c) + " - " + S(b) + " = " + S(x) + ".";
      break;
    case 1:  // x - b = c
      x = rng.uniform(3, kMaxAddend), b = rng.uniform(2, 15), c = x - b;
      if (c < 1) return false;
      d.problem = "Solve for x: x - " + S(b) + " = " + S(c) + ".";
      d.steps = "x = " + S(c) + " + " + S(b) + " = " + S(x) + ".";
      break;
    case 2:  // a x = c
      a = rng.uniform(2, 9), x = rng.uniform(2, 9), c = a * x;
      d.problem = "Solve for x: " + S(a) + "x = " + S(c) + ".";
      d.steps = "x = " + S(c) + " / " + S(a) + " = " + S(x) + ".";
      break;
    default: {  // a x + b = c
      a = rng.uniform(2, 9), x = rng.uniform(2, 9), b = rng.uniform(2, 15);
      const int ax = a * x;
      c = ax + b;
      d.problem = "Solve for x: " + S(a) + "x + " + S(b) + " = " + S(c) + ".";
      d.steps = S(a) + "x = " + S(c) + " - " + S(b) + " = " + S(ax) + ". x = " + S(ax) + " / " +
                S(a) + " = " + S(x) + ".";
      break;
    }
  }
  d.signature = "eq" + S(t) + "|" + S(a) + "|" + S(b) + "|" + S(c);
  d.answer = d.final_value = S(x);
  return true;
}

// p/q in lowest terms as a reference answer: "3" or "\frac{3}{4}".
std::string fraction_answer(int p, int q) {
  const int g = std::gcd(p, q);
  p /= g, q /= g;
  if (q == 1) return S(p);
  return "\\frac{" + S(p) + "}{" + S(q) + "}";
}

bool draft_fraction(Rng& rng, Draft& d) {
  const int t = rng.uniform(0, 2);
  d.kind = "fraction";
  if (t <= 1) {
    const int q = rng.uniform(3, 9);
    int a = rng.uniform(1, q - 1), b = rng.uniform(1, q - 1);
    if (t == 1 && a <= b) return false;
    const int p = t == 0 ? a + b : a - b;
    const char op = t == 0 ? '+' : '-';
    const std::string lhs = S(a) + "/" + S(q) + " " + op + " " + S(b) + "/" + S(q);
    d.problem = "Compute " + lhs + ".";
    d.steps = lhs + " = " + S(p) + "/" + S(q) + ".";
    d.signature = "frac" + S(t) + "|" + S(a) + "|" + S(b) + "|" + S(q);
    d.answer = fraction_answer(p, q);
    d.final_value = S(p) + "/" + S(q);
    return true;
  }
  const int q = rng.uniform(2, 6), k = rng.uniform(2, 9), n = rng.uniform(1, q - 1);
  const int m = q * k, r = k * n;
  d.problem = "What is " + S(n) + "/" + S(q) + " of " + S(m) + "?";
  d.steps = S(m) + " / " + S(q) + " = " + S(k) + ". " + S(k) + " " + kTimes + " " + S(n) + " = " +
            S(r) + ".";
  d.signature = "of|" + S(n) + "|" + S(q) + "|" + S(m);
  d.answer = d.final_value = S(r);
  return true;
}

bool draft(Rng& rng, Draft& d) {
  const double u = rng.unit();
  if (u < 0.35) return draft_expr(rng, d);
  if (u < 0.65) return draft_word(rng, d);
  if (u < 0.85) return draft_equation(rng, d);
  return draft_fraction(rng, d);
}

}  // namespace

const char* split_name(Split s) {
  return s == Split::kTrain ? "train" : "heldout";
}

std::string final_line(FinalStyle style, const std::string& value) {
  switch (style) {
    case FinalStyle::kBoxed:
      return "\\boxed{" + value + "}";
    case FinalStyle::kAnswerColon:
      return "Answer: " + value;
    case FinalStyle::kTheAnswerIs:
      return "The answer is " + value + ".";
    case FinalStyle::kSoResult:
      return "So the result is " + value + ".";
  }
  return value;
}

std::string TaskRow::solution() const {
  return steps + "\n" + final_line(style, final_value);
}

std::string TaskRow::boxed_solution() const {
  return steps + "\n" + final_line(FinalStyle::kBoxed, final_value);
}

std::vector<TaskRow> make_problems(std::uint64_t seed, std::int64_t count, Split split,
                                   const TaskOptions& options) {
  if (count <= 0) throw_invalid("problem count must be positive, got {}", count);
  if (!(options.p_boxed >= 0 && options.p_boxed <= 1))
    throw_invalid("p_boxed must be in [0, 1], got {}", options.p_boxed);
  Rng rng(mix(seed, split == Split::kTrain ? 0x7261696E : 0x68656C64));
  std::unordered_set<std::string> seen;
  std::vector<TaskRow> rows;
  rows.reserve(static_cast<std::size_t>(count));
  const std::int64_t max_attempts = 400 * count + 10000;
  for (std::int64_t attempt = 0; static_cast<std::int64_t>(rows.size()) < count; ++attempt) {
    if (attempt >= max_attempts)
      throw_invalid("could not draw {} distinct {} problems (got {}); ask for fewer", count,
                    split_name(split), rows.size());
    Draft d;
    if (!draft(rng, d)) continue;
    if (split_of(d.signature, seed) != split || !seen.insert(d.signature).second) continue;
    TaskRow row;
    row.kind = std::move(d.kind);
    row.problem = std::move(d.problem);
    row.answer = std::move(d.answer);
    row.final_value = std::move(d.final_value);
    row.steps = std::move(d.steps);
    const double u = rng.unit();
    if (u < options.p_boxed) {
      row.style = FinalStyle::kBoxed;
    } else {
      const double w = (1.0 - options.p_boxed) / (kNumFinalStyles - 1);
      const int k = std::min(kNumFinalStyles - 2, static_cast<int>((u - options.p_boxed) / w));
      row.style = static_cast<FinalStyle>(1 + k);
    }
    rows.push_back(std::move(row));
  }
  return rows;
}

std::string to_jsonl(const std::vector<TaskRow>& rows) {
  std::string out;
  for (const auto& r : rows) {
    nlohmann::ordered_json j = {{"problem", r.problem}, {"answer", r.answer}};
    out += j.dump() + "\n";
  }
  return out;
}

}  // namespace lorasync::demo
