// The verifier's table-driven corpus: (prediction, reference, expected) cases written for this
// project, one group per rule of ../shared/spec/grader.md, true negatives included. Each boxed
// prediction is graded inside a sentence ("... $\boxed{PRED}$."); the raw table holds whole
// completions for the extraction rules.
#include <gtest/gtest.h>

#include <string>
#include <string_view>
#include <vector>

#include "reward/grade.h"

namespace lorasync::reward {
namespace {

struct Case {
  std::string_view pred;
  std::string_view gold;
  bool expected;
};

// Predictions that are boxed inside a sentence.
const std::vector<Case> kBoxed = {
    // --- canonical string form: spaces, spacing commands, \left/\right, $, \displaystyle ------
    {R"(42)", R"(42)", true},
    {R"( 42 )", R"(42)", true},
    {R"(\frac{1}{2})", R"(\frac {1} {2})", true},
    {R"(\dfrac{1}{2})", R"(\frac{1}{2})", true},
    {R"(\tfrac{3}{4})", R"(\frac{3}{4})", true},
    {R"(\cfrac{5}{7})", R"(\frac{5}{7})", true},
    {R"(\left( 1, 2 \right))", R"((1,2))", true},
    {R"(\left[ 0, 1 \right))", R"([0,1))", true},
    {R"(\displaystyle \frac{\pi}{4})", R"(\frac{\pi}{4})", true},
    {R"($7$)", R"(7)", true},
    {R"(\$150)", R"(150)", true},
    {R"(\$5.50)", R"(5.5)", true},
    {R"(150)", R"(\$150)", true},
    {R"(3\!\cdot\!4)", R"(12)", true},
    {R"(2\,\pi)", R"(2\pi)", true},
    {R"(2\;\pi)", R"(2\pi)", true},
    {R"(2~\pi)", R"(2\pi)", true},
    {R"(2\ \pi)", R"(2 \pi)", true},
    {R"(\frac12)", R"(\frac{1}{2})", true},
    {R"(\frac1b)", R"(\frac{1}{b})", true},
    {R"(\frac{a}b)", R"(\frac{a}{b})", true},
    {R"(\sqrt3)", R"(\sqrt{3})", true},
    {R"(2\sqrt2)", R"(2\sqrt{2})", true},
    {R"(sqrt(5))", R"(\sqrt{5})", true},
    {R"(2^(10))", R"(1024)", true},
    {R"(\frac94\pi)", R"(\frac{9\pi}{4})", true},
    {R"(\text{Evelyn})", R"(\text{Evelyn})", true},
    {R"(Evelyn)", R"(\text{Evelyn})", true},
    {R"(evelyn)", R"(\text{Evelyn})", true},
    {R"(\textbf{Wednesday})", R"(\text{Wednesday})", true},
    {R"(\mathrm{orange})", R"(\text{orange})", true},
    {R"(\text{(D)})", R"(\text{(D)})", true},
    {R"((D))", R"(\text{(D)})", true},
    {R"(D)", R"(\text{(D)})", true},
    {R"(\text{B,E})", R"(\text{B, E})", true},
    {R"(\mathbf{12})", R"(12)", true},
    {R"(5.)", R"(5)", true},
    {R"(\frac{3}{4}.)", R"(\frac{3}{4})", true},
    {R"(x = 5)", R"(5)", true},
    {R"(x=\frac{1}{2})", R"(\frac12)", true},
    {R"(n = 12)", R"(12)", true},
    {R"(k=3)", R"(3)", true},
    {R"(f(x) = 2)", R"(2)", true},
    {R"(\theta = \frac{\pi}{3})", R"(\frac{\pi}{3})", true},
    {R"(x_1 = 7)", R"(7)", true},
    {R"(1,234)", R"(1234)", true},
    {R"(1{,}234)", R"(1234)", true},
    {R"(1,\!234)", R"(1234)", true},
    {R"(1\,234)", R"(1234)", true},
    {R"(11,\! 111,\! 111,\! 100)", R"(11111111100)", true},
    {R"(7,425,000)", R"(7425000)", true},
    {R"(1 000)", R"(1000)", true},
    {R"(1{,}008{,}016)", R"(1008016)", true},
    {R"(\$23{,}000)", R"(23000)", true},
    {R"(.5)", R"(0.5)", true},
    {R"(0.5)", R"(.5)", true},
    {R"(5.000)", R"(5)", true},
    {R"(2.50)", R"(2.5)", true},
    {R"(.155)", R"(0.155)", true},
    {R"(\begin{bmatrix} 1 & 2 \\ 3 & 4 \end{bmatrix})", R"(\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix})", true},
    {R"(\left[\begin{array}{cc} 1 & 0 \\ 0 & 1 \end{array}\right])", R"(\begin{pmatrix} 1 & 0 \\ 0 & 1 \end{pmatrix})", true},
    {R"(x \neq 2)", R"(x \ne 2)", true},
    {R"(x \leq 3)", R"(x \le 3)", true},
    {R"(x \geq 3)", R"(x \ge 3)", true},
    {R"(3 \text{ and } 5)", R"(3, 5)", true},
    {R"(3 \text{ or } 5)", R"(3, 5)", true},
    {R"(-2 \text{ and } 2)", R"(-2,2)", true},
    // --- degrees and units -----------------------------------------------------------------
    {R"(30^\circ)", R"(30)", true},
    {R"(30^{\circ})", R"(30)", true},
    {R"(75)", R"(75^\circ)", true},
    {R"(111^\circ)", R"(111^{\circ})", true},
    {R"(41.8^\circ)", R"(41.8)", true},
    {R"(32 \text{ square cm})", R"(32)", true},
    {R"(32\text{ cm}^2)", R"(32)", true},
    {R"(\frac{270}{7}\text{ degrees})", R"(\frac{270}7)", true},
    {R"(10 \mbox{ cm})", R"(10)", true},
    {R"(12 \text{ inches})", R"(12)", true},
    {R"(5 \mathrm{kg})", R"(5)", true},
    {R"(4.4677 \times 10^{14} Hz)", R"(4.4677 \times 10^{14})", true},
    {R"(20 units)", R"(20)", true},
    {R"(90 degrees)", R"(90)", true},
    {R"(5 dollars)", R"(5)", true},
    // --- numbers -----------------------------------------------------------------------------
    {R"(0.5)", R"(\frac{1}{2})", true},
    {R"(\frac{1}{2})", R"(0.5)", true},
    {R"(\frac{2}{4})", R"(\frac{1}{2})", true},
    {R"(1/2)", R"(\frac{1}{2})", true},
    {R"(-\frac{10}{9})", R"(-10/9)", true},
    {R"(\frac{-10}{9})", R"(-\frac{10}{9})", true},
    {R"(-\dfrac{10}{9})", R"(\frac{10}{-9})", true},
    {R"(0.25)", R"(\frac14)", true},
    {R"(1.5)", R"(\frac{3}{2})", true},
    {R"(2.0)", R"(2)", true},
    {R"(10/2)", R"(5)", true},
    {R"(6/4)", R"(1.5)", true},
    {R"(0.333333)", R"(\frac{1}{3})", true},
    {R"(0.3333333)", R"(\frac{1}{3})", true},
    {R"(0.6666667)", R"(\frac{2}{3})", true},
    {R"(3.14159265)", R"(\pi)", true},
    {R"(1.414214)", R"(\sqrt{2})", true},
    {R"(2.718282)", R"(e)", true},
    {R"(1e11)", R"(10^{11})", true},
    {R"(3.61e-10)", R"(3.61 \times 10^{-10})", true},
    {R"(3.61e-10)", R"(3.61 \times 10^{-9})", false},
    {R"(3.21 \times 10^{13})", R"(3.21 \times 10^{13})", true},
    {R"(3.21 \cdot 10^{13})", R"(3.21 \times 10^{13})", true},
    {R"(32100000000000)", R"(3.21 \times 10^{13})", true},
    {R"(-256)", R"(-256)", true},
    {R"(- 256)", R"(-256)", true},
    {R"(+5)", R"(5)", true},
    {R"(88572)", R"(88572)", true},
    {R"(3\times 4)", R"(12)", true},
    {R"(2^{10})", R"(1024)", true},
    {R"(2^{-1})", R"(\frac{1}{2})", true},
    {R"(4^{\frac{1}{2}})", R"(2)", true},
    {R"(8^{2/3})", R"(4)", true},
    {R"(\sqrt{16})", R"(4)", true},
    {R"(\sqrt{\frac{9}{4}})", R"(\frac{3}{2})", true},
    {R"(\sqrt[3]{27})", R"(3)", true},
    {R"(\sqrt[3]{-8})", R"(-2)", true},
    {R"(5!)", R"(120)", true},
    {R"(\binom{5}{2})", R"(10)", true},
    {R"(\dbinom{6}{3})", R"(20)", true},
    {R"(\frac{10!}{8!})", R"(90)", true},
    {R"(|-3|)", R"(3)", true},
    {R"(\lfloor 3.7 \rfloor)", R"(3)", true},
    {R"(\lceil 3.2 \rceil)", R"(4)", true},
    {R"(2021 \cdot 505 \cdot 337)", R"(343943885)", true},
    {R"(100000000000000000000)", R"(10^{20})", true},
    // --- percentages ---------------------------------------------------------------------------
    {R"(28\%)", R"(28\%)", true},
    {R"(28)", R"(28\%)", true},
    {R"(28\%)", R"(28)", true},
    {R"(28\%)", R"(0.28)", true},
    {R"(0.28)", R"(28\%)", true},
    {R"(28 \%)", R"(28\%)", true},
    {R"(17.5\%)", R"(17.5%)", true},
    {R"(28 percent)", R"(28\%)", true},
    {R"(50\%)", R"(\frac{1}{2})", true},
    {R"(29\%)", R"(0.28)", false},
    {R"(0.28)", R"(28)", false},
    // --- mixed numbers -------------------------------------------------------------------------
    {R"(7 3/4)", R"(\frac{31}{4})", true},
    {R"(7\frac{3}{4})", R"(\frac{31}{4})", true},
    {R"(2 \frac{1}{2})", R"(2.5)", true},
    {R"(-1 1/2)", R"(-\frac{3}{2})", true},
    {R"(7 3/4)", R"(\frac{21}{4})", false},
    // --- base-n literals ------------------------------------------------------------------------
    {R"(1103_6)", R"(1103_6)", true},
    {R"(1103_{6})", R"(1103_6)", true},
    {R"(861_{12})", R"(861_{12})", true},
    {R"(10200_3)", R"(10200_3)", true},
    {R"(1103)", R"(1103_6)", false},
    {R"(1104_6)", R"(1103_6)", false},
    {R"(1103_7)", R"(1103_6)", false},
    // --- expressions -----------------------------------------------------------------------------
    {R"(2\sqrt{2}-2)", R"(2\sqrt{2}-2)", true},
    {R"(-2+2\sqrt{2})", R"(2\sqrt{2}-2)", true},
    {R"(\sqrt{8}-2)", R"(2\sqrt{2}-2)", true},
    {R"(\frac{\sqrt{2}}{2})", R"(\frac{1}{\sqrt{2}})", true},
    {R"(\frac{\sqrt{3}}{3})", R"(\frac{1}{\sqrt3})", true},
    {R"(\frac{189\sqrt{11}}{11})", R"(\frac{189}{\sqrt{11}})", true},
    {R"(16\sqrt{2})", R"(\sqrt{512})", true},
    {R"(100-25\pi)", R"(-25\pi+100)", true},
    {R"(25(4-\pi))", R"(100-25\pi)", true},
    {R"(10 + \frac{15}{2}\pi)", R"(10 + 7.5\pi)", true},
    {R"(\pi^2)", R"(\pi \cdot \pi)", true},
    {R"(686\pi)", R"(686 \pi)", true},
    {R"(\frac{5}{3}\pi - 2\sqrt{3})", R"(\frac{5\pi}{3}-2\sqrt3)", true},
    {R"(1+2\sqrt{3})", R"(2\sqrt{3}+1)", true},
    {R"(\frac{1+\sqrt{13}}{2})", R"(\frac{1}{2}+\frac{\sqrt{13}}{2})", true},
    {R"(22-8\sqrt{7})", R"(2(11-4\sqrt{7}))", true},
    {R"(6-5i)", R"(6 - 5i)", true},
    {R"(-5i+6)", R"(6-5i)", true},
    {R"(1+i\sqrt{3})", R"(1 + \sqrt{3} i)", true},
    {R"(i^2)", R"(-1)", true},
    {R"(e^{i\pi})", R"(-1)", true},
    {R"(\ln(e^2))", R"(2)", true},
    {R"(\log_2 8)", R"(3)", true},
    {R"(\log_{2}{32})", R"(5)", true},
    {R"(\log 100)", R"(2)", true},
    {R"(\sin\frac{\pi}{6})", R"(\frac12)", true},
    {R"(\cos(\pi))", R"(-1)", true},
    {R"(\tan\left(\frac{\pi}{4}\right))", R"(1)", true},
    {R"(\sin^2 x + \cos^2 x)", R"(1)", true},
    {R"(\cot x)", R"(\frac{\cos x}{\sin x})", true},
    {R"(\sec^2 x - \tan^2 x)", R"(1)", true},
    {R"(\arcsin(1))", R"(\frac{\pi}{2})", true},
    {R"(\sin^{-1}(1))", R"(\frac{\pi}{2})", true},
    {R"(\frac{9\pi}{20})", R"(\dfrac{9\pi}{20})", true},
    {R"(\frac{20000}{\pi})", R"(20000/\pi)", true},
    // --- free variables -------------------------------------------------------------------------
    {R"(p - q)", R"(p-q)", true},
    {R"(-q + p)", R"(p - q)", true},
    {R"(8n^2 + 4n + 1)", R"(1+4n+8n^2)", true},
    {R"(3y+1)", R"(1 + 3y)", true},
    {R"(5r^5)", R"(5 r^{5})", true},
    {R"(15x - 80)", R"(5(3x-16))", true},
    {R"((x+1)^2)", R"(x^2+2x+1)", true},
    {R"(x^2-1)", R"((x-1)(x+1))", true},
    {R"(\frac{x^2-1}{x-1})", R"(x+1)", true},
    {R"(2^{k-n})", R"(\frac{2^k}{2^n})", true},
    {R"(\frac{1}{4}n(n+1))", R"(\frac{n(n+1)}{4})", true},
    {R"(\frac{1}{4p^2})", R"(\frac{1}{4 p^{2}})", true},
    {R"(2RC+R+C)", R"(R+C+2RC)", true},
    {R"(\frac{x}{2} - \frac{1}{4} + ce^{-2x})", R"(\frac{2x-1}{4} + c e^{-2x})", true},
    {R"(x_0 \cos(\omega t) + \frac{v}{\omega}\sin(\omega t))", R"(x_{0}\cos(\omega t)+\frac{v}{\omega}\sin (\omega t))", true},
    {R"(\sqrt{x^2})", R"(|x|)", true},
    {R"(e^{\ln x})", R"(x)", true},
    {R"(a^2 b)", R"(b a^2)", true},
    {R"(\frac{a+b}{2})", R"(\frac{a}{2}+\frac{b}{2})", true},
    {R"(\lfloor\sqrt{n-1}\rfloor)", R"(\lfloor \sqrt{n-1} \rfloor)", true},
    // --- tuples, points, vectors -----------------------------------------------------------------
    {R"((1,2))", R"((1,2))", true},
    {R"((1, 2))", R"(\left(1,2\right))", true},
    {R"((3,-2,2))", R"((3, -2, 2))", true},
    {R"((\frac{1}{2}, 3))", R"((0.5, 3))", true},
    {R"(\left( 3, \frac{\pi}{2} \right))", R"((3,\frac{\pi}{2}))", true},
    {R"((4, \frac{\pi}{12}))", R"(\left( 4, \frac{\pi}{12} \right))", true},
    {R"((1,-16,-4,43))", R"((1,-16,-4,43))", true},
    {R"((2+2, 1))", R"((4,1))", true},
    {R"((1,2,3))", R"((1,2))", false},
    {R"((1,3))", R"((1,2))", false},
    // --- intervals and unions --------------------------------------------------------------------
    {R"([0,1))", R"([0,1))", true},
    {R"([0, 1))", R"(\left[0,1\right))", true},
    {R"((-\infty, 2) \cup (3, \infty))", R"((-\infty,2)\cup(3,\infty))", true},
    {R"((3, \infty) \cup (-\infty, 2))", R"((-\infty,2)\cup(3,\infty))", true},
    {R"((-7, -4] \cup (-1, 2])", R"((-1,2] \cup (-7,-4])", true},
    {R"(\left[ \frac{5}{2}, \frac{7}{2} \right))", R"([2.5, 3.5))", true},
    {R"([0, \frac{9}{8}])", R"(\left[ 0, \frac{9}{8} \right])", true},
    {R"((625, \infty))", R"((625,\infty))", true},
    {R"((-\infty,0])", R"((-\infty, 0])", true},
    {R"([-1,-\frac{1}{2}])", R"([-1,-0.5])", true},
    {R"((\frac{2}{3}, 1) \cup (7, \infty))", R"(\left( \frac{2}{3}, 1 \right) \cup (7,\infty))", true},
    {R"((-\infty,-5))", R"((-\infty, -5))", true},
    {R"([2,\infty))", R"([2,\infty])", true},
    // --- sets and lists ---------------------------------------------------------------------------
    {R"(\{1,2,3\})", R"(\{1,2,3\})", true},
    {R"(\{3,1,2\})", R"(\{1,2,3\})", true},
    {R"(\left\{ 2, 1 \right\})", R"(\{1,2\})", true},
    {R"(3, 5, 7)", R"(3, 5, 7)", true},
    {R"(7, 5, 3)", R"(3, 5, 7)", true},
    {R"(5,3)", R"(3,5)", true},
    {R"(1,i,-i)", R"(1,i,-i)", true},
    {R"(-i, i, 1)", R"(1,i,-i)", true},
    {R"(0,1,2,3,4)", R"(4,3,2,1,0)", true},
    {R"(\{1,2\})", R"(1, 2)", true},
    {R"(2, 1)", R"(\{1, 2\})", true},
    {R"(-2,-1,1,2)", R"(-1,1,-2,2)", true},
    {R"(11,19,37,73)", R"(73, 37, 19, 11)", true},
    {R"(\frac{1}{3},1,\frac{1}{9})", R"(1,\frac{1}{3},\frac{1}{9})", true},
    {R"((0,2),(0,-2),(4,23),(4,-23))", R"((4,-23),(0,2),(4,23),(0,-2))", true},
    {R"((27,20,13), (18,20,22))", R"((18,20,22),(27,20,13))", true},
    {R"(\pm 3)", R"(3,-3)", true},
    {R"(\frac{1 \pm \sqrt{5}}{2})", R"(\frac{1+\sqrt{5}}{2}, \frac{1-\sqrt{5}}{2})", true},
    {R"(2 \pm \sqrt{3})", R"(2-\sqrt3, 2+\sqrt3)", true},
    {R"(\emptyset)", R"(\varnothing)", true},
    {R"(\text{Softball, Kickball, Picnic})", R"(\text{Softball, Kickball, Picnic})", true},
    {R"(1,2,3)", R"(1,2)", false},
    {R"(\{1,2\})", R"(\{1,3\})", false},
    {R"(3,5)", R"(3)", false},
    {R"(3)", R"(3,5)", false},
    // --- matrices ---------------------------------------------------------------------------------
    {R"(\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix})", R"(\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix})", true},
    {R"(\begin{pmatrix} 0.5 & 1 \\ 3 & 4 \end{pmatrix})", R"(\begin{pmatrix} \frac12 & 1 \\ 3 & 4 \end{pmatrix})", true},
    {R"(\begin{pmatrix} 3 \\ 1 \\ -1 \end{pmatrix})", R"(\begin{pmatrix} 3 \\ 1 \\ -1 \end{pmatrix})", true},
    {R"(\begin{pmatrix} -11/15 \\ -2/3 \\ -2/15 \end{pmatrix})", R"(\begin{pmatrix} -\frac{11}{15} \\ -\frac{10}{15} \\ -\frac{2}{15} \end{pmatrix})", true},
    {R"(\begin{pmatrix} 12/5 \\ 16/5 \end{pmatrix})", R"(\begin{pmatrix} 2.4 \\ 3.2 \end{pmatrix})", true},
    {R"(\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix})", R"(\begin{pmatrix} 1 & 3 \\ 2 & 4 \end{pmatrix})", false},
    {R"(\begin{pmatrix} 1 & 2 \end{pmatrix})", R"(\begin{pmatrix} 1 \\ 2 \end{pmatrix})", false},
    {R"(\begin{pmatrix} 0 & 0 & 0 \\ 0 & 0 & 0 \\ 0 & 0 & 0 \end{pmatrix})", R"(\begin{pmatrix} 0 & 0 & 0 \\ 0 & 0 & 0 \\ 0 & 0 & 0 \end{pmatrix})", true},
    // --- relations ----------------------------------------------------------------------------------
    {R"(y = 2x+3)", R"(2x+3 = y)", true},
    {R"(y=10x-4)", R"(y = 10x - 4)", true},
    {R"(10x - y - 4 = 0)", R"(y=10x-4)", true},
    {R"(2x + z - 5 = 0)", R"(2x + z - 5 = 0)", true},
    {R"(2x + z = 5)", R"(2x + z - 5 = 0)", true},
    {R"(z = 5 - 2x)", R"(2x + z - 5 = 0)", true},
    {R"(4x + 2z - 10 = 0)", R"(2x + z - 5 = 0)", true},   // scaled (issue 17; Math-Verify agrees)
    {R"(4x + 2z - 11 = 0)", R"(2x + z - 5 = 0)", false},
    {R"(2y = 4x + 2)", R"(y = 2x + 1)", true},
    {R"(-2y \le -4x - 2)", R"(y \ge 2x + 1)", true},      // a negative factor flips the direction
    {R"(-2y \ge -4x - 2)", R"(y \ge 2x + 1)", false},
    {R"(x^2 = 4)", R"(x = 2)", false},
    {R"(\text{Final: } 12)", R"(12)", false},               // a label inside the box (Math-Verify agrees)
    {R"(Final answer: \frac{1}{2})", R"(\frac{1}{2})", false},
    {R"(Final: the smallest $k$ is 0)", R"(0)", false},    // a sentence is never a product that is 0
    {R"(x > 2)", R"(2 < x)", true},
    {R"(x \ge 2)", R"(2 \le x)", true},
    {R"(x < 3)", R"(3 > x)", true},
    {R"(x > 2)", R"((2, \infty))", true},
    {R"((2, \infty))", R"(x > 2)", true},
    {R"(x \ge 2)", R"([2, \infty))", true},
    {R"(x \le -1)", R"((-\infty, -1])", true},
    {R"(1 < x \le 3)", R"((1, 3])", true},
    {R"(-2 \le x < 5)", R"([-2, 5))", true},
    {R"(x < 2 \text{ or } x > 3)", R"((-\infty, 2) \cup (3, \infty))", true},
    {R"(x \ne 1)", R"((-\infty,1)\cup(1,\infty))", true},
    {R"(x \ge 2)", R"((2, \infty))", false},
    {R"(x > 2)", R"(x < 2)", false},
    {R"(k = n+1)", R"(k=n+1)", true},
    {R"(f(n) = 2n+1007)", R"(f(n) = 2 n+1007)", true},
    {R"(g(x)=x^2-2x+2)", R"(x^2-2x+2)", true},
    {R"(x = 3)", R"(y = 3)", false},
    {R"(x^2 + y^2 = 25)", R"(y^2 + x^2 = 25)", true},
    {R"(x' + \frac{r}{V}x - rc = 0)", R"(x' + \frac{r}{V}x - rc = 0)", true},
    // --- true negatives a sloppy normaliser would accept ---------------------------------------------
    {R"(\frac{1}{2})", R"(\frac{1}{3})", false},
    {R"(\frac{1}{3})", R"(\frac{1}{2})", false},
    {R"((2,1))", R"((1,2))", false},
    {R"((1,2))", R"((2,1))", false},
    {R"([0,1])", R"([0,1))", false},
    {R"([0,1))", R"([0,1])", false},
    {R"((0,1))", R"([0,1))", false},
    {R"((0,1])", R"((0,1))", false},
    {R"(1.2)", R"(12)", false},
    {R"(12)", R"(1.2)", false},
    {R"(2x)", R"(x^2)", false},
    {R"(x^2)", R"(2x)", false},
    {R"(2)", R"(\sqrt{2})", false},
    {R"(\sqrt{2})", R"(2)", false},
    {R"(2.5)", R"(2)", false},
    {R"(2.0000001)", R"(2)", false},
    {R"(1.9999999)", R"(2)", false},
    {R"(0.33)", R"(\frac{1}{3})", false},
    {R"(0.3333)", R"(\frac{1}{3})", false},
    {R"(3.14)", R"(\pi)", false},
    {R"(3)", R"(-3)", false},
    {R"(-\frac{1}{2})", R"(\frac{1}{2})", false},
    {R"(x+1)", R"(x-1)", false},
    {R"(x^3)", R"(x^2)", false},
    {R"(2^{10})", R"(2^{11})", false},
    {R"(\sqrt{3})", R"(\sqrt[3]{3})", false},
    {R"(\frac{\sqrt{3}}{2})", R"(\frac{\sqrt{2}}{2})", false},
    {R"(\pi)", R"(2\pi)", false},
    {R"(\frac{\pi}{3})", R"(\frac{\pi}{6})", false},
    {R"(6+5i)", R"(6-5i)", false},
    {R"(i)", R"(1)", false},
    {R"(\sin x)", R"(\cos x)", false},
    {R"(\log_2 8)", R"(2)", false},
    {R"(5!)", R"(100)", false},
    {R"(\binom{5}{2})", R"(\binom{5}{3}+1)", false},
    {R"(p+q)", R"(p-q)", false},
    {R"(x y)", R"(x+y)", false},
    {R"(1234)", R"(1,235)", false},
    {R"(12345)", R"(1234)", false},
    {R"(\text{Evelyn})", R"(\text{Briana})", false},
    {R"(\text{(C)})", R"(\text{(D)})", false},
    {R"(C)", R"(\text{(D)})", false},
    {R"(0)", R"(\emptyset)", false},
    {R"(\infty)", R"(-\infty)", false},
    {R"(10^{-24})", R"(10^{-23})", false},
    {R"(4.6 \times 10^{-24})", R"(4.6 \times 10^{-23})", false},
    {R"(100)", R"(1000)", false},
    {R"(10)", R"(10\sqrt{2})", false},
    {R"(\frac{2}{5})", R"(\frac{5}{2})", false},
    {R"(\frac{16}{5})", R"(3.3)", false},
    {R"(7/4)", R"(7 3/4)", false},
    {R"(34560)", R"(34,\!561)", false},
    {R"(0)", R"(1)", false},
    {R"(-1)", R"(1)", false},
    {R"(a)", R"(b)", false},
    {R"(2a)", R"(a+2)", false},
    {R"((x+1)^2)", R"(x^2+1)", false},
    {R"(\frac{x}{2})", R"(\frac{2}{x})", false},
    {R"(\begin{pmatrix} 1 \\ 2 \end{pmatrix})", R"(\begin{pmatrix} 2 \\ 1 \end{pmatrix})", false},
    {R"(\{1,2\})", R"(\{1,2,3\})", false},
    {R"(x \le 2)", R"(x < 2)", false},
    {R"([1,2])", R"((1,2))", false},
    {R"(2)", R"(2\%)", true},
    {R"(51\%)", R"(50\%)", false},
    // --- safety: pathological answers are refused, not hung on ----------------------------------------
    {R"(10^{10^{10}})", R"(5)", false},
    {R"(9^{9^{9^{9}}})", R"(1)", false},
    {R"(1000!)", R"(2)", false},
    {R"(x^{10^{10}})", R"(x)", false},
    {R"(\sqrt{})", R"(2)", false},
    {R"(\frac{1}{0})", R"(1)", false},
    {R"())", R"(1)", false},
    {R"(\frac{)", R"(1)", false},
};

// Whole completions for the extraction rules.
const std::vector<Case> kRaw = {
    {R"(So the answer is $\boxed{5}$.)", R"(5)", true},
    {R"(\boxed{3} is wrong, the answer is \boxed{5})", R"(5)", true},
    {R"(\boxed{3} is wrong, the answer is \boxed{5})", R"(3)", false},
    {R"(The answer is \fbox{7}.)", R"(7)", true},
    {R"(The answer is \boxed {7}.)", R"(7)", true},
    {R"(The answer is \boxed 7.)", R"(7)", true},
    {R"(The answer is \boxed 7 today)", R"(7)", true},
    {R"(The answer is $\boxed 12$)", R"(12)", true},
    {R"(Nested: \boxed{\frac{1}{\sqrt{2}}})", R"(\frac{\sqrt2}{2})", true},
    {R"(\boxed{\{1,2\}})", R"(\{1,2\})", true},
    {R"(The answer is 5.)", R"(5)", false},
    {R"(no box here, just 42)", R"(42)", false},
    {R"(<think>maybe \boxed{4}</think> The answer is \boxed{5}.)", R"(5)", true},
    {R"(<think>maybe \boxed{5}</think> The answer is \boxed{4}.)", R"(5)", false},
    {R"(<think>I think \boxed{5}</think> I am not sure.)", R"(5)", false},
    {R"(\boxed{5} and then an unclosed \boxed{6)", R"(5)", true},
    {R"(\boxed{})", R"(5)", false},
    {R"(\boxed{\text{Evelyn}})", R"(\text{Evelyn})", true},
    {R"($\boxed{x = 5}$)", R"(5)", true},
    {R"(Therefore $x=\boxed{\frac{14}{3}}$.)", R"(\frac{14}{3})", true},
    {R"(\boxed{\begin{pmatrix} 1 \\ 2 \end{pmatrix}})", R"(\begin{pmatrix} 1 \\ 2 \end{pmatrix})", true},
    {R"(The final answer is \boxed{28\%}.)", R"(28)", true},
    {R"(\boxed{1,2}\boxed{3})", R"(1,2,3)", true},
    {R"(The roots are \boxed{-2} and \boxed{1}.)", R"(1,-2)", true},
    {R"(\boxed{3} is wrong, \boxed{5})", R"(3, 5)", false},  // a retraction, not one box per part
    {R"(For part (a) we get \boxed{5}, and for part (b) \boxed{9}.)", R"(5, 9)", true},
    {R"(Part (a): \boxed{5}. Part (b): \boxed{9}.)", R"(9, 5)", true},
    {R"(Part (a): \boxed{5}. Part (b): \boxed{9}.)", R"(5, 8)", false},
    {R"(First \boxed{4}. No, wait: \boxed{5} and then \boxed{9}.)", R"(5, 9)", true},
    {R"(\boxed{\left( 3, \frac{\pi}{2} \right)})", R"(\left( 3, \frac{\pi}{2} \right))", true},
};

std::string sentence(std::string_view pred) {
  return "After simplifying, the final answer is $\\boxed{" + std::string(pred) + "}$.";
}

TEST(GradeCorpus, HasAtLeast300Cases) { EXPECT_GE(kBoxed.size() + kRaw.size(), 300u); }

TEST(GradeCorpus, BoxedPredictions) {
  int failures = 0;
  for (const Case& c : kBoxed) {
    GradeResult r = grade(sentence(c.pred), c.gold);
    if (r.correct != c.expected) {
      ++failures;
      ADD_FAILURE() << "pred '" << c.pred << "' gold '" << c.gold << "': expected "
                    << c.expected << ", got " << r.correct << " (reason " << r.reason
                    << ", extracted '" << r.extracted << "')";
    }
  }
  EXPECT_EQ(failures, 0) << "of " << kBoxed.size();
}

TEST(GradeCorpus, RawCompletions) {
  for (const Case& c : kRaw) {
    GradeResult r = grade(c.pred, c.gold);
    EXPECT_EQ(r.correct, c.expected) << "completion '" << c.pred << "' gold '" << c.gold
                                     << "' reason " << r.reason << " extracted '" << r.extracted << "'";
  }
}

TEST(GradeCorpus, ReasonsNameTheRule) {
  EXPECT_EQ(grade("\\boxed{42}", "42").reason, "string_equal");
  EXPECT_EQ(grade("\\boxed{0.5}", "\\frac12").reason, "numeric_equal");
  EXPECT_EQ(grade("\\boxed{(x+1)^2}", "x^2+2x+1").reason, "symbolic_equal");
  EXPECT_EQ(grade("\\boxed{3,1,2}", "1,2,3").reason, "set_equal");
  EXPECT_EQ(grade("\\boxed{x>2}", "(2,\\infty)").reason, "interval_equal");
  EXPECT_EQ(grade("\\boxed{y=2x+3}", "2x+3=y").reason, "relation_equal");
  EXPECT_EQ(grade("\\boxed{28\\%}", "0.28").reason, "percent_equal");
  EXPECT_EQ(grade("\\boxed{(1,2)}", "(2,1)").reason, "not_equal");
  EXPECT_EQ(grade("the answer is 5", "5").reason, "no_box");
  EXPECT_EQ(grade("\\boxed{10^{10^{10}}}", "5").reason, "too_complex");
  EXPECT_EQ(grade("\\boxed{\\frac{1}}", "5").reason, "parse_error");
}

TEST(GradeCorpus, ExtractedAnswerIsReported) {
  GradeResult r = grade("so $x = \\boxed{\\frac{1}{2}}$.", "0.5");
  EXPECT_TRUE(r.correct);
  EXPECT_EQ(r.extracted, "\\frac{1}{2}");
}

TEST(GradeCorpus, FallbackIsOptIn) {
  GradeOptions fb;
  fb.fallback = true;
  EXPECT_FALSE(grade("The answer is 12.", "12").correct);
  EXPECT_TRUE(grade("The answer is 12.", "12", fb).correct);
  EXPECT_TRUE(grade("so we get $\\frac{1}{2}$", "0.5", fb).correct);
  EXPECT_TRUE(grade("we computed 3 then 17", "17", fb).correct);
  EXPECT_FALSE(grade("we computed 17 then 3", "17", fb).correct);
  EXPECT_TRUE(grade("The final answer is $\\frac{3}{4}$. I hope it is correct.", "0.75", fb).correct);
}

TEST(GradeCorpus, ListOfReferences) {
  std::vector<std::string> refs = {"4.4677 \\times 10^{14} Hz\n", "4.4677 \\times 10^{14}\n"};
  EXPECT_TRUE(grade("\\boxed{4.4677 \\times 10^{14}}", refs).correct);
  std::vector<std::string> refs2 = {"\\arcsin(1.3\\sin(\\theta_w))", "\\arcsin(1.3\\sin\\theta_w)"};
  EXPECT_TRUE(grade("\\boxed{\\arcsin(1.3 \\sin \\theta_w)}", refs2).correct);
  EXPECT_FALSE(grade("\\boxed{5}", std::vector<std::string>{"4", "6"}).correct);
  EXPECT_FALSE(grade("\\boxed{5}", std::vector<std::string>{}).correct);
}

TEST(GradeCorpus, BareAnswers) {
  EXPECT_TRUE(grade_answer("$\\frac{1}{2}$", "0.5").correct);
  EXPECT_TRUE(grade_answer("\\frac{1}{2}", "$0.5$").correct);
  EXPECT_TRUE(grade_answer("Answer $ \\frac{1}{2} \\$ = \\frac{10}{9} $", "10/9").correct);
  EXPECT_TRUE(grade_answer("\\$32,\\!348", "32348").correct);
  EXPECT_FALSE(grade_answer("12", "1.2").correct);
}

TEST(GradeCorpus, ReferenceEquationKeepsPredictionLhs) {
  // "x = v" loses its left side only when the reference is not an equation.
  EXPECT_TRUE(grade("\\boxed{y = 3}", "3").correct);
  EXPECT_TRUE(grade("\\boxed{y = 3}", "y=3").correct);
  EXPECT_FALSE(grade("\\boxed{x = 3}", "y=3").correct);
  EXPECT_TRUE(grade("\\boxed{3}", "k=3").correct);
}

}  // namespace
}  // namespace lorasync::reward
