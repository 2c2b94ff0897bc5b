#include "front.h"

#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace lorasync::front {

namespace {

constexpr std::array<std::string_view, 6> kCommands = {"proxy", "grade", "tokenize", "train-tokenizer", "report",
                                                       "stub-replica"};
constexpr std::array<std::string_view, 3> kBenches = {"proxy", "grade", "tokenizer"};

template <std::size_t N>
bool contains(const std::array<std::string_view, N>& set, std::string_view s) {
  for (auto x : set)
    if (x == s) return true;
  return false;
}

std::string engine_path() {
  if (const char* e = std::getenv("LORASYNC_ENGINE"); e != nullptr && *e != 0) return e;
  std::vector<char> self(4096);
  const ssize_t n = ::readlink("/proc/self/exe", self.data(), self.size() - 1);
  if (n <= 0) return "lorasync-engine";
  std::string dir(self.data(), static_cast<std::size_t>(n));
  const auto slash = dir.rfind('/');
  dir = slash == std::string::npos ? std::string(".") : dir.substr(0, slash);
  return dir + "/lorasync-engine";
}

}  // namespace

bool runs_here(int argc, char** argv) {
  std::vector<std::string_view> words;  // the command and the word after it
  bool version = false, help = false;
  for (int i = 1; i < argc && words.size() < 2; ++i) {
    const std::string_view a = argv[i];
    if (a == "--log-level") {
      ++i;  // its value
      continue;
    }
    if (a.starts_with("--log-level=")) continue;
    if (a.starts_with("-")) {
      if (words.empty()) {
        version |= a == "--version";
        help |= a == "-h" || a == "--help";
      }
      continue;
    }
    words.push_back(a);
  }
  if (words.empty()) return version && !help;
  if (contains(kCommands, words[0])) return true;
  return words[0] == "bench" && words.size() == 2 && contains(kBenches, words[1]);
}

int exec_engine(int argc, char** argv) {
  (void)argc;
  const std::string engine = engine_path();
  ::execv(engine.c_str(), argv);
  const int err = errno;
  std::fprintf(stderr,
               "lorasync: error: this command runs in lorasync-engine (the executable with libtorch), which could "
               "not be started from %s: %s. Build it beside lorasync (cmake --build --preset release --target "
               "lorasync-engine) or set LORASYNC_ENGINE to its path.\n",
               engine.c_str(), std::strerror(err));
  return 1;
}

}  // namespace lorasync::front
