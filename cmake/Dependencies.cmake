# Every third-party dependency comes from Debian's packages (scripts/setup installs them).
find_package(Threads REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(fmt REQUIRED)
find_package(spdlog REQUIRED)
find_package(CLI11 REQUIRED)
find_package(OpenSSL REQUIRED)
find_package(PkgConfig REQUIRED)
pkg_check_modules(PCRE2 REQUIRED IMPORTED_TARGET libpcre2-8)
pkg_check_modules(TOMLPP REQUIRED IMPORTED_TARGET tomlplusplus)
find_package(Boost 1.74 REQUIRED)
# xxHash (libxxhash-dev), used from its header alone (XXH_INLINE_ALL): the proxy's block hash.
find_path(XXHASH_INCLUDE_DIR xxhash.h REQUIRED DOC "xxHash's header (Debian: libxxhash-dev)")
# mimalloc (libmimalloc-dev): the front executable's malloc (apps/lorasync/CMakeLists.txt).
find_package(mimalloc 2.0 REQUIRED)

# The repository's root: this file is also included by tests/sanitize (its libtorch-linked part).
if(NOT DEFINED LORASYNC_ROOT)
  set(LORASYNC_ROOT "${PROJECT_SOURCE_DIR}")
endif()

# libtorch: the torch wheel in the project's .venv (scripts/setup pins PyTorch 2.11 built for CUDA 13):
# one libtorch for CPU and GPU, the same as the GPU machines' image, so a binary built here runs
# there. Another libtorch 2.x: -DTorch_DIR=<libtorch>/share/cmake/Torch.
set(LORASYNC_PYTHON "${LORASYNC_ROOT}/.venv/bin/python" CACHE FILEPATH
    "the project's Python (torch wheel; reference libraries for the conformance tests)")
if(NOT Torch_DIR)
  file(GLOB _torch_dirs "${LORASYNC_ROOT}/.venv/lib/python3*/site-packages/torch/share/cmake/Torch")
  if(_torch_dirs)
    list(GET _torch_dirs 0 _torch_dir)
    set(Torch_DIR "${_torch_dir}" CACHE PATH "libtorch's CMake package" FORCE)
  endif()
endif()
if(Torch_DIR)
  # TorchConfig looks its pieces up with the system paths first: pin them to the chosen libtorch
  # so that another one installed system-wide (Debian's libtorch-dev 1.13) is never mixed in.
  get_filename_component(_torch_prefix "${Torch_DIR}/../../.." ABSOLUTE)
  set(Caffe2_DIR "${_torch_prefix}/share/cmake/Caffe2" CACHE PATH "" FORCE)
  # (cache variable, library) pairs, as TorchConfig names them.
  foreach(_pair TORCH_LIBRARY:torch torch_cpu_LIBRARY:torch_cpu torch_cuda_LIBRARY:torch_cuda
                c10_LIBRARY:c10 C10_CUDA_LIBRARY:c10_cuda)
    string(REPLACE ":" ";" _pair "${_pair}")
    list(GET _pair 0 _var)
    list(GET _pair 1 _lib)
    if(EXISTS "${_torch_prefix}/lib/lib${_lib}.so")
      set(${_var} "${_torch_prefix}/lib/lib${_lib}.so" CACHE FILEPATH "" FORCE)
    endif()
  endforeach()
endif()
# A CUDA libtorch's config enables CUDA: name the architectures (no GPU probe; sm_80 and sm_90 by
# default, LORASYNC_CUDA_ARCHS to change) and keep the CUDA dialect one nvcc and CMake 3.25 share.
set(LORASYNC_CUDA_ARCHS "8.0;9.0" CACHE STRING "CUDA architectures (TORCH_CUDA_ARCH_LIST form)")
set(TORCH_CUDA_ARCH_LIST "${LORASYNC_CUDA_ARCHS}")
if(NOT DEFINED CMAKE_CUDA_STANDARD)
  set(CMAKE_CUDA_STANDARD 17)  # CMake 3.25 knows no C++20 flags for nvcc 13; our .cu files are C++17
endif()
set(CMAKE_CUDA_EXTENSIONS OFF)
find_package(Torch 2.0)
if(NOT Torch_FOUND)
  message(FATAL_ERROR "libtorch 2.x not found: run scripts/setup (it makes .venv with the pinned torch)")
endif()
# The wheel's include/ also holds the fmt (v12) libtorch was built with; our code and spdlog use
# Debian's fmt. libtorch's targets get a copy of include/ made of links to everything but fmt/,
# so <fmt/...> resolves to Debian's (libtorch's public ATen/c10/torch headers do not need it).
if(TARGET torch_cpu)
  get_target_property(_torch_inc torch_cpu INTERFACE_INCLUDE_DIRECTORIES)
  list(GET _torch_inc 0 _torch_inc)
  # One shim per libtorch, shared by every preset and named by the libtorch's path relative to the
  # source tree: every clone gets the same relative include paths, so ccache (CCACHE_BASEDIR)
  # shares objects across clones and presets.
  file(RELATIVE_PATH _torch_inc_rel "${LORASYNC_ROOT}" "${_torch_inc}")
  string(SHA1 _inc_hash "${_torch_inc_rel}")
  string(SUBSTRING "${_inc_hash}" 0 10 _inc_hash)
  set(_shim "${LORASYNC_ROOT}/build/torch-include-${_inc_hash}")
  file(REMOVE_RECURSE "${_shim}")
  file(MAKE_DIRECTORY "${_shim}")
  file(GLOB _entries RELATIVE "${_torch_inc}" "${_torch_inc}/*")
  foreach(_e IN LISTS _entries)
    if(NOT _e STREQUAL "fmt")
      file(CREATE_LINK "${_torch_inc}/${_e}" "${_shim}/${_e}" SYMBOLIC)
    endif()
  endforeach()
  foreach(_t torch torch_cpu torch_cuda c10 c10_cuda headeronly torch_nvshmem)
    if(TARGET ${_t})
      get_target_property(_dirs ${_t} INTERFACE_INCLUDE_DIRECTORIES)
      if(_dirs)
        string(REPLACE "${_torch_inc}" "${_shim}" _dirs "${_dirs}")
        set_target_properties(${_t} PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${_dirs}")
      endif()
    endif()
  endforeach()
endif()
# The wheel's libtorch.so exports copies of libstdc++ symbols it linked statically (its toolchain's
# libstdc++_nonshared: std::filesystem, <chrono> time zones, ...), and one of them crashes when our
# code binds to it (std::filesystem::remove_all). Every executable lists libstdc++ before libtorch
# among its needed libraries, so symbol lookup finds the system library's definitions first.
add_link_options("SHELL:-Wl,--push-state,--no-as-needed -lstdc++ -Wl,--pop-state")
# TorchConfig adds its flags to TORCH_CXX_FLAGS (e.g. the ABI define); keep them on our torch targets.
separate_arguments(LORASYNC_TORCH_CXX_FLAGS UNIX_COMMAND "${TORCH_CXX_FLAGS}")
add_library(lorasync_torch INTERFACE)
target_link_libraries(lorasync_torch INTERFACE ${TORCH_LIBRARIES})
target_compile_options(lorasync_torch INTERFACE ${LORASYNC_TORCH_CXX_FLAGS})
# at::parallel_for is a header template: with the wheel's OpenMP backend it runs in parallel only
# in code compiled with -fopenmp, bound to the libgomp that libtorch itself loads (torch/lib). Our
# kernels' one parallel_for (core/model/cpu_kernels.cpp) is compiled so; without that libgomp (a
# libtorch with native threads), at::parallel_for is parallel as it is.
get_filename_component(_torch_lib_dir "${Torch_DIR}/../../../lib" ABSOLUTE)
find_file(LORASYNC_TORCH_LIBGOMP libgomp.so.1 PATHS "${_torch_lib_dir}" NO_DEFAULT_PATH)
message(STATUS "libtorch ${Torch_VERSION}: ${Torch_DIR}")
