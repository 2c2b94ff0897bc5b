// reward/rational.h: exact rationals for the verifier's exact evaluation.
//
// Design choice: bounded 128-bit numerator and denominator instead of a bigint. Every operation
// checks for overflow and reports it (returns nullopt); the caller then falls back to numeric
// (double) evaluation, where values agree to a relative 1e-9. That covers every integer below
// 1.7e38 exactly, which includes all answers of the data sets we grade; beyond that the verdict is
// numeric and documented as such in docs/grader.md.
// Thread-safety: value type, no shared state.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace lorasync::reward {

class Rational {
 public:
  __extension__ typedef __int128 Int;
  __extension__ typedef unsigned __int128 UInt;
  Rational() = default;
  explicit Rational(long long v) : num_(v), den_(1) {}
  // num/den reduced to lowest terms with den > 0; nullopt when den == 0.
  static std::optional<Rational> make(Int num, Int den);
  // A decimal literal "123", "12.50", "0.001" (no sign, no exponent); nullopt on overflow/garbage.
  static std::optional<Rational> parse_decimal(std::string_view digits);

  Int num() const { return num_; }
  Int den() const { return den_; }
  bool is_integer() const { return den_ == 1; }
  bool is_zero() const { return num_ == 0; }
  double to_double() const;
  std::string to_string() const;

  friend bool operator==(const Rational& a, const Rational& b) {
    return a.num_ == b.num_ && a.den_ == b.den_;
  }

 private:
  Int num_ = 0;
  Int den_ = 1;
};

// Arithmetic; nullopt on overflow or division by zero.
std::optional<Rational> add(const Rational& a, const Rational& b);
std::optional<Rational> sub(const Rational& a, const Rational& b);
std::optional<Rational> mul(const Rational& a, const Rational& b);
std::optional<Rational> div(const Rational& a, const Rational& b);
std::optional<Rational> neg(const Rational& a);
// a^e for an integer exponent with |e| <= 4096; nullopt on overflow.
std::optional<Rational> pow_int(const Rational& a, long long e);
// Exact integer k-th root of a rational when it exists (sqrt(9/4) = 3/2); nullopt otherwise.
std::optional<Rational> exact_root(const Rational& a, int k);

}  // namespace lorasync::reward
