#include "proc_stats.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace lorasync::cli {

std::pair<double, double> proc_user_sys_ticks(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string s((std::istreambuf_iterator<char>(f)), {});
  const auto rp = s.rfind(')');
  if (rp == std::string::npos || rp + 2 > s.size()) return {0, 0};
  std::istringstream is(s.substr(rp + 2));
  std::string tok;
  std::vector<std::string> v;
  while (is >> tok) v.push_back(tok);
  if (v.size() < 13) return {0, 0};
  return {std::stod(v[11]), std::stod(v[12])};
}

double proc_cpu_s(pid_t pid) {
  const std::string task_dir = "/proc/" + std::to_string(pid) + "/task";
  double total = 0;
  bool any = false;
  std::error_code ec;
  for (const auto& t : std::filesystem::directory_iterator(task_dir, ec)) {
    std::ifstream f(t.path() / "schedstat");
    double ns = 0;
    if (f >> ns) {
      total += ns / 1e9;
      any = true;
    }
  }
  if (any) return total;
  const auto [user, sys] = proc_user_sys_ticks(pid);
  return (user + sys) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

double proc_status_mib(pid_t pid, std::string_view field) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  const std::string key = std::string(field) + ":";
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(key, 0) == 0) return std::stod(line.substr(key.size())) / 1024.0;
  return 0;
}

}  // namespace lorasync::cli
