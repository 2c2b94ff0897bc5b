// apps/lorasync/cmd_report.cpp: placeholder registration (being written).
#include "commands.h"

#include <cstdio>

namespace lorasync::cli {

void register_report(CLI::App& root, Registry& reg) {
  auto* sub = root.add_subcommand("report", "(not yet available)");
  reg.add(sub, [] {
    std::fprintf(stderr, "lorasync report: not yet available\n");
    return 2;
  });
}

}  // namespace lorasync::cli
