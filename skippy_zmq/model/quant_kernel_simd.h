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

// How far ahead of its use a decode loop asks for a weight's bytes (the block loops' Q4_K / Q6_K
// blocks, the panels' rows). The hardware prefetcher alone kept too few misses in flight: one core read
// a Q4_K matrix out of cache at ~4 GB/s, half of what Q6_K's loop read, and Q4_K was ~70% of the 1B
// shape's decode step. 64 copies of a 2048x2048 matrix (out of cache), one thread's CPU time, load
// 8-14, AVX-512 (AVX2): Q4_K 4.0 -> 7.9-8.8 GB/s (4.5-4.8 -> 5.8), Q6_K 5.9-6.8 -> 8.1-9.0 (~6.0 ->
// 7.1-7.6); 400 of SmolLM2's 576x1536 5-bit panels 5.3-5.5 -> 8.6-9.1 (3.9-4.0 -> 5.2-5.6); 1024
// ahead did less, 4096 no more; a matrix in cache ran as before. Weights are contiguous, so the
// lines ahead are the next rows' or panel's (past a task's end, a neighbour's: a wasted fetch; a
// prefetch never faults). No arithmetic changes: every bit stays the same.
constexpr int kPrefetch = 2048;
template <int kBytes>
inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t* p) {
  for (int l = 0; l < kBytes; l += 64) __builtin_prefetch(p + kPrefetch + l);
}

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
