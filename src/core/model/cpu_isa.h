// core/model/cpu_isa.h: the x86 intrinsics and LS_X86 (1 where they exist) for the CPU kernels'
// implementation files (cpu_kernels.cpp, cpu_gemm.cpp); never included by headers. Which kernels
// run is decided at run time (__builtin_cpu_supports), so the baseline ISA stays the compiler's.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define LS_X86 1
#else
#define LS_X86 0
#endif
