// `lorasync train`: the asynchronous GRPO trainer (trainer.md). Signals: the first SIGTERM/SIGINT
// asks for a checkpoint and exit 143; a second one exits at once.
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <thread>

#include "commands.h"
#include "rl/trainer.h"

namespace lorasync::cli {

namespace {

int run(rl::TrainArgs a) {
  if (a.api_key.empty())
    if (const char* k = std::getenv("LORASYNC_API_KEY")) a.api_key = k;
  // Stop signals are handled by one thread: the first sets the flag, a second exits at once.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::thread([set]() mutable {
    int sig = 0;
    sigwait(&set, &sig);
    std::fprintf(stderr, "\nlorasync train: signal %d: checkpointing and stopping (again to exit at once)\n", sig);
    rl::g_stop_signal = 1;
    sigwait(&set, &sig);
    std::_Exit(143);
  }).detach();
  return rl::run_trainer(a);
}

}  // namespace

void register_train(CLI::App& root, Registry& reg) {
  auto a = std::make_shared<rl::TrainArgs>();
  auto* sub = root.add_subcommand("train", "asynchronous GRPO training of a LoRA adapter against lorasync serve/proxy");
  sub->add_option("--config", a->config_path, "TOML configuration (trainer.md section 7)");
  sub->add_option("--set", a->overrides, "override section.key=value (TOML value; repeatable, applied in order)");
  auto* resume = sub->add_option("--resume", a->resume_dir, "continue from a checkpoint (default: the latest complete one)")
                     ->expected(0, 1);
  sub->add_flag("--resume-force", a->resume_force, "accept non-operational configuration changes on resume");
  sub->add_flag("--overwrite", a->overwrite, "start over in an output_dir that holds checkpoints or adapters");
  sub->add_flag("--dry-run", a->dry_run, "check the configuration, data and server capabilities, then exit");
  sub->add_option("--api-key", a->api_key, "bearer token for the server or proxy (default: $LORASYNC_API_KEY)");
  reg.add(sub, [a, resume]() {
    a->resume = resume->count() > 0;
    return run(*a);
  });
}

}  // namespace lorasync::cli
