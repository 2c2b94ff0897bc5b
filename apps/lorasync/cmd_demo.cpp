// apps/lorasync/cmd_demo.cpp: placeholder registration (being written).
#include "commands.h"

#include <cstdio>

namespace lorasync::cli {

void register_demo(CLI::App& root, Registry& reg) {
  auto* sub = root.add_subcommand("demo", "(not yet available)");
  reg.add(sub, [] {
    std::fprintf(stderr, "lorasync demo: not yet available\n");
    return 2;
  });
}

}  // namespace lorasync::cli
