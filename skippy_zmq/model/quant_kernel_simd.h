// Vector helpers shared by the per-ISA loop files (quant_kernel_isa.cc, block_kernel_isa.cc),
// compiled into each with that file's ISA flags. Everything is in an anonymous namespace:
// internal linkage, so no ISA object can hand another a copy built for a wider CPU.
#pragma once

// Each loop file is compiled once per ISA; its exported names end in that ISA (SKIPPY_CAT).
#ifndef SKIPPY_ISA
#error "compile with -DSKIPPY_ISA=<name>"
#endif
#define SKIPPY_CAT2(a, b) a##b
#define SKIPPY_CAT(a, b) SKIPPY_CAT2(a, b)
#include <stdint.h>

#if defined(__x86_64__) && defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// One vector register of floats: 16 lanes (zmm), 8 (ymm) or 4 (xmm). Never
// wider than the ISA's registers: GCC lowers a 64-byte vector type without
// AVX-512 through the stack, which measured 30x slower.
#if defined(__AVX512F__)
#define SKIPPY_LANES 16
#elif defined(__AVX2__)
#define SKIPPY_LANES 8
#else
#define SKIPPY_LANES 4
#endif
constexpr int kLanes = SKIPPY_LANES;
typedef float vf __attribute__((vector_size(4 * SKIPPY_LANES)));

// IEEE binary16 bits -> float, portably (the generic path; x86 uses F16C below).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 0x3ff;
  uint32_t bits;
  if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);                 // inf, nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);         // normal: rebias 15 -> 127
  } else {
    float f = (float)man * (1.0f / 16777216.0f);             // zero, subnormal: man * 2^-24
    __builtin_memcpy(&bits, &f, 4);
    bits |= sign;
  }
  float out;
  __builtin_memcpy(&out, &bits, 4);
  return out;
}

// kLanes float16 scales -> float (one conversion per group and column vector).
inline vf loadh(const uint16_t* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
#elif defined(__AVX2__)
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
#else
  vf out;
  for (int i = 0; i < kLanes; ++i) out[i] = half_to_float(p[i]);
  return out;
#endif
}

// kLanes int8 -> kLanes float in registers (GCC's generic vector convert goes scalar).
inline vf widen_s8(const int8_t* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
#elif defined(__AVX2__)
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
#else
  vf out;
  for (int i = 0; i < kLanes; ++i) out[i] = p[i];
  return out;
#endif
}

inline float hsum(vf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps((__m512)v);
#else
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
#endif
}

inline vf loadf(const float* p) {
  vf v;
  __builtin_memcpy(&v, p, sizeof(vf));
  return v;
}

}  // namespace
