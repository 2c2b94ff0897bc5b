// lorasync: thin subcommands (serve, proxy, train, eval, demo, bench, grade, tokenize, logprobs,
// init-model, ...). Exit codes: 0 ok, 1 runtime error, 2 bad input or configuration.
// Built twice (apps/lorasync/CMakeLists.txt): as lorasync-engine with every command, and with
// LORASYNC_FRONT as `lorasync`, with the commands that need no libtorch, which execs the engine
// for the others.
#include <cstdio>
#include <exception>

#include "commands.h"
#include "front.h"
#include "util/error.h"
#include "util/log.h"
#include "util/process.h"

int main(int argc, char** argv) {
  using namespace lorasync;
#ifdef LORASYNC_FRONT
  if (!front::runs_here(argc, argv)) return front::exec_engine(argc, argv);
#else
  front::engine_started();
#endif
  configure_process();
  log::init_stderr();

  CLI::App app{"lorasync: asynchronous GRPO for LoRA adapters (trainer, server, proxy, verifier)"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("lorasync ") + LORASYNC_VERSION);
  std::string log_level = "info";
  app.add_option("--log-level", log_level, "trace|debug|info|warn|error|off")->capture_default_str();

  // Registered in the order `--help` lists them; the engine's commands only in the engine.
  cli::Registry reg;
#ifndef LORASYNC_FRONT
  cli::register_init_model(app, reg);
  cli::register_logprobs(app, reg);
  cli::register_generate(app, reg);
  cli::register_serve(app, reg);
  cli::register_init_adapter(app, reg);
#endif
  cli::register_grade(app, reg);
  cli::register_tokenize(app, reg);
  cli::register_train_tokenizer(app, reg);
  cli::register_proxy(app, reg);
#ifndef LORASYNC_FRONT
  cli::register_train(app, reg);
  cli::register_eval(app, reg);
#endif
  cli::register_report(app, reg);
#ifndef LORASYNC_FRONT
  cli::register_demo(app, reg);
  cli::register_make_demo_model(app, reg);
#endif

  CLI::App* bench = app.add_subcommand("bench", "benchmarks: JSON lines on stdout, table on stderr");
  bench->require_subcommand(1);
#ifndef LORASYNC_FRONT
  cli::register_bench_gemm(*bench, reg);
  cli::register_bench_forward(*bench, reg);
  cli::register_bench_serve(*bench, reg);
  cli::register_bench_train(*bench, reg);
#endif
  cli::register_bench_grade(*bench, reg);
  cli::register_bench_tokenizer(*bench, reg);
  cli::register_bench_proxy(*bench, reg);
  cli::register_bench_startup(*bench, reg);
#ifndef LORASYNC_FRONT
  cli::register_bench_sync(*bench, reg);
  cli::register_bench_e2e(*bench, reg);
  cli::register_bench_episodes(*bench, reg);
  cli::register_bench_reward(*bench, reg);
#endif

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  try {
    log::set_level(log_level);
    for (const auto& [sub, run] : reg.entries())
      if (sub->parsed()) return run();
    std::fprintf(stderr, "lorasync: no subcommand given\n");
    return 2;
  } catch (const Error& e) {
    std::fprintf(stderr, "lorasync: error: %s\n", e.what());
    return (e.kind() == ErrorKind::kInvalidInput || e.kind() == ErrorKind::kUnsupported ||
            e.kind() == ErrorKind::kNotFound)
               ? 2
               : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lorasync: error: %s\n", e.what());
    return 1;
  }
}
