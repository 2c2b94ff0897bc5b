// tests/util/run_command.h: run the lorasync binary (or any command) and capture its output, for
// black-box tests. stdout and stderr are captured separately through temp files.
#pragma once

#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "util/files.h"

namespace lorasync::testing {

struct CommandResult {
  int exit_code = -1;
  std::string out;  // stdout
  std::string err;  // stderr
};

inline std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) {
    if (c == '\'') q += "'\\''";
    else q += c;
  }
  return q + "'";
}

// Runs `cmd` through /bin/sh with optional stdin text.
inline CommandResult run_command(const std::string& cmd, const std::string& stdin_text = "") {
  TempDir tmp("lorasync-cmd");
  auto in = tmp.path() / "in", out = tmp.path() / "out", err = tmp.path() / "err";
  { std::ofstream(in) << stdin_text; }
  std::string full = cmd + " <" + shell_quote(in.string()) + " >" + shell_quote(out.string()) +
                     " 2>" + shell_quote(err.string());
  int status = std::system(full.c_str());
  CommandResult r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  auto slurp = [](const fs::path& p) {
    std::ifstream f(p);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  };
  r.out = slurp(out);
  r.err = slurp(err);
  return r;
}

#ifdef LORASYNC_BINARY
inline CommandResult run_lorasync(const std::string& args, const std::string& stdin_text = "") {
  return run_command(shell_quote(LORASYNC_BINARY) + " " + args, stdin_text);
}
#endif

}  // namespace lorasync::testing
