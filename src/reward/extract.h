// reward/extract.h: where the answer is in a completion.
//
// Rules (grader spec, "Extraction"):
//   - Only the text after the last "</think>" counts when the completion contains one.
//   - The answer is the content of the LAST \boxed{...} or \fbox{...}, found by brace matching.
//     "\boxed {x}" (spaces before the brace) and "\boxed 5" (one token without braces: up to the
//     next whitespace or '$') are accepted. An unclosed last box is ignored and the previous
//     complete box is used. Boxes separated only by separators (",", ";", "and", "or", "$",
//     \quad, \text{and}) form one list answer: "\boxed{-2} and \boxed{1}" -> "-2, 1" (as
//     Math-Verify reads them). When the reference lists k >= 2 parts ("5, 9") and the last box
//     alone does not match, the last k boxes anywhere in the answer part are read as that list
//     ("(a) \boxed{5} ... (b) \boxed{9}"), as Math-Verify does.
//   - Fallback (evaluation only, off by default): "the answer is X" / "final answer is X" (up to
//     the end of the sentence), else the last math span ($...$, $$...$$, \(...\), \[...\]), else
//     the last number.
// Work is linear in the input; the caller caps the input length.
// Thread-safety: all functions are pure and thread-safe.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace lorasync::reward {

// The text after the last "</think>", or the whole text when there is none.
std::string_view after_think(std::string_view text);

// Content of the last complete \boxed{...}/\fbox{...}; nullopt when there is none.
std::optional<std::string> extract_last_boxed(std::string_view text);

// The contents of the last `count` complete boxes, in reading order (fewer when there are fewer);
// `first_start`, when given, receives the offset where the first of them begins. Used when the
// reference lists several parts and the completion boxes each part on its own.
std::vector<std::string> extract_last_boxes(std::string_view text, std::size_t count,
                                            std::size_t* first_start = nullptr);

// The last `count` complete boxes with their offsets, in reading order.
struct BoxSpan {
  std::size_t start = 0, end = 0;  // [start, end) of "\boxed{...}"
  std::string content;
};
std::vector<BoxSpan> last_box_spans(std::string_view text, std::size_t count);

// The evaluation-only fallback rules, in order; nullopt when nothing matches. After "answer is" /
// "answer:", a sentence ("The volume of $V$ is 120") gives the math span or number it ends with;
// without that anchor, the last math span or the last number, whichever ends later.
std::optional<std::string> extract_fallback(std::string_view text);

// The answer after the last "answer is" / "answer:" (rest of the sentence; a sentence there gives
// the math or number it ends with); nullopt when there is no such statement.
std::optional<std::string> answer_statement(std::string_view text);

// The later of the last math span and the last number of `text`; nullopt when there is neither.
std::optional<std::string> last_math_or_number(std::string_view text);

// Words of prose in `text`: runs of `min_letters`+ letters outside math ($...$), braces and command
// names.
std::size_t prose_words(std::string_view text, std::size_t min_letters = 2);

// A sentence rather than an answer: three words or more, two of them of 3+ letters ("the number
// is 10", "not it's 5"; not "10 cm and 20 cm").
bool is_sentence(std::string_view text);

// "Final Answer: The final answer is $10,455$" written after the last box: that answer (a box
// for an intermediate result came before it); nullopt when there is no such statement.
std::optional<std::string> answer_after_last_box(std::string_view text);

// Strips one pair of enclosing math delimiters ($..$, $$..$$, \(..\), \[..\]) and outer spaces.
std::string strip_math_delimiters(std::string_view s);

}  // namespace lorasync::reward
