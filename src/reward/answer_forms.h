// reward/answer_forms.h: ways of writing an answer that the canonical form rewrites or that a
// comparison retries with (issue 51: Math-Verify's own test cases). Each is a pure string rule on
// a normalised answer (normalize.h's `clean`); callers cap the length.
//
//   decimal comma     "1000,99", "0,111", "12.500,25" (one comma between digits that is not a
//                     thousands group) read as a decimal number; only retried against a single
//                     number, so a list "3,5" stays a list otherwise.
//   approximation     a trailing "\approx v" after an answer is commentary: "x = 1/3 \approx 0.33"
//                     is "x = 1/3"; after a bare name it gives the value: "x \approx 11" is "x = 11".
//   assignment groups "p=5,q=2;p=7,q=2" (solutions separated by ';', each naming the same
//                     variables) is the list of tuples "(5,2),(7,2)".
//   glued words       "(11,7)or(7,11)" and "(1,2)and(3,4)": the words between brackets separate a
//                     list.
// Thread-safety: pure functions.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace lorasync::reward {

// The decimal-comma reading of a whole answer ("1000,99" -> "1000.99", "12.500,25" ->
// "12500.25"), or nullopt when the answer is not one number written with a decimal comma.
std::optional<std::string> decimal_comma_reading(std::string_view clean);

// True when `clean` is one number literal without a comma ("-3", "2.74", ".5").
bool is_plain_number(std::string_view clean);

// Removes a top-level "\approx ..." tail that follows an answer.
void drop_approximation(std::string& s);

// "p=5,q=2;p=7,q=2" -> "(5,2),(7,2)"; other answers are left alone.
void join_assignment_groups(std::string& s);

// ")or(" / ")and(" (and with "]") -> "), (".
void split_glued_words(std::string& s);

}  // namespace lorasync::reward
