# Use ccache when present: rebuilds of libtorch- and Beast-heavy sources are slow on 2 cores.
find_program(CCACHE_PROGRAM ccache)
if(CCACHE_PROGRAM AND NOT CMAKE_CXX_COMPILER_LAUNCHER)
  set(CMAKE_CXX_COMPILER_LAUNCHER ${CCACHE_PROGRAM})
  message(STATUS "ccache: ${CCACHE_PROGRAM}")
endif()
