// apps/lorasync/cmd_train.cpp: placeholder registration (being written).
#include "commands.h"

#include <cstdio>

namespace lorasync::cli {

void register_train(CLI::App& root, Registry& reg) {
  auto* sub = root.add_subcommand("train", "(not yet available)");
  reg.add(sub, [] {
    std::fprintf(stderr, "lorasync train: not yet available\n");
    return 2;
  });
}

}  // namespace lorasync::cli
