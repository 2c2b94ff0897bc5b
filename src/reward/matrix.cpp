// Matrix arithmetic folded into one matrix literal (matrix.h).
#include "reward/matrix.h"

#include <cstddef>
#include <vector>

namespace lorasync::reward {
namespace {

class Folder {
 public:
  Folder(Expr& e, int max_nodes) : e_(e), max_nodes_(static_cast<std::size_t>(max_nodes)) {}

  // The index of a matrix node equal to node n's value; -1 when n is not a matrix expression.
  int fold(int n) {
    const Node node = e_.at(n);  // a copy: add() may reallocate the arena
    switch (node.kind) {
      case NodeKind::kMatrix: return n;
      case NodeKind::kNeg: {
        int m = fold(node.children[0]);
        if (m < 0) return -1;
        return map(m, [&](int x) { return add({NodeKind::kNeg, "", {x}, {}, 0, 0, 0, 0}); });
      }
      case NodeKind::kAdd: {
        std::vector<int> ms;
        for (int c : node.children) {
          int m = fold(c);
          if (m < 0) return -1;
          ms.push_back(m);
        }
        const Node first = e_.at(ms[0]);
        for (int m : ms)
          if (e_.at(m).rows != first.rows || e_.at(m).cols != first.cols) return -1;
        Node out = first;
        for (std::size_t k = 0; k < first.children.size(); ++k) {
          Node sum{NodeKind::kAdd, "", {}, {}, 0, 0, 0, 0};
          for (int m : ms) sum.children.push_back(e_.at(m).children[k]);
          int s = add(std::move(sum));
          if (s < 0) return -1;
          out.children[k] = s;
        }
        return add(std::move(out));
      }
      case NodeKind::kMul: {
        int acc = -1;          // the matrix so far
        std::vector<int> scalars;
        for (int c : node.children) {
          int m = contains_matrix(c) ? fold(c) : -2;
          if (m == -1) return -1;
          if (m == -2) {
            scalars.push_back(c);
            continue;
          }
          acc = acc < 0 ? m : product(acc, m);
          if (acc < 0) return -1;
        }
        if (acc < 0) return -1;
        for (int s : scalars) {
          acc = map(acc, [&](int x) { return add({NodeKind::kMul, "", {s, x}, {}, 0, 0, 0, 0}); });
          if (acc < 0) return -1;
        }
        return acc;
      }
      default: return -1;
    }
  }

 private:
  Expr& e_;
  std::size_t max_nodes_;

  int add(Node n) {
    if (e_.nodes.size() >= max_nodes_) return -1;
    e_.nodes.push_back(std::move(n));
    return static_cast<int>(e_.nodes.size()) - 1;
  }

  bool contains_matrix(int n) const {
    const Node& node = e_.at(n);
    if (node.kind == NodeKind::kMatrix) return true;
    for (int c : node.children)
      if (contains_matrix(c)) return true;
    return false;
  }

  template <class F>
  int map(int m, F f) {
    Node out = e_.at(m);
    for (int& c : out.children) {
      c = f(c);
      if (c < 0) return -1;
    }
    return add(std::move(out));
  }

  int product(int a, int b) {
    const Node A = e_.at(a), B = e_.at(b);
    if (A.cols != B.rows) return -1;
    Node out{NodeKind::kMatrix, "", {}, {}, 0, 0, A.rows, B.cols};
    for (int i = 0; i < A.rows; ++i) {
      for (int j = 0; j < B.cols; ++j) {
        Node sum{NodeKind::kAdd, "", {}, {}, 0, 0, 0, 0};
        for (int k = 0; k < A.cols; ++k) {
          int p = add({NodeKind::kMul, "",
                       {A.children[static_cast<std::size_t>(i * A.cols + k)],
                        B.children[static_cast<std::size_t>(k * B.cols + j)]},
                       {}, 0, 0, 0, 0});
          if (p < 0) return -1;
          sum.children.push_back(p);
        }
        int s = add(std::move(sum));
        if (s < 0) return -1;
        out.children.push_back(s);
      }
    }
    return add(std::move(out));
  }
};

}  // namespace

bool fold_matrix_arithmetic(Expr& e, int max_nodes) {
  if (e.root < 0) return false;
  const NodeKind k = e.at(e.root).kind;
  if (k != NodeKind::kAdd && k != NodeKind::kMul && k != NodeKind::kNeg) return false;
  const std::size_t before = e.nodes.size();
  Folder f(e, max_nodes);
  int m = f.fold(e.root);
  if (m < 0) {
    e.nodes.resize(before);
    return false;
  }
  e.root = m;
  return true;
}

}  // namespace lorasync::reward
