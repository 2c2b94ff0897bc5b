// apps/lorasync/cmd_eval.cpp: placeholder registration (being written).
#include "commands.h"

#include <cstdio>

namespace lorasync::cli {

void register_eval(CLI::App& root, Registry& reg) {
  auto* sub = root.add_subcommand("eval", "(not yet available)");
  reg.add(sub, [] {
    std::fprintf(stderr, "lorasync eval: not yet available\n");
    return 2;
  });
}

}  // namespace lorasync::cli
