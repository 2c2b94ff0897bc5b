// The answer forms of issue 51 (Math-Verify's own test cases): decimal commas, prose around a bare
// answer, final-answer statements, \approx tails, chained equalities, assignment groups, references
// with several boxes or in prose, and lists with a repeated element. True negatives included.
#include <gtest/gtest.h>

#include <string>

#include "reward/answer_forms.h"
#include "reward/extract.h"
#include "reward/grade.h"

namespace lorasync::reward {
namespace {

TEST(AnswerForms, DecimalCommaReading) {
  EXPECT_EQ(decimal_comma_reading("1000,99").value(), "1000.99");
  EXPECT_EQ(decimal_comma_reading("0,111").value(), "0.111");
  EXPECT_EQ(decimal_comma_reading("-3,5").value(), "-3.5");
  EXPECT_EQ(decimal_comma_reading("12.500,25").value(), "12500.25");
  EXPECT_FALSE(decimal_comma_reading("1,2,3"));
  EXPECT_FALSE(decimal_comma_reading("12.50,25"));  // dots group in threes
  EXPECT_FALSE(decimal_comma_reading("(1,2)"));
  EXPECT_FALSE(decimal_comma_reading("12"));
}

TEST(AnswerForms, DecimalCommaAgainstOneNumber) {
  EXPECT_TRUE(grade_answer("1000,99", "1000.99").correct);
  EXPECT_TRUE(grade_answer("1.22", "1,22").correct);
  EXPECT_TRUE(grade_answer("0.111", "0,111").correct);
  EXPECT_TRUE(grade("Thus \\boxed{3,75}", "3.75").correct);
  EXPECT_TRUE(grade("Thus \\boxed{12.500,25}", "12500.25").correct);
  EXPECT_FALSE(grade("Thus \\boxed{3,751}", "3.75").correct);
  EXPECT_FALSE(grade("Thus \\boxed{3,5}", "3").correct);
  // Against a list or a tuple the comma stays a separator.
  EXPECT_TRUE(grade("\\boxed{3,5}", "3, 5").correct);
  EXPECT_FALSE(grade("\\boxed{3,5}", "(3.5, 1)").correct);
  // Thousands groups are still thousands ("0,111" is not).
  EXPECT_TRUE(grade("\\boxed{7,425,000}", "7425000").correct);
  EXPECT_FALSE(grade_answer("0,111", "111").correct);
}

TEST(AnswerForms, ProseAroundABareAnswer) {
  EXPECT_TRUE(grade_answer("the number is not 10 which is 1,000.99€", "1000.99").correct);
  EXPECT_TRUE(grade_answer("not it's not 10 it's 1,000.99m²", "1000.99").correct);
  EXPECT_TRUE(grade_answer("Soucis : 2,74 $ a..", "2.74").correct);
  EXPECT_FALSE(grade_answer("AZYUK2A", "2").correct);
  EXPECT_FALSE(grade_answer("the number is 10 which is 1,000.99", "10").correct);
  // A sentence after "Final Answer:" gives the number or math it ends with.
  EXPECT_TRUE(grade_answer("Final Answer: The largest $n$ is 34.", "34").correct);
  EXPECT_TRUE(grade_answer("Final Answer: Jane started growing Sphere 3 hours ago. I hope it is correct.", "3").correct);
  EXPECT_FALSE(grade_answer("Final Answer: The largest $n$ is 35.", "34").correct);
  // The last math span or number, whichever comes later.
  EXPECT_TRUE(grade_answer("so $d = \\frac{90}{n}$ works, and there are 12 sequences in all.", "12").correct);
  EXPECT_EQ(extract_fallback("we get $x = 2$ and then 4.5 hours").value(), "4.5");
  EXPECT_EQ(extract_fallback("we get 4.5 and then $x = 2$").value(), "x = 2");
  // Units between answers are no sentence; neither is a short reference.
  EXPECT_FALSE(grade_answer("10 cm and 20 cm", "20").correct);
  EXPECT_FALSE(grade("\\boxed{20}", "10 cm and 20 cm").correct);
  EXPECT_TRUE(grade_answer("10 and 20", "10, 20").correct);
}

TEST(AnswerForms, FinalAnswerStatementAfterTheLastBox) {
  const char* text = "the interest is $\\boxed{255}$, so she has $10,455. Final Answer: The final answer "
                     "is $10,455$. I hope it is correct.";
  EXPECT_TRUE(grade_answer(text, "10455").correct);
  EXPECT_FALSE(grade_answer(text, "255").correct);
  EXPECT_TRUE(grade_answer("\\boxed{12 $ and $13} Final Answer: The final answer is \\\"$12 $ and $13 $\\\".",
                           "12, 13").correct);
  // Training grades keep the last box.
  EXPECT_TRUE(grade(text, "255").correct);
}

TEST(AnswerForms, Approximations) {
  EXPECT_TRUE(grade_answer("$x=1/3\\approx1.3$", "1/3").correct);
  EXPECT_TRUE(grade_answer("$x = 5+5+1 = 1/3 \\approx 11$", "$x = 1/3$").correct);
  EXPECT_TRUE(grade_answer("$x\\approx11$", "11").correct);
  EXPECT_FALSE(grade_answer("$x=1/3\\approx1.3$", "1.3").correct);
  EXPECT_FALSE(grade_answer("$x = 5+5+1 = 1/4$", "$x = 1/3$").correct);
}

TEST(AnswerForms, ChainedEqualityInTheReference) {
  EXPECT_TRUE(grade_answer("$0$", "$1 = \\zzz = x = 0$").correct);
  EXPECT_FALSE(grade_answer("$1$", "$1 = \\zzz = x = 0$").correct);
  // An assignment list is not a chain.
  EXPECT_TRUE(grade_answer("$\\boxed{4, 5}$", "$AB=4,CD=5$").correct);
  EXPECT_FALSE(grade_answer("$\\boxed{5}$", "$AB=4,CD=5$").correct);
}

TEST(AnswerForms, AssignmentGroupsAndGluedWords) {
  std::string s = "p=5,q=2;p=7,q=2";
  join_assignment_groups(s);
  EXPECT_EQ(s, "(5,2),(7,2)");
  std::string t = "p=5,q=2;r=7,q=2";  // different names: left alone
  join_assignment_groups(t);
  EXPECT_EQ(t, "p=5,q=2;r=7,q=2");
  EXPECT_TRUE(grade_answer("$(5,2),(7,2)$", "$p=5,q=2;p=7,q=2$").correct);
  EXPECT_FALSE(grade_answer("$(5,2),(7,3)$", "$p=5,q=2;p=7,q=2$").correct);
  EXPECT_TRUE(grade_answer("$\\boxed{(7,11),\\ (11,7)}$", "$(11,7)or(7,11)$").correct);
  EXPECT_FALSE(grade_answer("$\\boxed{(7,11)}$", "$(11,7)or(7,11)$").correct);
}

TEST(AnswerForms, InequalityInAnAbsoluteValue) {
  const char* gold = "$1\\leq|z|\\leq \\frac{3}{2}$";
  EXPECT_TRUE(grade_answer("$z \\in \\left[-\\frac{3}{2}, -1\\right] \\cup \\left[1, \\frac{3}{2}\\right]$", gold).correct);
  EXPECT_TRUE(grade_answer("$[-1.5, -1] \\cup [1, 1.5]$", gold).correct);
  EXPECT_FALSE(grade_answer("$[1, \\frac{3}{2}]$", gold).correct);  // before: the middle was taken for x
  EXPECT_FALSE(grade_answer("$(-\\frac{3}{2}, -1] \\cup [1, \\frac{3}{2}]$", gold).correct);
  EXPECT_TRUE(grade_answer("$(-2, -1) \\cup (1, 2)$", "$1 < |x| < 2$").correct);
  EXPECT_TRUE(grade_answer("$(0,1)$", "$0<f(x)<1$").correct);  // a range
}

TEST(AnswerForms, MatrixArithmetic) {
  const char* a = "\\begin{pmatrix}1 & 2 \\\\ 3 & 4\\end{pmatrix}";
  const char* b = "\\begin{pmatrix}5 & 6 \\\\ 7 & 8\\end{pmatrix}";
  const std::string sum = std::string("The sum is $") + a + " + " + b + "$";
  EXPECT_TRUE(grade_answer(sum, "$\\begin{pmatrix}6 & 8 \\\\ 10 & 12\\end{pmatrix}$").correct);
  EXPECT_FALSE(grade_answer(sum, "$\\begin{pmatrix}6 & 8 \\\\ 10 & 13\\end{pmatrix}$").correct);
  const std::string prod = std::string("$") + a + " " + b + "$";
  EXPECT_TRUE(grade_answer(prod, "$\\begin{pmatrix}19 & 22 \\\\ 43 & 50\\end{pmatrix}$").correct);
  EXPECT_FALSE(grade_answer(std::string("$") + b + " " + a + "$",
                            "$\\begin{pmatrix}19 & 22 \\\\ 43 & 50\\end{pmatrix}$").correct);  // BA != AB
  EXPECT_TRUE(grade_answer(std::string("$2") + a + " - " + a + "$", std::string("$") + a + "$").correct);
  // Shapes that do not agree stay unevaluated.
  EXPECT_FALSE(grade_answer("$\\begin{pmatrix}1 & 2\\end{pmatrix} + \\begin{pmatrix}1 \\\\ 2\\end{pmatrix}$",
                            "$\\begin{pmatrix}2 & 4\\end{pmatrix}$").correct);
}

TEST(AnswerForms, RepeatedListElements) {
  EXPECT_TRUE(grade_answer("$\\boxed{(3,37,3,13), (3,17,3,7), (3,17,3,7)}$", "$(3,37,3,13),(3,17,3,7)$").correct);
  EXPECT_TRUE(grade("\\boxed{1, 2, 2}", "1, 2").correct);
  EXPECT_FALSE(grade("\\boxed{1, 2, 3}", "1, 2").correct);
  EXPECT_FALSE(grade("\\boxed{1, 1}", "1, 2").correct);
}

TEST(AnswerForms, ReferenceWithSeveralBoxesOrInProse) {
  EXPECT_TRUE(grade_answer("$\\boxed{1,2}$", "\\boxed{1} papers and \\boxed{2} bins").correct);
  EXPECT_FALSE(grade_answer("$\\boxed{1,2}$", "\\boxed{1} no no no no no \\boxed{2}").correct);
  EXPECT_TRUE(grade_answer("$\\boxed{2}$", "\\boxed{1} no no no no no \\boxed{2}").correct);
  // A box repeated in a reference counts once.
  EXPECT_TRUE(grade_answer("$004$", "so \\boxed{004} is the answer.\n\n**Final Answer**\n\\boxed{004}").correct);
  const char* prose = "After Monday its value is $90$, and the loss is $100 \\% - 72 \\%=28 \\%$. Final Answer: "
                      "The final answer is $28 \\%$. I hope it is correct. Note: this was checked twice.";
  EXPECT_TRUE(grade_answer("a total loss of $\\boxed{28\\%}$.", prose).correct);
  EXPECT_FALSE(grade_answer("a total loss of $\\boxed{72\\%}$.", prose).correct);
  // A sentence that states no answer is kept whole (OlympiadBench references).
  const char* olympiad = "$f(x)=a x+b$, where $b$ is an arbitrary integer, and $a$ is an arbitrary positive "
                         "integer with $\\mho(a)=0$";
  EXPECT_TRUE(grade(std::string("The answer is $\\boxed{") + olympiad + "}$.", olympiad).correct);
  EXPECT_FALSE(grade("$\\boxed{\\mho(a)=0}$", olympiad).correct);
}

TEST(AnswerForms, OneBoxPerPartInABareAnswer) {
  EXPECT_TRUE(grade_answer("$$\\boxed{(3, 3)} \\text{ for part (a) and } \\boxed{(1, 1)}$$", "$$(3, 3), (1, 1)$$").correct);
  EXPECT_TRUE(grade_answer("\\($y_1 = \\boxed{-2(x - 1)^2 + 5} \\) and \\( y_2 = \\boxed{3(x + 2)^2 - 2} \\)",
                           "$y_{1}=-2 x^{2}+4 x+3, y_{2}=3 x^{2}+12 x+10$").correct);
  EXPECT_FALSE(grade_answer("$$\\boxed{(3, 3)} \\text{ is wrong, so } \\boxed{(1, 1)}$$", "$$(3, 3), (1, 1)$$").correct);
}

}  // namespace
}  // namespace lorasync::reward
