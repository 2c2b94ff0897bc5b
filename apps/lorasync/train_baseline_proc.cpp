#include "train_baseline_proc.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>

#include "util/error.h"

extern char** environ;

namespace lorasync::cli {

namespace {

constexpr std::uint64_t kFnvOffset = 0xcbf29ce484222325ULL;
constexpr std::uint64_t kFnvPrime = 0x100000001b3ULL;

struct Fnv {
  std::uint64_t h = kFnvOffset;
  void mix(std::uint64_t v) { h = (h ^ v) * kFnvPrime; }
  void mix_all(const std::vector<std::int64_t>& ids) {
    for (auto t : ids) mix(static_cast<std::uint64_t>(t));
  }
};

[[noreturn]] void fail(const std::string& what) { throw lorasync::Error(ErrorKind::kInternal, what); }

}  // namespace

std::string rows_checksum(const TrainRows& rows) {
  Fnv f;
  f.mix(rows.size());
  for (const auto& row : rows) {
    f.mix(row.size());
    for (const auto& s : row) {
      f.mix(s.prompt.size());
      f.mix(s.completion.size());
      f.mix_all(s.prompt);
      f.mix_all(s.completion);
    }
  }
  return fmt::format("{:016x}", f.h);
}

std::pair<std::int64_t, std::int64_t> rows_token_counts(const TrainRows& rows) {
  std::int64_t tokens = 0, completion = 0;
  for (const auto& row : rows)
    for (const auto& s : row) {
      tokens += static_cast<std::int64_t>(s.prompt.size() + s.completion.size());
      completion += static_cast<std::int64_t>(s.completion.size());
    }
  return {tokens, completion};
}

void write_rows_file(const fs::path& path, const TrainRows& rows, double denominator) {
  const auto [tokens, completion] = rows_token_counts(rows);
  nlohmann::json js = {{"denominator", denominator},
                       {"checksum", rows_checksum(rows)},
                       {"tokens_per_step", tokens},
                       {"completion_tokens_per_step", completion},
                       {"rows", nlohmann::json::array()}};
  for (const auto& row : rows) {
    auto r = nlohmann::json::array();
    for (const auto& s : row) r.push_back({{"prompt", s.prompt}, {"completion", s.completion}});
    js["rows"].push_back(std::move(r));
  }
  write_file_durable(path, js.dump());
}

const std::vector<std::string>& baseline_malloc_names() {
  static const std::vector<std::string> names = {"default", "glibc-tuned", "glibc-nommap", "mimalloc"};
  return names;
}

std::vector<std::string> baseline_malloc_env(const std::string& name) {
  if (name == "default") return {};
  if (name == "glibc-tuned")
    return {"MALLOC_MMAP_THRESHOLD_=33554432", "MALLOC_TRIM_THRESHOLD_=1073741824", "MALLOC_TOP_PAD_=67108864"};
  if (name == "glibc-nommap")
    return {"MALLOC_MMAP_MAX_=0", "MALLOC_TRIM_THRESHOLD_=68719476736", "MALLOC_TOP_PAD_=67108864"};
  if (name == "mimalloc")
    return {"LD_PRELOAD=libmimalloc.so.2", "MIMALLOC_ALLOW_DECOMMIT=0", "MIMALLOC_RESET_DELAY=1000000",
            "MIMALLOC_SEGMENT_DECOMMIT_DELAY=1000000", "MIMALLOC_PURGE_DELAY=-1"};
  throw_invalid("--baseline-malloc must be one of default, glibc-tuned, glibc-nommap, mimalloc; got '{}'", name);
}

BaselineProcess::BaselineProcess(const std::vector<std::string>& argv, const std::vector<std::string>& extra_env) {
  // Everything the child needs is built before fork (no allocation between fork and exec).
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string kv = *e;
    const auto key = kv.substr(0, kv.find('=') + 1);
    bool overridden = false;
    for (const auto& x : extra_env) overridden = overridden || x.rfind(key, 0) == 0;
    if (!overridden) env.push_back(kv);
  }
  env.insert(env.end(), extra_env.begin(), extra_env.end());
  std::vector<char*> envp, args;
  for (auto& s : env) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> argv_copy = argv;
  for (auto& s : argv_copy) args.push_back(s.data());
  args.push_back(nullptr);
  int in[2], out[2];
  if (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0) fail("pipe: " + std::string(std::strerror(errno)));
  pid_ = fork();
  if (pid_ < 0) fail("fork: " + std::string(std::strerror(errno)));
  if (pid_ == 0) {
    dup2(in[0], 0);
    dup2(out[1], 1);
    execve(args[0], args.data(), envp.data());
    _exit(127);
  }
  close(in[0]);
  close(out[1]);
  to_ = fdopen(in[1], "w");
  from_ = fdopen(out[0], "r");
}

BaselineProcess::~BaselineProcess() {
  if (to_ != nullptr) std::fclose(to_);
  if (from_ != nullptr) std::fclose(from_);
  if (pid_ > 0) {
    int st = 0;
    if (waitpid(pid_, &st, WNOHANG) == 0) {
      kill(pid_, SIGTERM);
      waitpid(pid_, &st, 0);
    }
  }
}

nlohmann::json BaselineProcess::read_json() {
  std::string line;
  for (;;) {
    line.clear();
    int ch;
    while ((ch = std::fgetc(from_)) != EOF && ch != '\n') line.push_back(static_cast<char>(ch));
    if (ch == EOF && line.empty()) fail("the PyTorch baseline ended (is .venv set up? scripts/setup): " + text_);
    text_ += line + "\n";
    if (!line.empty() && line[0] == '{') {
      auto j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_discarded()) fail("unreadable line from the PyTorch baseline: " + line);
      if (j.contains("error")) fail("the PyTorch baseline: " + j["error"].get<std::string>());
      return j;
    }
  }
}

nlohmann::json BaselineProcess::request(const std::string& line) {
  if (std::fputs((line + "\n").c_str(), to_) < 0 || std::fflush(to_) != 0) fail("cannot write to the PyTorch baseline");
  return read_json();
}

nlohmann::json BaselineProcess::quit() {
  auto j = request("quit");
  std::fclose(to_);
  to_ = nullptr;
  int st = 0;
  waitpid(pid_, &st, 0);
  pid_ = -1;
  return j;
}

}  // namespace lorasync::cli
