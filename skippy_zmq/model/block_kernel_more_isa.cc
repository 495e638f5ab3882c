// More GGUF types for the block kernel, for one instruction set: the unpackers of Q3_K, IQ4_XS, IQ4_NL,
// Q5_1 and Q2_K rows (the types of the Q3_K_M, IQ4_XS and Q2_K recipes and Q4_K_M's Q5_1 fallbacks).
// block_kernel_isa.cc owns the task and the dot products and calls skippy_unpack_more (contract:
// block_kernel_more.h) for these types; this file only turns a row's blocks into int8 levels and the
// float factors of gguf-py's dequantiser (model/ggml.py), so the kernel's results differ from the f32
// product of the dequantised weights only by the order of the float sums.
// Built per ISA like the other *_isa.cc files (model/kernel.py); only skippy_unpack_more_<isa> is external.

#include "quant_kernel_simd.h"
#include "block_kernel_more.h"

#include <string.h>

namespace {

// IQ4_NL / IQ4_XS's non-linear levels (ggml's kvalues_iq4nl; ggml.py IQ4_VALUES).
alignas(16) constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                               1,    13,   25,  38,  53,  69,  89,  113};

inline float f16_at(const uint8_t* p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return half_to_float(h);
}

// 16 bytes of nibbles -> 32 IQ4 levels: the low halves first, then the high halves (ggml's order).
inline void iq4_levels(const uint8_t* __restrict qs, int8_t* __restrict level) {
#if defined(__AVX2__)   // pshufb: sixteen 16-entry table look-ups at once
  const __m128i table = _mm_load_si128((const __m128i*)kIq4Values), low = _mm_set1_epi8(15);
  const __m128i q = _mm_loadu_si128((const __m128i*)qs);
  _mm_storeu_si128((__m128i*)level, _mm_shuffle_epi8(table, _mm_and_si128(q, low)));
  _mm_storeu_si128((__m128i*)(level + 16), _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(q, 4), low)));
#else
  for (int l = 0; l < 16; ++l) level[l] = kIq4Values[qs[l] & 15], level[l + 16] = kIq4Values[qs[l] >> 4];
#endif
}

// 32 weights: d * kvalues[q].
void unpack_iq4_nl(const uint8_t* b, int8_t* level, float* scale, float*) {
  iq4_levels(b + 2, level);
  scale[0] = scale[1] = f16_at(b);
}

// 256 weights in 8 runs of 32: d * (ls - 32) * kvalues[q], ls 6 bits: 4 in scales_l, 2 in scales_h.
void unpack_iq4_xs(const uint8_t* b, int8_t* level, float* scale, float*) {
  const float d = f16_at(b);
  const unsigned high = b[2] | (unsigned)b[3] << 8;
  for (int j = 0; j < 8; ++j) {
    const int ls = ((b[4 + j / 2] >> (4 * (j & 1))) & 15) | (((high >> (2 * j)) & 3) << 4);
    scale[2 * j] = scale[2 * j + 1] = d * (float)(ls - 32);
    iq4_levels(b + 8 + 16 * j, level + 32 * j);
  }
}

// Q2_K / Q3_K's 2-bit fields: weight 128 h + 32 j + l is bits 2j of byte 32 h + l of qs (h < 2, j < 4).
// Q3_K subtracts 4 where bit 4 h + j of hmask[l] is clear.
template <bool kThree>
inline void two_bit_levels(const uint8_t* __restrict qs, const uint8_t* __restrict hmask, int8_t* __restrict level) {
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 32; ++l) {
        const int q = (qs[32 * h + l] >> (2 * j)) & 3;
        level[128 * h + 32 * j + l] = (int8_t)(kThree ? q - 4 + (((hmask[l] >> (4 * h + j)) & 1) << 2) : q);
      }
}

// 256 weights in 16 runs of 16: d * (sc - 32) * q, q in -4..3, sc 6 bits (4 low in bytes 0-7, 2 high in 8-11).
void unpack_q3_k(const uint8_t* b, int8_t* level, float* scale, float*) {
  const uint8_t* sc = b + 96;
  const float d = f16_at(b + 108);
  for (int r = 0; r < 16; ++r) {
    const int lo = r < 8 ? sc[r] & 15 : sc[r - 8] >> 4, hi = (sc[8 + r % 4] >> (2 * (r / 4))) & 3;
    scale[r] = d * (float)((lo | hi << 4) - 32);
  }
  two_bit_levels<true>(b + 32, b, level);
}

// 256 weights in 16 runs of 16: d * (sc & 15) * q - dmin * (sc >> 4), q in 0..3.
void unpack_q2_k(const uint8_t* b, int8_t* level, float* scale, float* min) {
  const float d = f16_at(b + 80), dmin = f16_at(b + 82);
  for (int r = 0; r < 16; ++r) scale[r] = d * (float)(b[r] & 15), min[r] = dmin * (float)(b[r] >> 4);
  two_bit_levels<false>(b + 16, nullptr, level);
}

typedef uint8_t v16u8 __attribute__((vector_size(16)));   // 16 bytes: SSE2 / NEON on any 64-bit CPU

// 16 fifth bits as level bits: byte i is 16 where bit i of the 16 bits (lo, then hi) is set. In vectors
// (a byte test per lane): a loop over (qh >> i) & 1 stays scalar and made Q5_1 rows 8x slower to unpack.
inline v16u8 fifth_bits(uint8_t lo, uint8_t hi) {
  const v16u8 bit = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
  const v16u8 bytes = {lo, lo, lo, lo, lo, lo, lo, lo, hi, hi, hi, hi, hi, hi, hi, hi};
  return (v16u8)((bytes & bit) == bit) & 16;
}

// 32 weights: d * q + m, q 0..31 with its fifth bit i in the u32 qh; the kernel subtracts min = -m.
void unpack_q5_1(const uint8_t* b, int8_t* __restrict level, float* scale, float* min) {
  v16u8 qs;
  memcpy(&qs, b + 8, 16);
  const v16u8 lo = (qs & 15) | fifth_bits(b[4], b[5]), hi = (qs >> 4) | fifth_bits(b[6], b[7]);
  memcpy(level, &lo, 16), memcpy(level + 16, &hi, 16);
  scale[0] = scale[1] = f16_at(b);
  min[0] = min[1] = -f16_at(b + 2);
}

typedef void (*UnpackBlock)(const uint8_t* b, int8_t* level, float* scale, float* min);

// One row: each block's levels, then its scales (and minimums) per 16 inputs. The type is chosen once
// per row, so the loop over blocks calls one unpacker (inlined into this template's copy).
template <int kBlock, int kBytes, UnpackBlock kUnpack>
void unpack_blocks(int64_t k0, int64_t count, const uint8_t* row, int8_t* level, float* scale, float* min) {
  row += k0 / kBlock * kBytes;
  for (int64_t i = 0; i < count / kBlock; ++i, row += kBytes)
    kUnpack(row, level + i * kBlock, scale + i * (kBlock / 16), min + i * (kBlock / 16));
}

}  // namespace

extern "C" void skippy_unpack_more(int32_t type, const uint8_t* row, int64_t k0, int64_t count, int8_t* level,
                                   float* scale, float* min) {
  switch (type) {
    case SKIPPY_GGML_Q3_K: unpack_blocks<256, 110, unpack_q3_k>(k0, count, row, level, scale, min); break;
    case SKIPPY_GGML_IQ4_XS: unpack_blocks<256, 136, unpack_iq4_xs>(k0, count, row, level, scale, min); break;
    case SKIPPY_GGML_IQ4_NL: unpack_blocks<32, 18, unpack_iq4_nl>(k0, count, row, level, scale, min); break;
    case SKIPPY_GGML_Q5_1: unpack_blocks<32, 24, unpack_q5_1>(k0, count, row, level, scale, min); break;
    case SKIPPY_GGML_Q2_K: unpack_blocks<256, 84, unpack_q2_k>(k0, count, row, level, scale, min); break;
    default: break;   // the glue admits only skippy_more_block's types
  }
}
