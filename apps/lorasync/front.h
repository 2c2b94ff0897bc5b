// apps/lorasync/front.h: the `lorasync` front executable (apps/lorasync/CMakeLists.txt). It runs
// the commands that need no libtorch in its own process and replaces itself with lorasync-engine,
// found beside it, for every other command.
#pragma once

namespace lorasync::front {

// True when the command named by argv runs in the front: proxy, grade, tokenize, train-tokenizer,
// report, stub-replica, `bench proxy|grade|tokenizer`, and `--version` alone. Help asked before
// the command is named and every other command go to the engine, which knows them all.
bool runs_here(int argc, char** argv);

// Called first by lorasync-engine: clears the marker exec_engine() sets, so that the fronts it
// starts as children (the demo's) exec the engine again.
void engine_started();

// Replaces this process with lorasync-engine, same arguments (argv[0] kept): $LORASYNC_ENGINE if
// set, else lorasync-engine in this executable's directory. Returns only when that fails, after
// printing why, with exit code 1; also when this front was itself exec'd as the engine (a
// LORASYNC_VIA_FRONT marker in the environment), instead of exec'ing itself forever.
int exec_engine(int argc, char** argv);

}  // namespace lorasync::front
