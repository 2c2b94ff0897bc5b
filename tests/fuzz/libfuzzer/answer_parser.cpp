// libFuzzer: the maths verifier on model output (reward/grade.h). Input: completion, then a NUL,
// then the reference. Grading never throws, never crashes, stays within its step limits (a slow
// input is a libFuzzer timeout) and is deterministic. (Not reflexive for arbitrary text: the
// prediction side extracts an answer from prose, the reference side does not.)
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "reward/grade.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  const auto nul = in.find('\0');
  const std::string_view completion = in.substr(0, nul);
  const std::string_view reference = nul == std::string_view::npos ? std::string_view("1") : in.substr(nul + 1);
  auto a = lorasync::reward::grade(completion, reference);
  auto b = lorasync::reward::grade(completion, reference);
  if (a.correct != b.correct) std::abort();  // not deterministic
  (void)lorasync::reward::grade_answer(reference, completion);
  return 0;
}
