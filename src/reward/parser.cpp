// Recursive-descent parser for LaTeX answers (grammar in parser.h). Internally a parse failure is
// an exception (ParseFail) caught at parse_answer(); nothing escapes.
#include "reward/parser.h"

#include <algorithm>
#include <array>
#include <cctype>

namespace lorasync::reward {
namespace {

enum class Tok : std::uint8_t { kNum, kLetter, kCmd, kChar, kEnd };

struct Token {
  Tok kind = Tok::kEnd;
  std::string text;  // digits, one letter, command name (no backslash), or one character
  bool space_before = false;
};

struct ParseFail {
  std::string why;
  bool too_complex = false;
};

bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_alpha(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }

std::vector<Token> tokenize(std::string_view s) {
  std::vector<Token> out;
  bool space = false;
  std::size_t i = 0;
  while (i < s.size()) {
    char c = s[i];
    if (c == ' ' || c == '\t' || c == '\n') {
      space = true;
      ++i;
      continue;
    }
    Token t;
    t.space_before = space;
    space = false;
    if (is_digit(c) || (c == '.' && i + 1 < s.size() && is_digit(s[i + 1]))) {
      std::size_t j = i;
      while (j < s.size() && is_digit(s[j])) ++j;
      if (j < s.size() && s[j] == '.' && j + 1 < s.size() && is_digit(s[j + 1])) {
        ++j;
        while (j < s.size() && is_digit(s[j])) ++j;
      }
      t.kind = Tok::kNum;
      t.text = std::string(s.substr(i, j - i));
      i = j;
    } else if (is_alpha(c)) {
      t.kind = Tok::kLetter;
      t.text = std::string(1, c);
      ++i;
    } else if (c == '\\') {
      std::size_t j = i + 1;
      while (j < s.size() && is_alpha(s[j])) ++j;
      if (j == i + 1) {
        if (j >= s.size()) throw ParseFail{"trailing backslash"};
        j = i + 2;  // \{ \} \\ \| \, ...
      }
      t.kind = Tok::kCmd;
      t.text = std::string(s.substr(i + 1, j - i - 1));
      i = j;
    } else {
      t.kind = Tok::kChar;
      t.text = std::string(1, c);
      ++i;
    }
    out.push_back(std::move(t));
  }
  Token end;
  end.kind = Tok::kEnd;
  out.push_back(end);
  return out;
}

constexpr std::array<std::string_view, 20> kFunctions{
    "sin", "cos", "tan", "sec", "csc", "cot", "arcsin", "arccos", "arctan", "sinh",
    "cosh", "tanh", "ln", "log", "exp", "sqrt", "arcsec", "arccsc", "arccot", "lg"};

bool is_function_name(std::string_view n) {
  return std::find(kFunctions.begin(), kFunctions.end(), n) != kFunctions.end();
}

constexpr std::array<std::string_view, 40> kGreek{
    "alpha", "beta", "gamma", "delta", "epsilon", "varepsilon", "zeta", "eta", "theta",
    "vartheta", "iota", "kappa", "lambda", "mu", "nu", "xi", "rho", "sigma", "tau", "upsilon",
    "phi", "varphi", "chi", "psi", "omega", "Gamma", "Delta", "Theta", "Lambda", "Xi", "Sigma",
    "Phi", "Psi", "Omega", "ell", "hbar", "varrho", "varsigma", "Pi", "nabla"};

constexpr std::array<std::string_view, 12> kDecorators{
    "overline", "bar", "hat", "vec", "widehat", "overrightarrow", "tilde", "widetilde", "dot",
    "ddot", "mathbb", "mathcal"};

class Parser {
 public:
  Parser(std::vector<Token> toks, int max_depth, int max_nodes)
      : toks_(std::move(toks)), max_depth_(max_depth), max_nodes_(max_nodes) {}

  Expr run() {
    int root = parse_list(/*top=*/true);
    if (peek().kind != Tok::kEnd) throw ParseFail{"unexpected '" + peek().text + "'"};
    e_.root = root;
    return std::move(e_);
  }

 private:
  std::vector<Token> toks_;
  std::size_t pos_ = 0;
  int depth_ = 0;
  int abs_depth_ = 0;
  int max_depth_;
  int max_nodes_;
  Expr e_;

  struct DepthGuard {
    Parser& p;
    explicit DepthGuard(Parser& parser) : p(parser) {
      if (++p.depth_ > p.max_depth_) throw ParseFail{"nesting too deep", true};
    }
    ~DepthGuard() { --p.depth_; }
  };

  const Token& peek(std::size_t ahead = 0) const {
    std::size_t k = std::min(pos_ + ahead, toks_.size() - 1);
    return toks_[k];
  }
  Token next() {
    Token t = peek();
    if (pos_ < toks_.size() - 1) ++pos_;
    return t;
  }
  bool is_char(const Token& t, char c) const { return t.kind == Tok::kChar && t.text[0] == c; }
  bool is_cmd(const Token& t, std::string_view n) const { return t.kind == Tok::kCmd && t.text == n; }
  void expect_char(char c) {
    if (!is_char(peek(), c)) throw ParseFail{std::string("expected '") + c + "'"};
    next();
  }

  int add(Node n) {
    if (static_cast<int>(e_.nodes.size()) >= max_nodes_) throw ParseFail{"too many nodes", true};
    e_.nodes.push_back(std::move(n));
    return static_cast<int>(e_.nodes.size()) - 1;
  }
  int leaf(NodeKind k, std::string text) {
    Node n;
    n.kind = k;
    n.text = std::move(text);
    return add(std::move(n));
  }
  int unary(NodeKind k, int child, std::string text = {}) {
    Node n;
    n.kind = k;
    n.text = std::move(text);
    n.children = {child};
    return add(std::move(n));
  }
  int binary(NodeKind k, int a, int b, std::string text = {}) {
    Node n;
    n.kind = k;
    n.text = std::move(text);
    n.children = {a, b};
    return add(std::move(n));
  }

  bool at_list_end() const {
    const Token& t = peek();
    if (t.kind == Tok::kEnd) return true;
    if (t.kind == Tok::kChar && (t.text[0] == ')' || t.text[0] == ']' || t.text[0] == '}' ||
                                 (t.text[0] == '|' && abs_depth_ > 0) || t.text[0] == '&'))
      return true;
    if (t.kind == Tok::kCmd && (t.text == "}" || t.text == "rfloor" || t.text == "rceil" ||
                                t.text == "\\" || t.text == "end" || t.text == "rvert" ||
                                t.text == "right"))
      return true;
    return false;
  }

  // list := union (',' union)*
  int parse_list(bool top) {
    DepthGuard g(*this);
    std::vector<int> items;
    items.push_back(parse_union());
    while (is_char(peek(), ',') || is_char(peek(), ';')) {
      next();
      if (at_list_end()) break;  // "1, 2," trailing comma
      items.push_back(parse_union());
    }
    if (items.size() == 1) return items[0];
    Node n;
    n.kind = NodeKind::kList;
    n.children = std::move(items);
    (void)top;
    return add(std::move(n));
  }

  int parse_union() {
    int first = parse_relation();
    if (!is_cmd(peek(), "cup")) {
      if (is_cmd(peek(), "cap") || is_cmd(peek(), "setminus")) throw ParseFail{"set algebra"};
      return first;
    }
    Node n;
    n.kind = NodeKind::kUnion;
    n.children.push_back(first);
    while (is_cmd(peek(), "cup")) {
      next();
      n.children.push_back(parse_relation());
    }
    return add(std::move(n));
  }

  std::string relop(const Token& t) const {
    if (t.kind == Tok::kChar) {
      if (t.text == "=") return "=";
      if (t.text == "<") return "<";
      if (t.text == ">") return ">";
      return {};
    }
    if (t.kind == Tok::kCmd) {
      if (t.text == "le" || t.text == "ge" || t.text == "ne") return t.text;
      if (t.text == "approx" || t.text == "equiv") return "=";
    }
    return {};
  }

  int parse_relation() {
    int first = parse_sum();
    std::string op = relop(peek());
    if (op.empty()) return first;
    Node n;
    n.kind = NodeKind::kRelation;
    n.children.push_back(first);
    while (!(op = relop(peek())).empty()) {
      next();
      n.ops.push_back(op);
      n.children.push_back(parse_sum());
    }
    return add(std::move(n));
  }

  int parse_sum() {
    int acc = parse_unary();
    while (true) {
      const Token& t = peek();
      if (is_char(t, '+')) {
        next();
        acc = append(NodeKind::kAdd, acc, parse_term());
      } else if (is_char(t, '-')) {
        next();
        acc = append(NodeKind::kAdd, acc, unary(NodeKind::kNeg, parse_term()));
      } else if (is_cmd(t, "pm") || is_cmd(t, "mp")) {
        next();
        acc = binary(NodeKind::kPlusMinus, acc, parse_term());
      } else {
        return acc;
      }
    }
  }

  int append(NodeKind k, int acc, int item) {
    Node& a = e_.nodes[static_cast<std::size_t>(acc)];
    if (a.kind == k && !a.text.empty() && a.text == "flat") {
      a.children.push_back(item);
      return acc;
    }
    Node n;
    n.kind = k;
    n.text = "flat";  // marks an n-ary node this parser built (safe to extend)
    n.children = {acc, item};
    return add(std::move(n));
  }

  int parse_unary() {
    DepthGuard g(*this);
    const Token& t = peek();
    if (is_char(t, '-')) {
      next();
      return unary(NodeKind::kNeg, parse_term());
    }
    if (is_char(t, '+')) {
      next();
      return parse_term();
    }
    if (is_cmd(t, "pm") || is_cmd(t, "mp")) {
      next();
      return unary(NodeKind::kPlusMinus, parse_term());
    }
    return parse_term();
  }

  bool starts_primary(const Token& t) const {
    switch (t.kind) {
      case Tok::kNum:
      case Tok::kLetter:
        return true;
      case Tok::kChar:
        return t.text[0] == '(' || t.text[0] == '{' || (t.text[0] == '|' && abs_depth_ == 0);
      case Tok::kCmd: {
        std::string_view n = t.text;
        if (n == "frac" || n == "sqrt" || n == "binom" || n == "pi" || n == "infty" ||
            n == "lfloor" || n == "lceil" || n == "begin" || n == "lvert" || n == "emptyset" ||
            n == "varnothing" || n == "{")
          return true;
        if (is_function_name(n)) return true;
        if (std::find(kGreek.begin(), kGreek.end(), n) != kGreek.end()) return true;
        if (std::find(kDecorators.begin(), kDecorators.end(), n) != kDecorators.end()) return true;
        return false;
      }
      default:
        return false;
    }
  }

  // term := power (op power | power)*
  int parse_term() {
    int acc = parse_power();
    while (true) {
      const Token& t = peek();
      if (is_char(t, '*') || is_cmd(t, "cdot") || is_cmd(t, "times") || is_cmd(t, "ast")) {
        next();
        acc = append(NodeKind::kMul, acc, parse_power_signed());
      } else if (is_char(t, '/') || is_cmd(t, "div") || is_char(t, ':')) {
        next();
        acc = binary(NodeKind::kDiv, acc, parse_power_signed());
      } else if (starts_primary(t)) {
        acc = append(NodeKind::kMul, acc, parse_power());
      } else {
        return acc;
      }
    }
  }

  int parse_power_signed() {
    if (is_char(peek(), '-')) {
      next();
      return unary(NodeKind::kNeg, parse_power());
    }
    return parse_power();
  }

  int parse_power() {
    DepthGuard g(*this);
    int base = parse_postfix();
    if (!is_char(peek(), '^')) return base;
    next();
    int exp = parse_script();
    if (is_char(peek(), '^')) {  // a^b^c = a^(b^c)
      next();
      exp = binary(NodeKind::kPow, exp, parse_script());
    }
    int p = binary(NodeKind::kPow, base, exp);
    return parse_postfix_ops(p);
  }

  // A script after ^ or _: {group}, -x, one number, one letter or one command primary.
  int parse_script() {
    DepthGuard g(*this);
    const Token& t = peek();
    if (is_char(t, '{')) {
      next();
      int v = parse_list(false);
      expect_char('}');
      return v;
    }
    if (is_char(t, '-')) {
      next();
      return unary(NodeKind::kNeg, parse_script());
    }
    if (t.kind == Tok::kNum) {
      Token n = next();
      if (n.text.find('.') != std::string::npos) e_.has_decimal = true;
      return leaf(NodeKind::kNumber, n.text);
    }
    if (t.kind == Tok::kLetter) {
      Token l = next();
      return letter_node(l.text[0]);
    }
    return parse_primary();
  }

  int letter_node(char c) {
    if (c == 'e') return leaf(NodeKind::kConst, "e");
    if (c == 'i') return leaf(NodeKind::kConst, "i");
    return leaf(NodeKind::kSymbol, std::string(1, c));
  }

  // The raw source text of a {group}, for subscripts and decorated symbols.
  std::string raw_group() {
    std::string out;
    if (!is_char(peek(), '{')) {
      Token t = next();
      if (t.kind == Tok::kEnd) throw ParseFail{"missing script"};
      return t.kind == Tok::kCmd ? "\\" + t.text : t.text;
    }
    next();
    int depth = 1;
    while (true) {
      Token t = next();
      if (t.kind == Tok::kEnd) throw ParseFail{"unclosed brace"};
      if (is_char(t, '{')) ++depth;
      if (is_char(t, '}') && --depth == 0) break;
      out += t.kind == Tok::kCmd ? "\\" + t.text : t.text;
    }
    return out;
  }

  int parse_postfix() { return parse_postfix_ops(parse_primary()); }

  int parse_postfix_ops(int p) {
    while (true) {
      const Token& t = peek();
      if (is_char(t, '!')) {
        next();
        p = unary(NodeKind::kFactorial, p);
      } else if (is_char(t, '\'')) {
        next();
        Node& n = e_.nodes[static_cast<std::size_t>(p)];
        if (n.kind != NodeKind::kSymbol) throw ParseFail{"prime on a non-symbol"};
        n.text += "'";
      } else if (is_char(t, '_')) {
        next();
        std::string sub = raw_group();
        Node& n = e_.nodes[static_cast<std::size_t>(p)];
        if (n.kind == NodeKind::kNumber && !sub.empty() &&
            (std::all_of(sub.begin(), sub.end(), is_digit) || (sub.size() == 1 && is_alpha(sub[0])))) {
          n.kind = NodeKind::kBaseLit;
          n.text += "_" + sub;
        } else if (n.kind == NodeKind::kSymbol || n.kind == NodeKind::kConst) {
          n.kind = NodeKind::kSymbol;
          n.text += "_" + sub;
        } else {
          throw ParseFail{"subscript on an expression"};
        }
      } else {
        return p;
      }
    }
  }

  int parse_group_arg() {
    if (is_char(peek(), '{')) {
      next();
      int v = parse_list(false);
      expect_char('}');
      return v;
    }
    return parse_script();
  }

  int parse_bracket() {
    Token open = next();
    std::vector<int> items;
    if (!is_char(peek(), ')') && !is_char(peek(), ']')) {
      items.push_back(parse_union());
      while (is_char(peek(), ',') || is_char(peek(), ';')) {
        next();
        items.push_back(parse_union());
      }
    }
    const Token& close = peek();
    if (!is_char(close, ')') && !is_char(close, ']')) throw ParseFail{"unclosed bracket"};
    char c = next().text[0];
    if (items.size() == 1 && ((open.text[0] == '(' && c == ')') || (open.text[0] == '[' && c == ']')))
      return items[0];
    if (items.empty()) throw ParseFail{"empty brackets"};
    Node n;
    n.kind = NodeKind::kTuple;
    n.children = std::move(items);
    n.open = open.text[0];
    n.close = c;
    return add(std::move(n));
  }

  int parse_function(std::string name) {
    // Optional power (\sin^2 x) and base (\log_2 x).
    int power = -1, base = -1;
    for (int k = 0; k < 2; ++k) {
      if (is_char(peek(), '^')) {
        next();
        power = parse_script();
      } else if (is_char(peek(), '_') && (name == "log")) {
        next();
        base = parse_script();
      }
    }
    int arg;
    if (is_char(peek(), '(') || is_char(peek(), '{')) {
      if (is_char(peek(), '{')) {
        next();
        arg = parse_list(false);
        expect_char('}');
      } else {
        arg = parse_bracket();
      }
    } else {
      // \sin 2x: a product of plain factors without operators.
      arg = parse_power();
      while (peek().kind == Tok::kNum || peek().kind == Tok::kLetter ||
             (peek().kind == Tok::kCmd && std::find(kGreek.begin(), kGreek.end(), peek().text) != kGreek.end()) ||
             is_cmd(peek(), "pi"))
        arg = append(NodeKind::kMul, arg, parse_power());
    }
    Node n;
    n.kind = NodeKind::kFunc;
    if (name == "lg") name = "log";
    n.text = name;
    n.children.push_back(arg);
    if (name == "log") n.children.push_back(base >= 0 ? base : leaf(NodeKind::kNumber, "10"));
    if (name == "ln") {
      n.text = "log";
      n.children.push_back(leaf(NodeKind::kConst, "e"));
    }
    int f = add(std::move(n));
    if (power >= 0) {
      // \sin^{-1} x is arcsin x.
      const Node& pw = e_.at(power);
      if (pw.kind == NodeKind::kNeg && e_.at(pw.children[0]).kind == NodeKind::kNumber &&
          e_.at(pw.children[0]).text == "1" && name.size() == 3) {
        e_.nodes[static_cast<std::size_t>(f)].text = "arc" + name;
        return f;
      }
      return binary(NodeKind::kPow, f, power);
    }
    return f;
  }

  int parse_matrix() {
    Node n;
    n.kind = NodeKind::kMatrix;
    std::vector<std::vector<int>> rows(1);
    while (true) {
      if (is_cmd(peek(), "end")) break;
      if (peek().kind == Tok::kEnd) throw ParseFail{"unclosed matrix"};
      rows.back().push_back(parse_union());
      if (is_char(peek(), '&')) {
        next();
      } else if (is_cmd(peek(), "\\")) {
        next();
        if (!is_cmd(peek(), "end")) rows.emplace_back();
      } else if (!is_cmd(peek(), "end")) {
        throw ParseFail{"bad matrix cell"};
      }
    }
    next();  // \end
    std::string env = raw_group();
    if (env != "pmatrix") throw ParseFail{"mismatched environment"};
    n.rows = static_cast<int>(rows.size());
    n.cols = static_cast<int>(rows[0].size());
    for (auto& r : rows) {
      if (static_cast<int>(r.size()) != n.cols) throw ParseFail{"ragged matrix"};
      n.children.insert(n.children.end(), r.begin(), r.end());
    }
    return add(std::move(n));
  }

  int parse_primary() {
    DepthGuard g(*this);
    const Token t = peek();
    switch (t.kind) {
      case Tok::kEnd:
        throw ParseFail{"unexpected end"};
      case Tok::kNum:
        next();
        if (t.text.find('.') != std::string::npos) e_.has_decimal = true;
        return leaf(NodeKind::kNumber, t.text);
      case Tok::kLetter: {
        // A run of letters without spaces: a function name, "pi", a word, or single letters.
        std::string run;
        for (std::size_t k = 0;; ++k) {
          const Token& u = peek(k);
          if (u.kind != Tok::kLetter || (k > 0 && u.space_before)) break;
          run += u.text;
        }
        for (std::size_t len = std::min<std::size_t>(run.size(), 6); len >= 2; --len) {
          std::string head = run.substr(0, len);
          if (is_function_name(head) && (len == run.size() || len >= 3)) {
            for (std::size_t k = 0; k < len; ++k) next();
            if (head == "sqrt") {
              int a = parse_group_arg();
              return add(Node{NodeKind::kFunc, "sqrt", {a}, {}, 0, 0, 0, 0});
            }
            return parse_function(head);
          }
        }
        if (run == "pi") {
          next();
          next();
          return leaf(NodeKind::kConst, "pi");
        }
        if (run.size() >= 4) {
          for (std::size_t k = 0; k < run.size(); ++k) next();
          std::string w;
          for (char c : run) w.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
          return leaf(NodeKind::kSymbol, w);
        }
        next();
        return letter_node(t.text[0]);
      }
      case Tok::kChar: {
        char c = t.text[0];
        if (c == '(' || c == '[') return parse_bracket();
        if (c == '{') {
          next();
          if (is_char(peek(), '}')) throw ParseFail{"empty group"};
          int v = parse_list(false);
          expect_char('}');
          return v;
        }
        if (c == '|') {
          next();
          ++abs_depth_;
          int v = parse_sum();
          --abs_depth_;
          expect_char('|');
          return add(Node{NodeKind::kFunc, "abs", {v}, {}, 0, 0, 0, 0});
        }
        throw ParseFail{"unexpected '" + t.text + "'"};
      }
      case Tok::kCmd:
        return parse_command();
    }
    throw ParseFail{"unreachable"};
  }

  int parse_command() {
    Token t = next();
    const std::string& n = t.text;
    if (n == "frac") {
      int a = parse_group_arg();
      int b = parse_group_arg();
      return binary(NodeKind::kDiv, a, b);
    }
    if (n == "sqrt") {
      int index = -1;
      if (is_char(peek(), '[')) {
        next();
        index = parse_sum();
        expect_char(']');
      }
      int a = parse_group_arg();
      if (index >= 0) return add(Node{NodeKind::kFunc, "root", {a, index}, {}, 0, 0, 0, 0});
      return add(Node{NodeKind::kFunc, "sqrt", {a}, {}, 0, 0, 0, 0});
    }
    if (n == "binom") {
      int a = parse_group_arg();
      int b = parse_group_arg();
      return add(Node{NodeKind::kFunc, "binom", {a, b}, {}, 0, 0, 0, 0});
    }
    if (n == "pi") return leaf(NodeKind::kConst, "pi");
    if (n == "infty" || n == "infin") return leaf(NodeKind::kConst, "inf");
    if (n == "emptyset" || n == "varnothing") return leaf(NodeKind::kEmptySet, "");
    if (is_function_name(n)) {
      if (n == "sqrt") return parse_group_arg();
      return parse_function(n);
    }
    if (std::find(kGreek.begin(), kGreek.end(), n) != kGreek.end()) return leaf(NodeKind::kSymbol, "\\" + n);
    if (std::find(kDecorators.begin(), kDecorators.end(), n) != kDecorators.end())
      return leaf(NodeKind::kSymbol, "\\" + n + "{" + raw_group() + "}");
    if (n == "{") {
      Node s;
      s.kind = NodeKind::kSet;
      if (is_cmd(peek(), "}")) {
        next();
        return leaf(NodeKind::kEmptySet, "");
      }
      s.children.push_back(parse_union());
      while (is_char(peek(), ',') || is_char(peek(), ';')) {
        next();
        s.children.push_back(parse_union());
      }
      if (!is_cmd(peek(), "}")) throw ParseFail{"unclosed set"};
      next();
      return add(std::move(s));
    }
    if (n == "lfloor" || n == "lceil" || n == "lvert") {
      if (n == "lvert") ++abs_depth_;
      int v = parse_sum();
      if (n == "lvert") --abs_depth_;
      std::string close = n == "lfloor" ? "rfloor" : n == "lceil" ? "rceil" : "rvert";
      if (!is_cmd(peek(), close)) throw ParseFail{"unclosed " + n};
      next();
      return add(Node{NodeKind::kFunc, n == "lfloor" ? "floor" : n == "lceil" ? "ceil" : "abs", {v},
                      {}, 0, 0, 0, 0});
    }
    if (n == "begin") {
      std::string env = raw_group();
      if (env != "pmatrix") throw ParseFail{"unsupported environment " + env};
      return parse_matrix();
    }
    throw ParseFail{"unknown command \\" + n};
  }
};

// "7 3/4", "7\frac{3}{4}", "-2 1/2": a whole answer that is a mixed number -> its value.
bool mixed_number(std::string_view s, Expr& out) {
  std::size_t i = 0;
  bool negative = false;
  if (i < s.size() && s[i] == '-') {
    negative = true;
    ++i;
  }
  auto digits = [&](std::string& d) {
    std::size_t st = i;
    while (i < s.size() && is_digit(s[i])) ++i;
    d = std::string(s.substr(st, i - st));
    return !d.empty() && d.size() <= 12;
  };
  std::string whole, num, den;
  if (!digits(whole)) return false;
  bool spaced = i < s.size() && s[i] == ' ';
  if (spaced) ++i;
  if (s.substr(i, 6) == "\\frac{") {
    i += 6;
    if (!digits(num) || s.substr(i, 2) != "}{") return false;
    i += 2;
    if (!digits(den) || i >= s.size() || s[i] != '}') return false;
    ++i;
  } else {
    if (!spaced || !digits(num) || i >= s.size() || s[i] != '/') return false;
    ++i;
    if (!digits(den)) return false;
  }
  if (i != s.size()) return false;
  long long w = std::stoll(whole), a = std::stoll(num), b = std::stoll(den);
  if (b == 0 || a >= b) return false;
  long long top = w * b + a;
  Expr e;
  e.nodes.push_back(Node{NodeKind::kNumber, std::to_string(top), {}, {}, 0, 0, 0, 0});
  e.nodes.push_back(Node{NodeKind::kNumber, std::to_string(b), {}, {}, 0, 0, 0, 0});
  e.nodes.push_back(Node{NodeKind::kDiv, "", {0, 1}, {}, 0, 0, 0, 0});
  e.root = 2;
  if (negative) {
    e.nodes.push_back(Node{NodeKind::kNeg, "", {2}, {}, 0, 0, 0, 0});
    e.root = 3;
  }
  out = std::move(e);
  return true;
}

}  // namespace

ParseResult parse_answer(std::string_view clean, int max_depth, int max_nodes) {
  ParseResult r;
  if (clean.empty()) {
    r.error = "empty";
    return r;
  }
  if (mixed_number(clean, r.expr)) {
    r.ok = true;
    return r;
  }
  try {
    Parser p(tokenize(clean), max_depth, max_nodes);
    r.expr = p.run();
    r.ok = true;
  } catch (const ParseFail& f) {
    r.error = f.why;
    r.too_complex = f.too_complex;
  }
  return r;
}

}  // namespace lorasync::reward
