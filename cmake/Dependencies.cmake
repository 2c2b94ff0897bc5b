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

# libtorch: Debian's CPU build (1.13) here, a CUDA build (2.x) on GPU machines (-DCMAKE_PREFIX_PATH).
find_package(Torch REQUIRED)
# TorchConfig adds its flags to TORCH_CXX_FLAGS (e.g. the ABI define); keep them on our torch targets.
separate_arguments(LORASYNC_TORCH_CXX_FLAGS UNIX_COMMAND "${TORCH_CXX_FLAGS}")
add_library(lorasync_torch INTERFACE)
target_link_libraries(lorasync_torch INTERFACE ${TORCH_LIBRARIES})
target_compile_options(lorasync_torch INTERFACE ${LORASYNC_TORCH_CXX_FLAGS})
message(STATUS "libtorch ${Torch_VERSION}: ${TORCH_LIBRARIES}")
