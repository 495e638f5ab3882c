// The matmul loops of the weight-only int8 / 4-bit dense layer, for one
// instruction set. quant.py compiles this file once per ISA (-DSKIPPY_ISA=avx512
// with -mavx512f..., avx2 with -mavx2 -mfma, generic with no ISA flag) and links
// the objects with the FFI glue (quant_kernel.cc), which picks one at load time.
//
// Only C headers here, and everything but the two exported entry points has
// internal linkage: an ISA object must not contribute a shared inline function
// that the linker could hand to another ISA's caller.
//
// Layout and semantics: quant_kernel.h. Why a kernel at all, and why panels:
// quant_kernel.cc.

#include "quant_kernel.h"

#if defined(__x86_64__) && defined(__AVX2__)
#include <immintrin.h>
#endif

#ifndef SKIPPY_ISA
#error "compile with -DSKIPPY_ISA=<name>"
#endif
#define SKIPPY_CAT2(a, b) a##b
#define SKIPPY_CAT(a, b) SKIPPY_CAT2(a, b)

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
constexpr int64_t kPanel = SKIPPY_PANEL;

// A pass over K covers kVecs vectors of columns (accumulators, partial sums
// and widened weights then fit the 32 zmm or 16 ymm / xmm registers); a
// 64-column panel takes 1 (AVX-512), 2 (AVX2) or 4 passes. kRows: rows per
// register tile when several rows share the widened weights.
constexpr int kVecs = 4;
constexpr int kPasses = kPanel / (kVecs * kLanes);
#if defined(__AVX512F__)
constexpr int kRows = 4;
#else
constexpr int kRows = 2;
#endif

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

// The low (high = false) or high nibbles of kLanes bytes -> kLanes float.
inline vf widen_u4(const uint8_t* p, bool high) {
#if defined(__AVX512F__)
  __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  a = high ? _mm512_srli_epi32(a, 4) : _mm512_and_si512(a, _mm512_set1_epi32(15));
  return (vf)_mm512_cvtepi32_ps(a);
#elif defined(__AVX2__)
  __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
  a = high ? _mm256_srli_epi32(a, 4) : _mm256_and_si256(a, _mm256_set1_epi32(15));
  return (vf)_mm256_cvtepi32_ps(a);
#else
  vf out;
  for (int i = 0; i < kLanes; ++i) out[i] = high ? p[i] >> 4 : p[i] & 15;
  return out;
#endif
}

// Column block j (columns j * kLanes onwards) of one packed panel row, as float levels.
struct Int8 {
  static constexpr int64_t kRowBytes = kPanel;
  static inline vf block(const uint8_t* row, int j) { return widen_s8((const int8_t*)row + kLanes * j); }
};
struct Q4 {  // byte i holds column i (low nibble) and column i + 32 (high nibble)
  static constexpr int64_t kRowBytes = kPanel / 2;
  static inline vf block(const uint8_t* row, int j) {
    return widen_u4(row + (kLanes * j) % (kPanel / 2), kLanes * j >= kPanel / 2);
  }
};

// R rows x the kVecs column blocks of pass h, over the whole K. Each weight
// vector is scaled once in registers (one FMA) and shared by the R rows.
template <class F, int R>
void tile_rows(const SkippyDenseArgs& a, const uint8_t* panel, const uint16_t* s, const uint16_t* z,
               int64_t m0, int64_t n0, int h) {
  vf acc[R][kVecs] = {};
  const uint8_t* row = panel;
  for (int64_t g0 = 0; g0 < a.K; g0 += a.group) {
    const int64_t at = (g0 / a.group) * kPanel + kLanes * kVecs * h;
    vf sc[kVecs], zc[kVecs];
    for (int c = 0; c < kVecs; ++c) sc[c] = loadh(s + at + kLanes * c), zc[c] = loadh(z + at + kLanes * c);
    for (int64_t k = g0; k < g0 + a.group; ++k, row += F::kRowBytes) {
      vf w[kVecs];
      for (int c = 0; c < kVecs; ++c) w[c] = F::block(row, h * kVecs + c) * sc[c] + zc[c];
      for (int r = 0; r < R; ++r) {
        const float xv = a.x[(m0 + r) * a.K + k];
        for (int c = 0; c < kVecs; ++c) acc[r][c] += xv * w[c];
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kVecs; ++c)
      __builtin_memcpy(a.y + (m0 + r) * a.Np + n0 + kLanes * (h * kVecs + c), &acc[r][c], sizeof(vf));
}

// One row (decode). Scales are applied per group, not per weight:
// y += s * sum(x * level) + z * sum(x), one FMA per weight vector instead of two.
template <class F>
void tile_one(const SkippyDenseArgs& a, const uint8_t* panel, const uint16_t* s, const uint16_t* z,
              int64_t m, int64_t n0, int h) {
  vf acc[kVecs] = {};
  const float* x = a.x + m * a.K;
  const uint8_t* row = panel;
  for (int64_t g0 = 0; g0 < a.K; g0 += a.group) {
    vf part[kVecs] = {};
    float xsum = 0.0f;
    for (int64_t k = g0; k < g0 + a.group; ++k, row += F::kRowBytes) {
      const float xv = x[k];
      xsum += xv;
      for (int c = 0; c < kVecs; ++c) part[c] += xv * F::block(row, h * kVecs + c);
    }
    const int64_t at = (g0 / a.group) * kPanel + kLanes * kVecs * h;
    for (int c = 0; c < kVecs; ++c) acc[c] += part[c] * loadh(s + at + kLanes * c) + xsum * loadh(z + at + kLanes * c);
  }
  for (int c = 0; c < kVecs; ++c) __builtin_memcpy(a.y + m * a.Np + n0 + kLanes * (h * kVecs + c), &acc[c], sizeof(vf));
}

// Every row of output panel p; the panel stays in cache while row tiles reuse it.
template <class F>
void panel_rows(const SkippyDenseArgs* a, int64_t p) {
  const uint8_t* panel = (const uint8_t*)a->q + p * a->K * F::kRowBytes;
  const int64_t at = p * (a->K / a->group) * kPanel, n0 = p * kPanel;
  const uint16_t *s = a->s + at, *z = a->z + at;
  for (int h = 0; h < kPasses; ++h) {
    int64_t m = 0;
    for (; m + kRows <= a->M; m += kRows) tile_rows<F, kRows>(*a, panel, s, z, m, n0, h);
    if (kRows > 2 && m + 2 <= a->M) tile_rows<F, 2>(*a, panel, s, z, m, n0, h), m += 2;
    if (m < a->M) tile_one<F>(*a, panel, s, z, m, n0, h);
  }
}

}  // namespace

extern "C" void SKIPPY_CAT(skippy_int8_panel_, SKIPPY_ISA)(const SkippyDenseArgs* a, int64_t p) {
  panel_rows<Int8>(a, p);
}
extern "C" void SKIPPY_CAT(skippy_q4_panel_, SKIPPY_ISA)(const SkippyDenseArgs* a, int64_t p) {
  panel_rows<Q4>(a, p);
}
