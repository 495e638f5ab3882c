// Shared between the FFI glue (quant_kernel.cc, built for the baseline CPU)
// and the matmul loops (quant_kernel_isa.cc, built once per instruction set).
// Plain C on purpose: the per-ISA objects share no C++ inline functions with
// the glue, so the linker can never pick an AVX-512 copy of a helper for a
// CPU that only has AVX2.
#pragma once
#include <stdint.h>

#define SKIPPY_PANEL 64  // output columns per packed weight panel

// One dense call, y[M, Np] = x[M, K] @ W, W[k, n] = level(k, n) * s[g, n] + z[g, n], g = k / group.
// Levels are packed in 64-column panels: int8 [Np / 64][K][64], or 4-bit
// [Np / 64][K][32] (byte j: column j in the low nibble, column j + 32 in the high one).
// s and z are float16 (IEEE binary16 bits) [Np / 64][K / group][64], widened once per group.
typedef struct {
  const float* x;
  const void* q;
  const uint16_t* s;
  const uint16_t* z;
  float* y;
  int64_t M, K, Np, group;
} SkippyDenseArgs;

// Computes every row of output panel p.
typedef void (*SkippyPanelFn)(const SkippyDenseArgs* args, int64_t p);

#define SKIPPY_DECLARE_ISA(isa)                                                 \
  extern "C" void skippy_int8_panel_##isa(const SkippyDenseArgs* args, int64_t p); \
  extern "C" void skippy_q4_panel_##isa(const SkippyDenseArgs* args, int64_t p);
