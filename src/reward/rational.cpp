// Overflow-checked 128-bit rationals (see rational.h for why not a bigint).
#include "reward/rational.h"

#include <cmath>

namespace lorasync::reward {
namespace {

using Int = Rational::Int;

Int iabs(Int v) { return v < 0 ? -v : v; }

Int gcd(Int a, Int b) {
  a = iabs(a);
  b = iabs(b);
  while (b != 0) {
    Int t = a % b;
    a = b;
    b = t;
  }
  return a;
}

constexpr Int kMin = static_cast<Int>(static_cast<Rational::UInt>(1) << 127);

bool mul_ok(Int a, Int b, Int& out) { return !__builtin_mul_overflow(a, b, &out); }
bool add_ok(Int a, Int b, Int& out) { return !__builtin_add_overflow(a, b, &out); }

}  // namespace

std::optional<Rational> Rational::make(Int num, Int den) {
  if (den == 0) return std::nullopt;
  if (num == kMin || den == kMin) return std::nullopt;
  if (den < 0) {
    num = -num;
    den = -den;
  }
  Int g = gcd(num, den);
  if (g > 1) {
    num /= g;
    den /= g;
  }
  Rational r;
  r.num_ = num;
  r.den_ = den;
  return r;
}

std::optional<Rational> Rational::parse_decimal(std::string_view s) {
  Int num = 0;
  Int den = 1;
  bool seen_dot = false;
  bool any_digit = false;
  for (char c : s) {
    if (c == '.') {
      if (seen_dot) return std::nullopt;
      seen_dot = true;
      continue;
    }
    if (c < '0' || c > '9') return std::nullopt;
    any_digit = true;
    if (!mul_ok(num, 10, num) || !add_ok(num, c - '0', num)) return std::nullopt;
    if (seen_dot && !mul_ok(den, 10, den)) return std::nullopt;
  }
  if (!any_digit) return std::nullopt;
  return make(num, den);
}

double Rational::to_double() const {
  return static_cast<double>(static_cast<long double>(num_) / static_cast<long double>(den_));
}

std::string Rational::to_string() const {
  auto int_str = [](Int v) {
    if (v == 0) return std::string("0");
    bool negative = v < 0;
    UInt u = negative ? static_cast<UInt>(-(v + 1)) + 1
                                   : static_cast<UInt>(v);
    std::string out;
    while (u > 0) {
      out.insert(out.begin(), static_cast<char>('0' + static_cast<int>(u % 10)));
      u /= 10;
    }
    if (negative) out.insert(out.begin(), '-');
    return out;
  };
  return den_ == 1 ? int_str(num_) : int_str(num_) + "/" + int_str(den_);
}

std::optional<Rational> add(const Rational& a, const Rational& b) {
  Int g = gcd(a.den(), b.den());
  Int x, y, n, d;
  if (!mul_ok(a.num(), b.den() / g, x) || !mul_ok(b.num(), a.den() / g, y) || !add_ok(x, y, n) ||
      !mul_ok(a.den() / g, b.den(), d))
    return std::nullopt;
  return Rational::make(n, d);
}

std::optional<Rational> neg(const Rational& a) { return Rational::make(-a.num(), a.den()); }

std::optional<Rational> sub(const Rational& a, const Rational& b) {
  auto nb = neg(b);
  if (!nb) return std::nullopt;
  return add(a, *nb);
}

std::optional<Rational> mul(const Rational& a, const Rational& b) {
  Int g1 = gcd(a.num(), b.den());
  Int g2 = gcd(b.num(), a.den());
  if (g1 == 0) g1 = 1;
  if (g2 == 0) g2 = 1;
  Int n, d;
  if (!mul_ok(a.num() / g1, b.num() / g2, n) || !mul_ok(a.den() / g2, b.den() / g1, d))
    return std::nullopt;
  return Rational::make(n, d);
}

std::optional<Rational> div(const Rational& a, const Rational& b) {
  if (b.is_zero()) return std::nullopt;
  auto inv = Rational::make(b.den(), b.num());
  if (!inv) return std::nullopt;
  return mul(a, *inv);
}

std::optional<Rational> pow_int(const Rational& a, long long e) {
  if (e > 4096 || e < -4096) return std::nullopt;
  if (e == 0) return Rational(1);
  if (a.is_zero()) return e > 0 ? std::optional<Rational>(Rational(0)) : std::nullopt;
  Rational base = a;
  if (e < 0) {
    auto inv = Rational::make(a.den(), a.num());
    if (!inv) return std::nullopt;
    base = *inv;
    e = -e;
  }
  // |num| or |den| > 1 grows at least like 2^e: more than 127 doublings overflows for sure.
  if ((iabs(base.num()) > 1 || base.den() > 1) && e > 127) return std::nullopt;
  Rational result(1);
  for (long long k = 0; k < e; ++k) {
    auto next = mul(result, base);
    if (!next) return std::nullopt;
    result = *next;
  }
  return result;
}

namespace {
std::optional<Int> int_root(Int v, int k) {
  if (v < 0) return std::nullopt;
  if (v < 2) return v;
  long double guess = std::pow(static_cast<long double>(v), 1.0L / k);
  Int r = static_cast<Int>(std::llround(static_cast<double>(guess)));
  for (Int c = (r > 1 ? r - 1 : 0); c <= r + 1; ++c) {
    Int p = 1;
    bool ok = true;
    for (int i = 0; i < k && ok; ++i) ok = mul_ok(p, c, p);
    if (ok && p == v) return c;
  }
  return std::nullopt;
}
}  // namespace

std::optional<Rational> exact_root(const Rational& a, int k) {
  if (k < 1 || k > 64) return std::nullopt;
  if (k == 1) return a;
  bool negative = a.num() < 0;
  if (negative && k % 2 == 0) return std::nullopt;
  Int n = iabs(a.num());
  if (iabs(a.num()) > (static_cast<Int>(1) << 100) || a.den() > (static_cast<Int>(1) << 100))
    return std::nullopt;
  auto rn = int_root(n, k);
  auto rd = int_root(a.den(), k);
  if (!rn || !rd) return std::nullopt;
  return Rational::make(negative ? -*rn : *rn, *rd);
}

}  // namespace lorasync::reward
