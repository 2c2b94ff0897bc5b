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

constexpr const char* kViaFront = "LORASYNC_VIA_FRONT";

constexpr std::array<std::string_view, 6> kCommands = {"proxy", "grade", "tokenize", "train-tokenizer", "report",
                                                       "stub-replica"};
constexpr std::array<std::string_view, 4> kBenches = {"proxy", "grade", "tokenizer", "startup"};

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
  std::vector<std::string_view> words;  // the command: one word, or "bench" and the bench's name
  bool version = false, help = false;    // flags seen before the command was complete
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == "--log-level") {
      ++i;  // its value, whatever it looks like (as CLI11 takes it)
      continue;
    }
    if (a.starts_with("--log-level=")) continue;
    if (a.starts_with("-")) {
      version |= words.empty() && a == "--version";
      help |= a == "-h" || a == "--help";
      continue;
    }
    words.push_back(a);
    if (words[0] != "bench" || words.size() == 2) break;
  }
  // Help before the command is named goes to the engine, whose help lists every command.
  if (words.empty()) return version && !help;
  if (help) return false;
  if (contains(kCommands, words[0])) return true;
  return words[0] == "bench" && words.size() == 2 && contains(kBenches, words[1]);
}

void engine_started() { ::unsetenv(kViaFront); }

int exec_engine(int argc, char** argv) {
  (void)argc;
  const std::string engine = engine_path();
  // The engine clears this marker when it starts: a front that finds it set was exec'd as the
  // engine (LORASYNC_ENGINE naming a front, or a front copied to that name) and stops here rather
  // than exec itself forever.
  if (const char* m = std::getenv(kViaFront); m != nullptr && *m != 0) {
    std::fprintf(stderr,
                 "lorasync: error: this command runs in lorasync-engine, but %s started this front executable "
                 "in its place: LORASYNC_ENGINE, or lorasync-engine beside lorasync, must be the engine.\n",
                 engine.c_str());
    return 1;
  }
  ::setenv(kViaFront, "1", 1);
  ::execv(engine.c_str(), argv);
  const int err = errno;
  ::unsetenv(kViaFront);
  std::fprintf(stderr,
               "lorasync: error: this command runs in lorasync-engine (the executable with libtorch), which could "
               "not be started from %s: %s. Build it beside lorasync (cmake --build --preset release --target "
               "lorasync-engine) or set LORASYNC_ENGINE to its path.\n",
               engine.c_str(), std::strerror(err));
  return 1;
}

}  // namespace lorasync::front
