// Structural and numeric comparison of two parsed answers (rules in compare.h).
#include "reward/compare.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "util/random.h"

namespace lorasync::reward {
namespace {

constexpr int kMaxSymbols = 6;
constexpr int kPoints = 6;
constexpr std::uint64_t kSeed = 0x6c6f726173796e63ULL;  // "lorasync": fixed, so verdicts repeat

struct Ref {
  const Expr* e = nullptr;
  int n = -1;
  const Node& node() const { return e->at(n); }
  Ref child(std::size_t k) const { return {e, node().children[k]}; }
};

struct Term {
  Ref ref;
  double sign = 1;
};
using Combo = std::vector<Term>;

// The next draw of a SplitMix64 generator whose state is `state` (advanced by one step).
double uniform(std::uint64_t& state, double lo, double hi) {
  const double u = unit_interval(splitmix64(state));
  state += kSplitMixGamma;
  return lo + (hi - lo) * u;
}

bool close(double a, double b, double rel, double abs_floor) {
  if (a == b) return true;
  double d = std::fabs(a - b);
  return d <= std::max(rel * std::max(std::fabs(a), std::fabs(b)), abs_floor);
}

bool close_c(const Complex& a, const Complex& b, double rel, double abs_floor) {
  double scale = std::max(std::abs(a), std::abs(b));
  return std::abs(a - b) <= std::max(rel * scale, abs_floor);
}

bool decimal_close(double a, double b) {
  if (close(a, b, 1e-6 * (1 + 1e-9), 0)) return true;
  if (std::min(std::fabs(a), std::fabs(b)) < 1e-4 || std::max(std::fabs(a), std::fabs(b)) > 1e9)
    return false;
  return std::round(a * 1e6) == std::round(b * 1e6);
}

bool all_equal_ops(const Node& n) {
  return std::all_of(n.ops.begin(), n.ops.end(), [](const std::string& o) { return o == "="; });
}

// A left side made of names only (x, f(x), |AB|, \frac{NO}{BO}, (p,q)): no numbers in it.
bool names_only(const Expr& e, int node) {
  const Node& n = e.at(node);
  if (n.kind == NodeKind::kNumber || n.kind == NodeKind::kConst || n.kind == NodeKind::kRelation ||
      n.kind == NodeKind::kList)
    return false;
  return std::all_of(n.children.begin(), n.children.end(), [&](int c) { return names_only(e, c); });
}

bool is_assignment(const Ref& r) {
  const Node& n = r.node();
  return n.kind == NodeKind::kRelation && all_equal_ops(n) && names_only(*r.e, n.children[0]);
}

struct Endpoint {
  Ref ref;
  int inf = 0;       // -1: -infinity, +1: +infinity, 0: finite (ref)
  bool neg = false;  // the value is -ref (the mirrored bound of |x|)
};
struct Interval {
  Endpoint lo, hi;
  bool lo_closed = false, hi_closed = false;
};

class Comparer {
 public:
  Comparer(const CompareOptions& options, Budget& budget) : opt_(options), b_(budget) {}

  bool too_complex = false;
  std::string reason;

  bool equal(Ref a, Ref c) {
    if (!b_.spend()) {
      too_complex = true;
      return false;
    }
    const Node& A = a.node();
    const Node& C = c.node();
    // Relations and the intervals they define.
    if (A.kind == NodeKind::kRelation || C.kind == NodeKind::kRelation) {
      if (A.kind == NodeKind::kRelation && C.kind == NodeKind::kRelation) {
        if (relations_equal(a, c)) return mark("relation_equal");
        reason.clear();
      }
      std::vector<Interval> ia, ic;
      if (intervals_of(a, ia) && intervals_of(c, ic) &&
          (A.kind != NodeKind::kRelation || C.kind != NodeKind::kRelation))
        return interval_sets_equal(ia, ic) && mark("interval_equal");
      if (C.kind == NodeKind::kRelation && all_equal_ops(C) && A.kind != NodeKind::kRelation)
        return equal(a, c.child(C.children.size() - 1));
      if (is_assignment(a) && C.kind != NodeKind::kRelation)
        return equal(a.child(A.children.size() - 1), c);
      return false;
    }
    if (is_interval_like(a) || is_interval_like(c)) {
      std::vector<Interval> ia, ic;
      bool same_tuples = A.kind == NodeKind::kTuple && C.kind == NodeKind::kTuple &&
                         A.open == C.open && A.close == C.close;
      if (!same_tuples && intervals_of(a, ia) && intervals_of(c, ic))
        return interval_sets_equal(ia, ic) && mark("interval_equal");
    }
    switch (A.kind) {
      case NodeKind::kTuple:
        if (C.kind == NodeKind::kTuple) {
          if (A.open != C.open || A.close != C.close) return false;
          return in_order(a, c) && mark("structure_equal");
        }
        if (C.kind == NodeKind::kList) return in_order(a, c) && mark("structure_equal");
        if (C.kind == NodeKind::kSet) return order_free(a, c) && mark("set_equal");
        return false;
      case NodeKind::kSet:
      case NodeKind::kList:
        if (C.kind == NodeKind::kSet || C.kind == NodeKind::kList)
          return order_free(a, c) && mark("set_equal");
        if (C.kind == NodeKind::kTuple)
          return (A.kind == NodeKind::kList ? in_order(a, c) : order_free(a, c)) && mark("set_equal");
        return false;
      case NodeKind::kMatrix:
        if (C.kind != NodeKind::kMatrix || A.rows != C.rows || A.cols != C.cols) return false;
        return in_order(a, c) && mark("structure_equal");
      case NodeKind::kUnion:
        return false;  // unions are handled as intervals above
      case NodeKind::kBaseLit:
        return C.kind == NodeKind::kBaseLit && A.text == C.text && mark("string_equal");
      case NodeKind::kEmptySet:
        return (C.kind == NodeKind::kEmptySet ||
                (C.kind == NodeKind::kSet && C.children.empty())) &&
               mark("set_equal");
      default:
        break;
    }
    if (is_scalar(*a.e, a.n) && is_scalar(*c.e, c.n)) return scalar_equal({{a, 1}}, {{c, 1}}, true);
    return false;
  }

 private:
  const CompareOptions& opt_;
  Budget& b_;

  // The outermost rule that decided wins: callers mark after their parts were compared.
  bool mark(const char* r) {
    reason = r;
    return true;
  }

  bool in_order(Ref a, Ref c) {
    const Node& A = a.node();
    const Node& C = c.node();
    if (A.children.size() != C.children.size()) return false;
    for (std::size_t k = 0; k < A.children.size(); ++k)
      if (!equal(a.child(k), c.child(k))) return false;
    return true;
  }

  // Same elements in any order: a one-to-one matching when the sizes agree, else (a repeated
  // element, "(3,17,3,7)" listed twice) every element of each side equal to one of the other's.
  bool order_free(Ref a, Ref c) {
    const Node& A = a.node();
    const Node& C = c.node();
    if (A.children.size() != C.children.size()) return contains_all(a, c) && contains_all(c, a);
    std::vector<bool> used(C.children.size(), false);
    for (std::size_t i = 0; i < A.children.size(); ++i) {
      bool found = false;
      for (std::size_t j = 0; j < C.children.size() && !found; ++j) {
        if (used[j]) continue;
        std::string saved = reason;
        if (equal(a.child(i), c.child(j))) {
          used[j] = true;
          found = true;
        }
        reason = saved;
        if (too_complex) return false;
      }
      if (!found) return false;
    }
    return true;
  }

  bool contains_all(Ref a, Ref c) {
    const Node& A = a.node();
    const Node& C = c.node();
    if (A.children.empty() || C.children.empty()) return false;
    for (std::size_t i = 0; i < A.children.size(); ++i) {
      bool found = false;
      for (std::size_t j = 0; j < C.children.size() && !found; ++j) {
        std::string saved = reason;
        found = equal(a.child(i), c.child(j));
        reason = saved;
        if (too_complex) return false;
      }
      if (!found) return false;
    }
    return true;
  }

  // --- scalars -------------------------------------------------------------------------------

  std::optional<Rational> exact_sum(const Combo& terms) {
    Rational acc(0);
    for (const Term& t : terms) {
      auto v = eval_exact(*t.ref.e, t.ref.n, b_);
      if (!v) return std::nullopt;
      auto s = t.sign > 0 ? add(acc, *v) : sub(acc, *v);
      if (!s) return std::nullopt;
      acc = *s;
    }
    return acc;
  }

  Complex numeric_sum(const Combo& terms, const Bindings& bind) {
    Complex acc{0, 0};
    for (const Term& t : terms) acc += t.sign * eval_numeric(*t.ref.e, t.ref.n, bind, b_);
    return acc;
  }

  static bool has_inf_const(const Expr& e, int n) {
    const Node& node = e.at(n);
    if (node.kind == NodeKind::kConst && node.text == "inf") return true;
    return std::any_of(node.children.begin(), node.children.end(),
                       [&](int c) { return has_inf_const(e, c); });
  }

  // a and c: sums of signed subtrees; the prediction side c is scaled by pred_scale when asked.
  bool scalar_equal(const Combo& a, const Combo& c, bool scale_c) {
    bool decimal = false;
    std::vector<std::string> symbols;
    for (const Combo* side : {&a, &c})
      for (const Term& t : *side) {
        decimal = decimal || t.ref.e->has_decimal;
        collect_symbols(*t.ref.e, t.ref.n, symbols);
      }
    const Rational& scale = opt_.pred_scale;
    bool scaled = scale_c && !(scale == Rational(1));
    if (symbols.empty()) {
      auto ea = exact_sum(a);
      auto ec = ea ? exact_sum(c) : std::nullopt;
      if (ec && scaled) ec = mul(*ec, scale);
      if (ea && ec) {
        if (*ea == *ec) return mark("numeric_equal");
        if (!decimal || ea->is_integer()) return false;
        return decimal_close(ea->to_double(), ec->to_double()) && mark("numeric_equal");
      }
      Complex va = numeric_sum(a, {});
      Complex vc = numeric_sum(c, {});
      if (scaled) vc *= scale.to_double();
      if (b_.exhausted) {
        too_complex = true;
        return false;
      }
      bool fa = std::isfinite(va.real()) && std::isfinite(va.imag());
      bool fc = std::isfinite(vc.real()) && std::isfinite(vc.imag());
      if (!fa || !fc) {
        if (std::isinf(va.real()) && std::isinf(vc.real()) && va.real() == vc.real())
          return mark("numeric_equal");
        // An infinity nobody wrote is an overflow (10^{10^{10}}): too complex to judge.
        for (const Combo* side : {&a, &c})
          for (const Term& t : *side) {
            Complex v = eval_numeric(*t.ref.e, t.ref.n, {}, b_);
            if (std::isinf(std::abs(v)) && !has_inf_const(*t.ref.e, t.ref.n)) too_complex = true;
          }
        return false;
      }
      if (ea && ea->is_integer() && !decimal) {
        // A gold integer against an irrational/complex prediction: tight tolerance only.
        return close_c(va, vc, 1e-12, 1e-12) && mark("numeric_equal");
      }
      bool ok = decimal ? (std::fabs(va.imag()) <= 1e-12 && std::fabs(vc.imag()) <= 1e-12
                               ? decimal_close(va.real(), vc.real())
                               : close_c(va, vc, 1e-6, 1e-12))
                        : close_c(va, vc, 1e-9, 1e-12);
      return ok && mark("numeric_equal");
    }
    if (static_cast<int>(symbols.size()) > kMaxSymbols) {
      too_complex = true;
      return false;
    }
    std::uint64_t state = kSeed;
    int valid = 0;
    Bindings bind;
    for (int p = 0; p < kPoints; ++p) {
      bind.clear();
      for (const std::string& s : symbols)
        bind.emplace_back(s, p < 4 ? uniform(state, 0.3, 2.7) : uniform(state, -2.7, 2.7));
      Complex va = numeric_sum(a, bind);
      Complex vc = numeric_sum(c, bind);
      if (scaled) vc *= scale.to_double();
      if (b_.exhausted) {
        too_complex = true;
        return false;
      }
      bool fa = std::isfinite(va.real()) && std::isfinite(va.imag());
      bool fc = std::isfinite(vc.real()) && std::isfinite(vc.imag());
      if (!fa && !fc) continue;
      if (fa != fc) return false;
      if (!close_c(va, vc, decimal ? 1e-6 : 1e-8, 1e-10)) return false;
      ++valid;
    }
    return valid >= 3 && mark("symbolic_equal");
  }

  // --- relations -----------------------------------------------------------------------------

  struct Rel {
    std::vector<Ref> operands;
    std::vector<std::string> ops;
  };

  static Rel normalized(Ref r) {
    Rel out;
    const Node& n = r.node();
    for (std::size_t k = 0; k < n.children.size(); ++k) out.operands.push_back(r.child(k));
    out.ops = n.ops;
    bool all_greater = std::all_of(out.ops.begin(), out.ops.end(),
                                   [](const std::string& o) { return o == ">" || o == "ge"; });
    if (all_greater) {
      std::reverse(out.operands.begin(), out.operands.end());
      std::reverse(out.ops.begin(), out.ops.end());
      for (auto& o : out.ops) o = o == ">" ? "<" : "le";
    }
    // An assignment chain x = a = b keeps its first left and last right side.
    if (out.ops.size() > 1 && std::all_of(out.ops.begin(), out.ops.end(),
                                          [](const std::string& o) { return o == "="; })) {
      out.operands = {out.operands.front(), out.operands.back()};
      out.ops = {"="};
    }
    return out;
  }

  bool relations_equal(Ref a, Ref c) {
    Rel ra = normalized(a), rc = normalized(c);
    if (ra.ops != rc.ops) return false;
    if (ra.ops.size() == 1) {
      Combo da{{ra.operands[0], 1}, {ra.operands[1], -1}};
      Combo dc{{rc.operands[0], 1}, {rc.operands[1], -1}};
      if (scalar_ok(da) && scalar_ok(dc)) {
        if (scalar_equal(da, dc, false)) return true;
        if (ra.ops[0] == "=" || ra.ops[0] == "ne") {
          Combo neg_dc{{rc.operands[0], -1}, {rc.operands[1], 1}};
          if (scalar_equal(da, neg_dc, false)) return true;
        }
        // The same relation written at another scale: 2y = 4x + 2 is y = 2x + 1 (any non-zero
        // factor for = and !=, a positive one for < and <=, which keeps the direction).
        return proportional(da, dc, ra.ops[0] == "<" || ra.ops[0] == "le");
      }
    }
    for (std::size_t k = 0; k < ra.operands.size(); ++k)
      if (!equal(ra.operands[k], rc.operands[k])) return false;
    return true;
  }

  // a = k * c for one constant k != 0 (k > 0 when `positive`), judged at the sample points of
  // their free symbols; needs symbols (constant sides are compared exactly above).
  bool proportional(const Combo& a, const Combo& c, bool positive) {
    std::vector<std::string> symbols;
    for (const Combo* side : {&a, &c})
      for (const Term& t : *side) collect_symbols(*t.ref.e, t.ref.n, symbols);
    if (symbols.empty() || static_cast<int>(symbols.size()) > kMaxSymbols) return false;
    std::uint64_t state = kSeed;
    int valid = 0;
    Complex k{0, 0};
    Bindings bind;
    for (int p = 0; p < kPoints; ++p) {
      bind.clear();
      for (const std::string& sym : symbols)
        bind.emplace_back(sym, p < 4 ? uniform(state, 0.3, 2.7) : uniform(state, -2.7, 2.7));
      Complex va = numeric_sum(a, bind), vc = numeric_sum(c, bind);
      if (b_.exhausted) {
        too_complex = true;
        return false;
      }
      if (!std::isfinite(std::abs(va)) || !std::isfinite(std::abs(vc))) continue;
      if (std::abs(vc) < 1e-9 || std::abs(va) < 1e-9) {
        if (std::abs(vc) < 1e-9 && std::abs(va) < 1e-9) continue;  // both sides vanish here
        return false;
      }
      Complex r = va / vc;
      if (valid == 0) k = r;
      else if (!close_c(r, k, 1e-8, 1e-12)) return false;
      ++valid;
    }
    if (valid < 3 || std::abs(k.imag()) > 1e-9 * std::abs(k)) return false;
    return !positive || k.real() > 0;
  }

  static bool scalar_ok(const Combo& c) {
    return std::all_of(c.begin(), c.end(), [](const Term& t) { return is_scalar(*t.ref.e, t.ref.n); });
  }

  // --- intervals -----------------------------------------------------------------------------

  static bool is_interval_like(Ref r) {
    const Node& n = r.node();
    if (n.kind == NodeKind::kUnion) return true;
    return n.kind == NodeKind::kTuple && n.children.size() == 2 && !(n.open == '(' && n.close == ')');
  }

  Endpoint endpoint(Ref r) {
    Endpoint ep;
    ep.ref = r;
    std::vector<std::string> syms;
    collect_symbols(*r.e, r.n, syms);
    if (syms.empty() && has_inf_const(*r.e, r.n)) {
      Complex v = eval_numeric(*r.e, r.n, {}, b_);
      if (std::isinf(v.real())) ep.inf = v.real() > 0 ? 1 : -1;
    }
    return ep;
  }

  bool intervals_of(Ref r, std::vector<Interval>& out) {
    const Node& n = r.node();
    if (n.kind == NodeKind::kTuple && n.children.size() == 2 && (n.open == '(' || n.open == '[') &&
        (n.close == ')' || n.close == ']')) {
      Interval iv;
      iv.lo = endpoint(r.child(0));
      iv.hi = endpoint(r.child(1));
      iv.lo_closed = n.open == '[';
      iv.hi_closed = n.close == ']';
      out.push_back(iv);
      return true;
    }
    if (n.kind == NodeKind::kUnion || n.kind == NodeKind::kList) {
      if (n.kind == NodeKind::kList &&
          !std::all_of(n.children.begin(), n.children.end(),
                       [&](int c) { return r.e->at(c).kind == NodeKind::kRelation; }))
        return false;
      for (std::size_t k = 0; k < n.children.size(); ++k)
        if (!intervals_of(r.child(k), out)) return false;
      return true;
    }
    if (n.kind == NodeKind::kRelation) return relation_intervals(r, out);
    return false;
  }

  static bool is_lone_symbol(Ref r) { return r.node().kind == NodeKind::kSymbol; }
  static bool is_constant(Ref r) {
    std::vector<std::string> s;
    collect_symbols(*r.e, r.n, s);
    return s.empty() && is_scalar(*r.e, r.n);
  }

  bool relation_intervals(Ref r, std::vector<Interval>& out) {
    Rel rel = normalized(r);  // only < and le remain for inequalities written with > / ge
    auto inf_ep = [&](int sign) {
      Endpoint e;
      e.inf = sign;
      return e;
    };
    if (rel.operands.size() == 2) {
      const std::string& op = rel.ops[0];
      bool sym_left = is_lone_symbol(rel.operands[0]) && is_constant(rel.operands[1]);
      bool sym_right = is_lone_symbol(rel.operands[1]) && is_constant(rel.operands[0]);
      if (!sym_left && !sym_right) return false;
      Endpoint c = endpoint(sym_left ? rel.operands[1] : rel.operands[0]);
      Interval iv;
      if (op == "ne") {
        out.push_back({inf_ep(-1), c, false, false});
        out.push_back({c, inf_ep(1), false, false});
        return true;
      }
      bool closed = op == "le" || op == "ge";
      bool less = op == "<" || op == "le";
      if (op != "<" && op != "le" && op != ">" && op != "ge") return false;
      // sym_left: x < c -> (-inf, c); sym_right: c < x -> (c, inf).
      bool upper = sym_left ? less : !less;
      if (upper) out.push_back({inf_ep(-1), c, false, closed});
      else out.push_back({c, inf_ep(1), closed, false});
      return true;
    }
    if (rel.operands.size() == 3 && is_constant(rel.operands[0]) && is_constant(rel.operands[2])) {
      for (const auto& o : rel.ops)
        if (o != "<" && o != "le") return false;
      const Ref mid = rel.operands[1];
      const bool lo_closed = rel.ops[0] == "le", hi_closed = rel.ops[1] == "le";
      Endpoint lo = endpoint(rel.operands[0]), hi = endpoint(rel.operands[2]);
      if (is_constant(mid)) return false;
      // a < |x| < b with 0 < a: [-b, -a] and [a, b] (issue 51: `1 \le |z| \le 3/2`).
      const Node& m = mid.node();
      if (m.kind == NodeKind::kFunc && m.text == "abs" && m.children.size() == 1 &&
          is_lone_symbol(mid.child(0)) && lo.inf == 0 && hi.inf == 0) {
        Complex a = eval_numeric(*lo.ref.e, lo.ref.n, {}, b_);
        if (!(a.real() > 0) || a.imag() != 0) return false;
        Endpoint nlo = hi, nhi = lo;
        nlo.neg = nhi.neg = true;
        out.push_back({nlo, nhi, hi_closed, lo_closed});
        out.push_back({lo, hi, lo_closed, hi_closed});
        return true;
      }
      // a < x < b, also a < f(x) < b (the range of f).
      out.push_back({lo, hi, lo_closed, hi_closed});
      return true;
    }
    return false;
  }

  bool endpoint_equal(const Endpoint& x, const Endpoint& y) {
    if (x.inf != 0 || y.inf != 0) return x.inf == y.inf;
    std::string saved = reason;
    bool ok = scalar_equal({{x.ref, x.neg ? -1.0 : 1.0}}, {{y.ref, y.neg ? -1.0 : 1.0}}, false);
    reason = saved;
    return ok;
  }

  bool interval_sets_equal(const std::vector<Interval>& a, const std::vector<Interval>& c) {
    if (a.size() != c.size()) return false;
    std::vector<bool> used(c.size(), false);
    for (const Interval& x : a) {
      bool found = false;
      for (std::size_t j = 0; j < c.size() && !found; ++j) {
        if (used[j]) continue;
        const Interval& y = c[j];
        bool lo_ok = x.lo.inf != 0 || y.lo.inf != 0 || x.lo_closed == y.lo_closed;
        bool hi_ok = x.hi.inf != 0 || y.hi.inf != 0 || x.hi_closed == y.hi_closed;
        if (lo_ok && hi_ok && endpoint_equal(x.lo, y.lo) && endpoint_equal(x.hi, y.hi)) {
          used[j] = true;
          found = true;
        }
        if (too_complex) return false;
      }
      if (!found) return false;
    }
    return true;
  }
};

}  // namespace

CompareOutcome compare_exprs(const Expr& gold, const Expr& pred, const CompareOptions& options,
                             Budget& budget) {
  CompareOutcome out;
  if (gold.root < 0 || pred.root < 0) return out;
  Comparer c(options, budget);
  out.equal = c.equal(Ref{&gold, gold.root}, Ref{&pred, pred.root});
  out.too_complex = !out.equal && (c.too_complex || budget.exhausted);
  out.reason = out.equal ? (c.reason.empty() ? "structure_equal" : c.reason)
                         : (out.too_complex ? "too_complex" : "not_equal");
  return out;
}

}  // namespace lorasync::reward
