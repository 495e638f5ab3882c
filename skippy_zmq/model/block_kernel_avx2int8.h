// GGUF blocks on int8 activations with AVX2 only (the avx2int8 build: SKIPPY_KERNEL_ISA=avx2int8, opt-in,
// never auto), included by block_kernel_isa.cc inside its anonymous namespace (its v8f, f16_at,
// k4_factors, bytes_from_bits and prefetch_ahead). The types skippy_int8_block_type_avx2 lists: Q4_K, Q5_K,
// Q6_K, Q8_0, Q5_0 (a Q4_K_M / Q5_K_M / Q6_K file's); every other type keeps the float loops there.
//
// x comes quantised exactly as the avx512vnni build quantises it (quant_kernel_isa.cc: the same xq, xd and
// xs), so every integer sum below equals that build's, and only the float sums' order differs. AVX2 has no
// vpdpbusd: vpmaddubsw multiplies unsigned bytes by signed ones and adds pairs into saturating int16, then
// vpmaddwd by ones adds pairs of those into int32 (4 products a lane, as vpdpbusd's). No pair can
// saturate: unsigned levels are at most 31 (2 * 31 * 127 < 32767); signed levels (Q8_0's q, Q5_0's q - 16,
// Q6_K's q - 32) go in as |level| with x's sign flipped where the level is negative (vpsignb; llama.cpp's
// mul_sum_i8_pairs), at most 2 * 128 * 127 = 32512. A lane's 4 products, then, are exact in int32.
// Each 32-input x block's int32 lanes are converted and multiplied, in an FMA, by the block's (or group's)
// float factor into one of two accumulators per row, alternating blocks; a horizontal sum at the end. Each
// row of x runs the same float operations in the same order whatever R is, so its result does not depend
// on the rows that share its call.
#pragma once

#if defined(SKIPPY_INT8_AVX2) && defined(__AVX2__)

// 32 unsigned levels (0..31) against 32 signed xq: 8 int32 lanes of 4 products each.
SKIPPY_INLINE __m256i dot_u8_avx2(__m256i level, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(level, x), _mm256_set1_epi16(1));
}

// 32 signed levels (magnitude <= 128) as |level| and the levels, against 32 signed xq (|xq| <= 127).
SKIPPY_INLINE __m256i dot_s8_avx2(__m256i magnitude, __m256i level, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x, level)), _mm256_set1_epi16(1));
}

SKIPPY_INLINE __m256i load_ymm(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }

// Where a call's rows of x from m0 (quantised: xq, xd, xs) and row n of W start; the accumulators zeroed.
struct Int8Call {
  int64_t K, xblocks;
  const int8_t* xq;
  const float *xd, *xs;
  const uint8_t* b;
  Int8Call(const SkippyBlockArgs& a, int64_t m0, int64_t n)
      : K(a.K), xblocks(a.K / SKIPPY_XBLOCK), xq(a.xq + m0 * a.K), xd(a.xd + m0 * xblocks),
        xs(a.xs + m0 * xblocks), b(a.w + n * a.row_bytes) {}
  template <int R>
  static void zero(__m256 acc[][2]) {
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  }
};

// Lane l of the result: f's lane i (a factor spread to a whole x block's 8 lanes).
SKIPPY_INLINE __m256 spread_lane(__m256 f, int i) { return _mm256_permutevar8x32_ps(f, _mm256_set1_epi32(i)); }

// acc[r][0] + acc[r][1], summed horizontally (hsum8's order), into y.
template <int R>
SKIPPY_INLINE void store_rows_avx2(const SkippyBlockArgs& a, int64_t m0, int64_t n, __m256 acc[][2], const __m256* mins,
                                   int sign) {
  for (int r = 0; r < R; ++r) {
    const __m256 t = _mm256_add_ps(acc[r][0], acc[r][1]);
    const __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    const __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
    float y = _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
    if (mins) {
      const __m128 m4 = _mm_add_ps(_mm256_castps256_ps128(mins[r]), _mm256_extractf128_ps(mins[r], 1));
      const __m128 m2 = _mm_add_ps(m4, _mm_movehl_ps(m4, m4));
      y += sign * _mm_cvtss_f32(_mm_add_ss(m2, _mm_movehdup_ps(m2)));
    }
    a.y[(m0 + r) * a.N + n] = y;
  }
}

// Q8_0 (f16 d, int8 q[32]): a block is one x block,
//   y[m, n] = sum_b d_b * xd[m, b] * isum[m, b],  isum = sum of q * xq over the block.
// Q5_0 (kFive: f16 d, u32 qh, qs[16]; w = d * (q - 16)): the signed levels q - 16 the same way (their
// fifth bits by bytes_from_bits). 8 blocks a step: their 8 d widened at once and multiplied by the 8 xd of
// each row (one 8-wide product), each block's factor spread by vpermps; blocks alternate accumulators. The
// blocks a K not a multiple of 256 leaves (K = 576: 2) one at a time, a scalar factor each.
template <bool kFive>
SKIPPY_INLINE void q8_q5_levels(const uint8_t* p, __m256i& level, __m256i& magnitude) {
  if (kFive) {
    const __m128i q = _mm_loadu_si128((const __m128i*)(p + 6)), low = _mm_set1_epi8(15);
    const __m256i v = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), low), _mm_and_si128(q, low));
    level = _mm256_sub_epi8(v, _mm256_andnot_si256(bytes_from_bits(p + 2), _mm256_set1_epi8(16)));
  } else {
    level = load_ymm(p + 2);
  }
  magnitude = _mm256_sign_epi8(level, level);   // |level| (vpabsb's value; -128 stays 0x80 = 128 unsigned)
}

template <int R, bool kFive>
void dot_q8_q5_avx2(const SkippyBlockArgs& a, int64_t m0, int64_t n) {
  constexpr int kBytes = kFive ? 22 : 34;
  __m256 acc[R][2];
  Int8Call::zero<R>(acc);
  auto [K, xblocks, xq, xd, xs, b] = Int8Call(a, m0, n);
  int64_t i = 0;
  for (; i + 8 <= xblocks; i += 8, b += 8 * kBytes) {
    prefetch_ahead<8 * kBytes>(b);
    uint16_t h[8];
    for (int c = 0; c < 8; ++c) memcpy(h + c, b + c * kBytes, 2);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)h));
    __m256 f[R];
    for (int r = 0; r < R; ++r) f[r] = _mm256_mul_ps(d, _mm256_loadu_ps(xd + r * xblocks + i));
    for (int c = 0; c < 8; ++c) {
      __m256i level, magnitude;
      q8_q5_levels<kFive>(b + c * kBytes, level, magnitude);
      for (int r = 0; r < R; ++r) {
        const __m256i isum = dot_s8_avx2(magnitude, level, load_ymm(xq + r * K + (i + c) * SKIPPY_XBLOCK));
        acc[r][c % 2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), spread_lane(f[r], c), acc[r][c % 2]);
      }
    }
  }
  for (; i < xblocks; ++i, b += kBytes) {
    __m256i level, magnitude;
    q8_q5_levels<kFive>(b, level, magnitude);
    const float d = f16_at(b);
    for (int r = 0; r < R; ++r) {
      const __m256i isum = dot_s8_avx2(magnitude, level, load_ymm(xq + r * K + i * SKIPPY_XBLOCK));
      acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(d * xd[r * xblocks + i]), acc[r][0]);
    }
  }
  store_rows_avx2<R>(a, m0, n, acc, nullptr, 1);
}

// Q4_K / Q5_K (kFive): 8 sub-blocks s of 32 weights, each one x block,
//   y[m, n] = sum_s (d * sc_s) * xd[m, s] * isum[m, s] - sum_s (dmin * m_s) * xs[m, s]
// isum = sum of level * xq over the sub-block, the levels unsigned (0..15; Q5_K 0..31, qh's bit s of byte
// l the fifth bit of weight l of sub-block s). qs' 32 bytes j hold sub-block 2j in their low nibbles, 2j + 1
// in their high ones. The factors (k4_factors, as the float loops') times xd, one 8-wide product a block.
template <int R, bool kFive>
void dot_k4_avx2(const SkippyBlockArgs& a, int64_t m0, int64_t n) {
  constexpr int kBytes = kFive ? 176 : 144, kQs = kFive ? 48 : 16;
  __m256 acc[R][2], mins[R];
  Int8Call::zero<R>(acc);
  for (int r = 0; r < R; ++r) mins[r] = _mm256_setzero_ps();
  auto [K, xblocks, xq, xd, xs, b] = Int8Call(a, m0, n);
  const __m256i nib = _mm256_set1_epi8(15), zero = _mm256_setzero_si256(), sixteen = _mm256_set1_epi8(16);
  for (int64_t k0 = 0; k0 < K; k0 += 256, b += kBytes) {
    prefetch_ahead<kBytes>(b);
    v8f sc, mn;
    k4_factors(b, sc, mn);
    __m256i level[8];
    for (int j = 0; j < 4; ++j) {
      const __m256i q = load_ymm(b + kQs + 32 * j);
      level[2 * j] = _mm256_and_si256(q, nib), level[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), nib);
    }
    if (kFive) {
      const __m256i qh = load_ymm(b + 16);
      for (int s = 0; s < 8; ++s) {
        const __m256i clear = _mm256_cmpeq_epi8(_mm256_and_si256(qh, _mm256_set1_epi8((char)(1 << s))), zero);
        level[s] = _mm256_or_si256(level[s], _mm256_andnot_si256(clear, sixteen));
      }
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* x = xq + r * K + k0;
      const int64_t at = r * xblocks + k0 / SKIPPY_XBLOCK;
      const __m256 f = _mm256_mul_ps((__m256)sc, _mm256_loadu_ps(xd + at));
      for (int s = 0; s < 8; ++s) {
        const __m256i isum = dot_u8_avx2(level[s], load_ymm(x + 32 * s));
        acc[r][s % 2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), spread_lane(f, s), acc[r][s % 2]);
      }
      mins[r] = _mm256_fmadd_ps((__m256)mn, _mm256_loadu_ps(xs + at), mins[r]);
    }
  }
  store_rows_avx2<R>(a, m0, n, acc, mins, -1);
}

// Q6_K (ql[128], qh[64], int8 scales[16], f16 d): 16 groups g of 16 weights,
//   y[m, n] = sum_g (d * sc_g) * xd[m, g / 2] * isum[m, g],  isum = sum over g of (q - 32) * xq
// Per half h of 128 weights, 32-weight vector v = 4h + j: the low (j < 2) or high nibbles of
// ql[64h + 32 (j % 2) ..] with qh[32h ..]'s bits 2j, 2j + 1 as q's top two (unpack_q6_k's order: weights
// 0-31 ql[0:32] low, 32-63 ql[32:64] low, 64-95 ql[0:32] high, 96-127 ql[32:64] high). The signed levels
// q - 32 as |level| and sign. A vector's lanes 0-3 are group 2v, 4-7 group 2v + 1: their factors
// d * sc_g * xd[v] (two 8-wide products a block and row, spread by vpermps).
template <int R>
void dot_q6_k_avx2(const SkippyBlockArgs& a, int64_t m0, int64_t n) {
  __m256 acc[R][2];
  Int8Call::zero<R>(acc);
  auto [K, xblocks, xq, xd, xs, b] = Int8Call(a, m0, n);
  const __m256i nib = _mm256_set1_epi8(15), top = _mm256_set1_epi8(0x30), off = _mm256_set1_epi8(32);
  // xd per group (g / 2) for groups 0-7 and 8-15; a vector's two groups' factors in lanes 0-3 and 4-7
  const __m256i pairs_lo = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), pairs_hi = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
  const __m256i spread[4] = {_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3),
                             _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5), _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7)};
  for (int64_t k0 = 0; k0 < K; k0 += 256, b += 210) {
    prefetch_ahead<210>(b);
    __m256i level[8], magnitude[8];
    for (int h = 0; h < 2; ++h) {
      const __m256i q0 = load_ymm(b + 64 * h), q1 = load_ymm(b + 64 * h + 32), t = load_ymm(b + 128 + 32 * h);
      const __m256i u[4] = {
          _mm256_or_si256(_mm256_and_si256(q0, nib), _mm256_and_si256(_mm256_slli_epi16(t, 4), top)),
          _mm256_or_si256(_mm256_and_si256(q1, nib), _mm256_and_si256(_mm256_slli_epi16(t, 2), top)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q0, 4), nib), _mm256_and_si256(t, top)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q1, 4), nib), _mm256_and_si256(_mm256_srli_epi16(t, 2), top))};
      for (int j = 0; j < 4; ++j) {
        level[4 * h + j] = _mm256_sub_epi8(u[j], off);
        magnitude[4 * h + j] = _mm256_sign_epi8(level[4 * h + j], level[4 * h + j]);
      }
    }
    const float d = f16_at(b + 208);
    const __m128i sc = _mm_loadu_si128((const __m128i*)(b + 192));
    const __m256 dsc_lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), _mm256_set1_ps(d));
    const __m256 dsc_hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(sc, sc))),
                                        _mm256_set1_ps(d));   // d * sc_g, as unpack_q6_k's scales
    for (int r = 0; r < R; ++r) {
      const int8_t* x = xq + r * K + k0;
      const __m256 step = _mm256_loadu_ps(xd + r * xblocks + k0 / SKIPPY_XBLOCK);
      const __m256 f[2] = {_mm256_mul_ps(dsc_lo, _mm256_permutevar8x32_ps(step, pairs_lo)),
                           _mm256_mul_ps(dsc_hi, _mm256_permutevar8x32_ps(step, pairs_hi))};
      for (int v = 0; v < 8; ++v) {
        const __m256i isum = dot_s8_avx2(magnitude[v], level[v], load_ymm(x + 32 * v));
        acc[r][v % 2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_permutevar8x32_ps(f[v / 4], spread[v % 4]),
                                        acc[r][v % 2]);
      }
    }
  }
  store_rows_avx2<R>(a, m0, n, acc, nullptr, 1);
}

// The rows of x [m0, m0 + R) against row n of W on int8 activations (the avx2int8 build, a type
// skippy_int8_block_type_avx2 lists); one case per type.
template <int R>
SKIPPY_INLINE bool dot_int8_avx2(const SkippyBlockArgs& a, int64_t m0, int64_t n) {
  switch (a.type) {
    case SKIPPY_GGML_Q4_K: dot_k4_avx2<R, false>(a, m0, n); return true;
    case SKIPPY_GGML_Q5_K: dot_k4_avx2<R, true>(a, m0, n); return true;
    case SKIPPY_GGML_Q6_K: dot_q6_k_avx2<R>(a, m0, n); return true;
    case SKIPPY_GGML_Q8_0: dot_q8_q5_avx2<R, false>(a, m0, n); return true;
    case SKIPPY_GGML_Q5_0: dot_q8_q5_avx2<R, true>(a, m0, n); return true;
  }
  return false;
}

#endif
