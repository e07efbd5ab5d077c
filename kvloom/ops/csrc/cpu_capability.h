// Included before any ATen header by every kvloom C++ source.
//
// at::vec picks its implementation from the flags a file is compiled with (-march=native when the
// compiler allows it); its inline namespace gets our own name so that nothing can collide with
// libtorch's copies of the same functions.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define CPU_CAPABILITY_AVX512
#define CPU_CAPABILITY kvloom_avx512
#if defined(__AVX512BF16__)
#define KVLOOM_BF16_DOT  // vdpbf16ps: bf16 pairs multiplied exactly and summed in fp32
#endif
#if defined(__AVX512VNNI__)
#define KVLOOM_VNNI_DOT  // vpdpbusd: u8 x s8 quadruples summed exactly into int32
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX2
#define CPU_CAPABILITY kvloom_avx2
#else
#define CPU_CAPABILITY kvloom_default
#endif

// kvloom's bf16 GEMM (gemm.cpp) and so the layer stack (decoder.cpp): vdpbf16ps where the CPU has it,
// else bf16 widened to fp32 in registers for AVX2 FMAs.
#if defined(KVLOOM_BF16_DOT) || (defined(__AVX2__) && defined(__FMA__))
#define KVLOOM_BF16_GEMM
#endif

// What this build was compiled for, as compiled_isa() reports it (gemm.cpp).
#if defined(CPU_CAPABILITY_AVX512) && defined(KVLOOM_BF16_DOT) && defined(KVLOOM_VNNI_DOT)
#define KVLOOM_COMPILED_ISA "avx512 (avx512_bf16, avx512_vnni)"
#elif defined(CPU_CAPABILITY_AVX512) && defined(KVLOOM_BF16_DOT)
#define KVLOOM_COMPILED_ISA "avx512 (avx512_bf16)"
#elif defined(CPU_CAPABILITY_AVX512) && defined(KVLOOM_VNNI_DOT)
#define KVLOOM_COMPILED_ISA "avx512 (avx512_vnni)"
#elif defined(CPU_CAPABILITY_AVX512)
#define KVLOOM_COMPILED_ISA "avx512"
#elif defined(CPU_CAPABILITY_AVX2)
#define KVLOOM_COMPILED_ISA "avx2"
#else
#define KVLOOM_COMPILED_ISA "generic"
#endif

// Fixed-count loops over register arrays must be unrolled completely, or GCC keeps the arrays in
// memory and reloads them every iteration.
#define KVLOOM_UNROLL _Pragma("GCC unroll 16")
