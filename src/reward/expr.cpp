// Exact and numeric evaluation (contracts in expr.h), and the debug form of a tree.
#include "reward/expr.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>

namespace lorasync::reward {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
const Complex kBad{kNaN, kNaN};

bool is_bad(const Complex& z) { return std::isnan(z.real()) || std::isnan(z.imag()); }

// An exact integer value small enough for loops (factorial, binomial, integer powers).
std::optional<long long> small_int(const std::optional<Rational>& r, long long limit) {
  if (!r || !r->is_integer()) return std::nullopt;
  Rational::Int v = r->num();
  if (v > limit || v < -limit) return std::nullopt;
  return static_cast<long long>(v);
}

std::optional<Rational> exact_factorial(long long n, Budget& b) {
  if (n < 0 || n > 33) return std::nullopt;
  if (!b.spend(n)) return std::nullopt;
  Rational r(1);
  for (long long k = 2; k <= n; ++k) {
    auto next = mul(r, Rational(k));
    if (!next) return std::nullopt;
    r = *next;
  }
  return r;
}

std::optional<Rational> exact_binom(long long n, long long k, Budget& b) {
  if (n < 0 || k < 0) return std::nullopt;
  if (k > n) return Rational(0);
  k = std::min(k, n - k);
  if (!b.spend(k + 1)) return std::nullopt;
  Rational r(1);
  for (long long j = 1; j <= k; ++j) {
    auto m = mul(r, Rational(n - k + j));
    if (!m) return std::nullopt;
    auto d = div(*m, Rational(j));
    if (!d) return std::nullopt;
    r = *d;
  }
  return r;
}

Rational::Int floor_div(Rational::Int a, Rational::Int b) {
  Rational::Int q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}

}  // namespace

std::optional<Rational> eval_exact(const Expr& e, int node, Budget& b) {
  if (!b.spend()) return std::nullopt;
  const Node& n = e.at(node);
  auto child = [&](std::size_t k) { return eval_exact(e, n.children[k], b); };
  switch (n.kind) {
    case NodeKind::kNumber:
      return Rational::parse_decimal(n.text);
    case NodeKind::kNeg: {
      auto v = child(0);
      return v ? neg(*v) : std::nullopt;
    }
    case NodeKind::kAdd: {
      Rational acc(0);
      for (std::size_t k = 0; k < n.children.size(); ++k) {
        auto v = child(k);
        if (!v) return std::nullopt;
        auto s = add(acc, *v);
        if (!s) return std::nullopt;
        acc = *s;
      }
      return acc;
    }
    case NodeKind::kMul: {
      Rational acc(1);
      for (std::size_t k = 0; k < n.children.size(); ++k) {
        auto v = child(k);
        if (!v) return std::nullopt;
        auto s = mul(acc, *v);
        if (!s) return std::nullopt;
        acc = *s;
      }
      return acc;
    }
    case NodeKind::kDiv: {
      auto a = child(0);
      if (!a) return std::nullopt;
      auto d = child(1);
      if (!d) return std::nullopt;
      return div(*a, *d);
    }
    case NodeKind::kPow: {
      auto base = child(0);
      if (!base) return std::nullopt;
      auto ex = child(1);
      if (!ex) return std::nullopt;
      if (ex->is_integer()) {
        auto k = small_int(ex, 4096);
        if (!k) return std::nullopt;
        if (!b.spend(std::min<long long>(std::llabs(*k), 200))) return std::nullopt;
        return pow_int(*base, *k);
      }
      // Rational exponent p/q: exact when base is a perfect q-th power.
      auto q = small_int(Rational::make(ex->den(), 1), 64);
      auto p = small_int(Rational::make(ex->num(), 1), 4096);
      if (!q || !p) return std::nullopt;
      auto root = exact_root(*base, static_cast<int>(*q));
      if (!root) return std::nullopt;
      return pow_int(*root, *p);
    }
    case NodeKind::kFactorial: {
      auto k = small_int(child(0), 1000);
      if (!k) return std::nullopt;
      return exact_factorial(*k, b);
    }
    case NodeKind::kFunc: {
      if (n.text == "sqrt" || n.text == "root") {
        auto v = child(0);
        if (!v) return std::nullopt;
        int k = 2;
        if (n.text == "root") {
          auto idx = small_int(child(1), 64);
          if (!idx || *idx < 1) return std::nullopt;
          k = static_cast<int>(*idx);
        }
        return exact_root(*v, k);
      }
      if (n.text == "abs") {
        auto v = child(0);
        if (!v) return std::nullopt;
        return v->num() < 0 ? neg(*v) : v;
      }
      if (n.text == "floor" || n.text == "ceil") {
        auto v = child(0);
        if (!v) return std::nullopt;
        Rational::Int f = floor_div(v->num(), v->den());
        if (n.text == "ceil" && !v->is_integer()) ++f;
        return Rational::make(f, 1);
      }
      if (n.text == "binom") {
        auto nn = small_int(child(0), 100000);
        auto kk = small_int(child(1), 100000);
        if (!nn || !kk) return std::nullopt;
        return exact_binom(*nn, *kk, b);
      }
      return std::nullopt;
    }
    default:
      return std::nullopt;
  }
}

namespace {

Complex cpow(const Complex& base, const Complex& ex, Budget& b) {
  // Integer exponents by repeated squaring keep (-8)^3 and x^2 exact-ish and real.
  if (ex.imag() == 0 && std::isfinite(ex.real()) && ex.real() == std::round(ex.real()) &&
      std::fabs(ex.real()) <= 1e6) {
    long long k = static_cast<long long>(ex.real());
    bool inv = k < 0;
    unsigned long long u = static_cast<unsigned long long>(inv ? -k : k);
    Complex result{1, 0}, x = base;
    while (u > 0) {
      if (!b.spend()) return kBad;
      if (u & 1) result *= x;
      x *= x;
      u >>= 1;
    }
    return inv ? Complex{1, 0} / result : result;
  }
  if (base.imag() == 0 && base.real() >= 0 && ex.imag() == 0)
    return {std::pow(base.real(), ex.real()), 0};
  if (base == Complex{0, 0}) return {0, 0};
  return std::pow(base, ex);
}

double real_gamma_factorial(double n) {
  if (n < 0 || n != std::floor(n)) return std::tgamma(n + 1);
  if (n > 170) return std::numeric_limits<double>::infinity();
  return std::tgamma(n + 1);
}

}  // namespace

Complex eval_numeric(const Expr& e, int node, const Bindings& bind, Budget& b) {
  if (!b.spend()) return kBad;
  const Node& n = e.at(node);
  auto child = [&](std::size_t k) { return eval_numeric(e, n.children[k], bind, b); };
  switch (n.kind) {
    case NodeKind::kNumber:
      return {std::strtod(n.text.c_str(), nullptr), 0};
    case NodeKind::kConst:
      if (n.text == "pi") return {M_PI, 0};
      if (n.text == "e") return {M_E, 0};
      if (n.text == "i") return {0, 1};
      if (n.text == "inf") return {std::numeric_limits<double>::infinity(), 0};
      return kBad;
    case NodeKind::kSymbol:
      for (const auto& [name, v] : bind)
        if (name == n.text) return {v, 0};
      return kBad;
    case NodeKind::kNeg: {
      Complex v = child(0);
      return {-v.real(), v.imag() == 0 ? 0.0 : -v.imag()};
    }
    case NodeKind::kAdd: {
      Complex acc{0, 0};
      for (std::size_t k = 0; k < n.children.size(); ++k) {
        Complex v = child(k);
        acc = {acc.real() + v.real(), acc.imag() + v.imag()};
      }
      return acc;
    }
    case NodeKind::kMul: {
      Complex acc{1, 0};
      for (std::size_t k = 0; k < n.children.size(); ++k) {
        Complex v = child(k);
        if (acc.imag() == 0 && v.imag() == 0) acc = {acc.real() * v.real(), 0};
        else acc *= v;
      }
      return acc;
    }
    case NodeKind::kDiv: {
      Complex a = child(0), d = child(1);
      if (d == Complex{0, 0}) return kBad;
      if (a.imag() == 0 && d.imag() == 0) return {a.real() / d.real(), 0};
      return a / d;
    }
    case NodeKind::kPow: {
      Complex base = child(0), ex = child(1);
      if (is_bad(base) || is_bad(ex)) return kBad;
      return cpow(base, ex, b);
    }
    case NodeKind::kFactorial: {
      Complex v = child(0);
      if (v.imag() != 0) return kBad;
      return {real_gamma_factorial(v.real()), 0};
    }
    case NodeKind::kFunc: {
      const std::string& f = n.text;
      Complex x = child(0);
      if (is_bad(x)) return kBad;
      bool real = x.imag() == 0;
      double r = x.real();
      if (f == "sqrt") return real && r >= 0 ? Complex{std::sqrt(r), 0} : std::sqrt(x);
      if (f == "root") {
        Complex k = child(1);
        if (k.imag() != 0 || k.real() == 0) return kBad;
        double kk = k.real();
        if (real && r < 0 && std::fmod(kk, 2.0) == 1.0) return {-std::pow(-r, 1.0 / kk), 0};
        return cpow(x, Complex{1.0 / kk, 0}, b);
      }
      if (f == "abs") return {std::abs(x), 0};
      if (f == "floor") return real ? Complex{std::floor(r), 0} : kBad;
      if (f == "ceil") return real ? Complex{std::ceil(r), 0} : kBad;
      if (f == "log") {
        Complex base = child(1);
        if (real && r > 0 && base.imag() == 0 && base.real() > 0)
          return {std::log(r) / std::log(base.real()), 0};
        return std::log(x) / std::log(base);
      }
      if (f == "exp") return real ? Complex{std::exp(r), 0} : std::exp(x);
      if (f == "binom") {
        Complex k = child(1);
        if (!real || k.imag() != 0) return kBad;
        double nn = r, kk = k.real();
        return {std::exp(std::lgamma(nn + 1) - std::lgamma(kk + 1) - std::lgamma(nn - kk + 1)) *
                    ((nn >= 0 && nn == std::floor(nn) && kk == std::floor(kk)) ? 1.0 : 1.0),
                0};
      }
      Complex v;
      if (f == "sin") v = real ? Complex{std::sin(r), 0} : std::sin(x);
      else if (f == "cos") v = real ? Complex{std::cos(r), 0} : std::cos(x);
      else if (f == "tan") v = real ? Complex{std::tan(r), 0} : std::tan(x);
      else if (f == "sec") v = Complex{1, 0} / (real ? Complex{std::cos(r), 0} : std::cos(x));
      else if (f == "csc") v = Complex{1, 0} / (real ? Complex{std::sin(r), 0} : std::sin(x));
      else if (f == "cot") v = Complex{1, 0} / (real ? Complex{std::tan(r), 0} : std::tan(x));
      else if (f == "arcsin") v = real && std::fabs(r) <= 1 ? Complex{std::asin(r), 0} : std::asin(x);
      else if (f == "arccos") v = real && std::fabs(r) <= 1 ? Complex{std::acos(r), 0} : std::acos(x);
      else if (f == "arctan") v = real ? Complex{std::atan(r), 0} : std::atan(x);
      else if (f == "arccot") v = real ? Complex{std::atan(1.0 / r), 0} : std::atan(Complex{1, 0} / x);
      else if (f == "arcsec") v = std::acos(Complex{1, 0} / x);
      else if (f == "arccsc") v = std::asin(Complex{1, 0} / x);
      else if (f == "sinh") v = std::sinh(x);
      else if (f == "cosh") v = std::cosh(x);
      else if (f == "tanh") v = std::tanh(x);
      else return kBad;
      return v;
    }
    default:
      return kBad;
  }
}

bool is_scalar(const Expr& e, int node) {
  const Node& n = e.at(node);
  switch (n.kind) {
    case NodeKind::kTuple:
    case NodeKind::kSet:
    case NodeKind::kMatrix:
    case NodeKind::kRelation:
    case NodeKind::kList:
    case NodeKind::kUnion:
    case NodeKind::kBaseLit:
    case NodeKind::kEmptySet:
    case NodeKind::kPlusMinus:
      return false;
    default:
      break;
  }
  return std::all_of(n.children.begin(), n.children.end(), [&](int c) { return is_scalar(e, c); });
}

void collect_symbols(const Expr& e, int node, std::vector<std::string>& out) {
  const Node& n = e.at(node);
  if (n.kind == NodeKind::kSymbol) {
    if (std::find(out.begin(), out.end(), n.text) == out.end()) out.push_back(n.text);
    return;
  }
  for (int c : n.children) collect_symbols(e, c, out);
}

// Declared in parser.h, beside Expr.
std::string to_debug_string(const Expr& e, int node) {
  const Node& n = e.at(node);
  auto kids = [&](std::string head) {
    std::string s = "(" + head;
    for (int c : n.children) s += " " + to_debug_string(e, c);
    return s + ")";
  };
  switch (n.kind) {
    case NodeKind::kNumber:
    case NodeKind::kSymbol:
    case NodeKind::kBaseLit:
      return n.text;
    case NodeKind::kConst:
      return "#" + n.text;
    case NodeKind::kAdd: return kids("+");
    case NodeKind::kMul: return kids("*");
    case NodeKind::kDiv: return kids("/");
    case NodeKind::kPow: return kids("^");
    case NodeKind::kNeg: return kids("-");
    case NodeKind::kFunc: return kids(n.text);
    case NodeKind::kFactorial: return kids("!");
    case NodeKind::kTuple: return kids(std::string("tuple") + n.open + n.close);
    case NodeKind::kSet: return kids("set");
    case NodeKind::kMatrix: return kids("matrix" + std::to_string(n.rows) + "x" + std::to_string(n.cols));
    case NodeKind::kRelation: {
      std::string s = "(rel";
      for (std::size_t k = 0; k < n.children.size(); ++k) {
        if (k > 0) s += " " + n.ops[k - 1];
        s += " " + to_debug_string(e, n.children[k]);
      }
      return s + ")";
    }
    case NodeKind::kList: return kids("list");
    case NodeKind::kUnion: return kids("union");
    case NodeKind::kEmptySet: return "emptyset";
    case NodeKind::kPlusMinus: return kids("pm");
  }
  return "?";
}

}  // namespace lorasync::reward
