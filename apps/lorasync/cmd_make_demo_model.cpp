// apps/lorasync/cmd_make_demo_model.cpp: placeholder registration (being written).
#include "commands.h"

#include <cstdio>

namespace lorasync::cli {

void register_make_demo_model(CLI::App& root, Registry& reg) {
  auto* sub = root.add_subcommand("make-demo-model", "(not yet available)");
  reg.add(sub, [] {
    std::fprintf(stderr, "lorasync make-demo-model: not yet available\n");
    return 2;
  });
}

}  // namespace lorasync::cli
