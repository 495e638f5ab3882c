// Q4_K / Q5_K blocks' factors for block_kernel_isa.cc, and the AVX-512 Q4_K decode loop, included there
// inside its anonymous namespace (it uses that file's v8f, bytes_to_float, f16_at and kRun, compiled with
// each ISA's flags).
#pragma once

// Q4_K / Q5_K's 6-bit scales and minimums of the 8 sub-blocks, packed in 12 bytes: unpacked 4 at a
// time in 32-bit words (llama.cpp's masks), sc[0..7] then m[0..7].
inline void scales_mins_k4(const uint8_t* q, uint8_t out[16]) {
  constexpr uint32_t k6 = 0x3f3f3f3f, k4 = 0x0f0f0f0f, k2 = 0x03030303;
  uint32_t u[4];
  memcpy(u, q, 12);
  u[3] = ((u[2] >> 4) & k4) | (((u[1] >> 6) & k2) << 4);   // m[4..7]: q[8..11] high, q[4..7] top bits
  const uint32_t m_lo = u[1] & k6;                          // m[0..3]
  u[1] = (u[2] & k4) | (((u[0] >> 6) & k2) << 4);           // sc[4..7]: q[8..11] low, q[0..3] top bits
  u[2] = m_lo;
  u[0] &= k6;                                               // sc[0..3]
  memcpy(out, u, 16);
}

// A Q4_K / Q5_K block's 8 factors d * sc_j and dmin * m_j (b: the block). With AVX2 the 12 bytes are
// unpacked in one xmm (two byte shuffles line each scale's bits up, masks and 16-bit shifts keep them)
// and both f16 converted at once: ~15 vector ops where the scalar words took ~35 and the moves between the
// register files. The same integers and products, so the same factors. Q4_K decode, one thread, 1024x2048
// in L2: AVX-512's dot_q4_k 8.7-8.8 -> 9.5-9.7 GB/s; AVX2 no change measured (its runs bind there).
inline void k4_factors(const uint8_t* b, v8f& sc, v8f& mn) {
#if defined(__AVX2__)
  const __m128i q = _mm_loadu_si128((const __m128i*)(b + 4));   // (12 bytes used; the block has 128 more)
  // bytes 0-3 sc[0..3], 4-7 sc[4..7], 8-11 m[0..3], 12-15 m[4..7] (llama.cpp's get_scale_min_k4)
  const __m128i x = _mm_shuffle_epi8(q, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
  const __m128i y = _mm_shuffle_epi8(q, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
  const __m128i low = _mm_and_si128(x, _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0));
  const __m128i high = _mm_and_si128(_mm_srli_epi16(x, 4), _mm_setr_epi32(0, 0, 0, 0x0f0f0f0f));
  const __m128i top = _mm_and_si128(_mm_srli_epi16(y, 2), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
  const __m128i sm = _mm_or_si128(_mm_or_si128(low, high), top);
  int dd;
  memcpy(&dd, b, 4);
  const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(dd));   // d, dmin
  sc = (v8f)_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm)), _mm256_broadcastss_ps(f));
  mn = (v8f)_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(sm, sm))),
                          _mm256_broadcastss_ps(_mm_movehdup_ps(f)));
#else
  uint8_t sm[16];
  scales_mins_k4(b + 4, sm);
  sc = bytes_to_float<false>(sm) * f16_at(b), mn = bytes_to_float<false>(sm + 8) * f16_at(b + 2);
#endif
}

#if defined(__AVX512F__)
// Q4_K in decode (AVX-512): a 4-bit level has 16 values, so a sub-block's products level * (d * sc) are
// a table of 16 floats (one multiply), and vpermps picks each weight's from its nibble (the low 4 bits of
// each 32-bit index: the low nibbles need no mask). The very products dot_rows forms, in the same chains
// and order, so the results are bit-identical; no levels through L1 and no int -> float conversion.
// kernel_micro 576x1536: M = 1 12.2 -> 19.1 Gweights/s (the Q5_0 panels 21-23), M = 4 6.5 -> 8.5.
template <int R>
void dot_q4_k(const SkippyBlockArgs& a, int64_t m0, int64_t n) {
  vf acc[R][4] = {}, mins[R] = {};
  float tails[R] = {};   // (dot_rows' tails: none here, kept for its exact final sums)
  const int64_t K = a.K, runs_all = K / kRun;
  const float *x = a.x + m0 * K, *xs = a.xsum + m0 * runs_all;
  const uint8_t* b = a.w + n * a.row_bytes;
  const vf iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const __m512i pairs = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  for (int64_t s0 = 0; s0 < runs_all; s0 += 16, b += 144) {
    prefetch_ahead<144>(b);
    alignas(32) float scale[8];
    v8f sc, mn;
    k4_factors(b, sc, mn);
    memcpy(scale, &sc, 32);
    __asm__("" : "+m"(scale));   // broadcast from memory (a load), not by shuffles on port 5 as GCC would
    const vf min = (vf)_mm512_permutexvar_ps(pairs, _mm512_castps256_ps512((__m256)mn));   // per run
    for (int j = 0; j < 4; ++j) {   // 64 weights: 32 bytes, low nibbles (sub-block 2j), then high (2j + 1)
      const __m512i q0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(b + 16 + 32 * j)));
      const __m512i q1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(b + 32 + 32 * j)));
      const __m512 lo = (__m512)(iota * scale[2 * j]), hi = (__m512)(iota * scale[2 * j + 1]);   // the tables
      const vf w[4] = {(vf)_mm512_permutexvar_ps(q0, lo), (vf)_mm512_permutexvar_ps(q1, lo),
                       (vf)_mm512_permutexvar_ps(_mm512_srli_epi32(q0, 4), hi),
                       (vf)_mm512_permutexvar_ps(_mm512_srli_epi32(q1, 4), hi)};
      for (int c = 0; c < 4; ++c)   // run 4 j + c into chain c, as dot_rows
        for (int r = 0; r < R; ++r) acc[r][c] += loadf(x + r * K + (s0 + 4 * j + c) * kRun) * w[c];
    }
    for (int r = 0; r < R; ++r) mins[r] += min * loadf(xs + r * runs_all + s0);
  }
  for (int r = 0; r < R; ++r) {
    vf total = {};
    for (int c = 0; c < 4; ++c) total += acc[r][c];
    a.y[(m0 + r) * a.N + n] = hsum(total) - (hsum(mins[r]) + tails[r]);
  }
}

#endif
