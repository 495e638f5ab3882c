// GGUF blocks read in place, for one instruction set: y[M, N] = x[M, K] @ W.T with W [N, K] held as
// the file's own rows of Q4_K, Q5_K, Q6_K, Q5_0 or Q8_0 blocks, or of the types block_kernel_more_isa.cc
// unpacks (Q3_K, IQ4_XS, IQ4_NL, Q5_1, Q2_K; layout and arguments: quant_kernel.h).
// Built per ISA like quant_kernel_isa.cc, linked with the FFI glue (quant_kernel.cc), which splits
// W's rows over XLA's pool; only the one entry point has external linkage.
//
// The float approach, not llama.cpp's int8 activations: rows of W are unpacked into int8 levels plus
// one float scale (and minimum) per 16 inputs, exactly the factors of gguf-py's dequantiser (d * sc,
// dmin * m): a decode call (at most one tile of x) a row at a time, 256 inputs at a time into L1 right
// before their use; a bigger call a task's SKIPPY_BLOCK_ROWS rows at once, for every tile of x to
// reuse. Then every row of x takes float dot products with them:
//   y[m, n] = sum_s scale[n, s] * (x[m, s] . level[n, s]) - sum_s min[n, s] * xsum[m, s]
// over the 16-input runs s. So a result differs from the f32 product of the dequantised weights only
// by float rounding (the order of the sums), as the QTensor float loops do; the greedy ids of a
// Q4_K_M model stay those of its dequantised weights. Each row of x runs the same operations whatever
// the tile height, so a row's result does not depend on the rows that share its call.
//
// The exceptions, opt-in: the avx512vnni build (SKIPPY_KERNEL_ISA=avx512vnni, never auto) runs the calls
// of every size of the types quant_kernel.h's skippy_int8_block_type lists on int8 activations (x quantised
// per 32 inputs by the glue, quant_kernel.h), one dot_<type>_vnni loop below each, in the decode loops'
// tiles (dot_int8); every other type keeps the float loops there too. The avx2int8 build does the same for
// the types skippy_int8_block_type_avx2 lists, with AVX2's instructions (block_kernel_avx2int8.h).

#include "quant_kernel.h"
#include "quant_kernel_simd.h"
#include "block_kernel_more.h"   // Q3_K, IQ4_XS, IQ4_NL, Q5_1, Q2_K: block_kernel_more_isa.cc

#include <stdlib.h>
#include <string.h>

#include <type_traits>

#define SKIPPY_INLINE inline __attribute__((always_inline))

namespace {

constexpr int kRun = 16;                 // inputs per scale (Q6_K's own; Q4_K / Q5_K / Q5_0 scales repeat)
constexpr int kVecs = kRun / kLanes;     // vectors per run: 1 (AVX-512), 2 (AVX2), 4
constexpr int kChains = 4 / kVecs;       // independent accumulators per row, so FMAs overlap their latency
#if defined(__AVX512F__)
constexpr int kRows = 4;                 // rows of x sharing each scaled weight vector
#else
constexpr int kRows = 2;                 // (16 ymm / xmm registers)
#endif

// Byte vectors (GCC's vector extensions: SSE2 / NEON pairs on any 64-bit CPU, one ymm with AVX2): the
// unpackers below work on 32 levels at a time, a few vector operations per 32 weights where scalar
// loops took one per weight (the unpack was most of a decode step's matrix time, measured).
typedef uint8_t v16u8 __attribute__((vector_size(16)));
typedef uint8_t v32u8 __attribute__((vector_size(32)));
typedef float v8f __attribute__((vector_size(32)));

inline float f16_at(const uint8_t* p) {
  uint16_t h;
  memcpy(&h, p, 2);
#if defined(__F16C__) && defined(__AVX2__)   // (quant_kernel_simd.h includes immintrin.h there)
  return _cvtsh_ss(h);   // one instruction; exact, as the portable conversion is
#else
  return half_to_float(h);
#endif
}

inline v32u8 load32(const uint8_t* p) {
  v32u8 v;
  memcpy(&v, p, 32);
  return v;
}

inline void store32(int8_t* p, const v32u8& v) { memcpy(p, &v, 32); }

// 8 bytes (unsigned or signed) -> 8 floats, in registers (GCC's generic convert extracts them one by one).
template <bool kSigned>
inline v8f bytes_to_float(const uint8_t* p) {
#if defined(__AVX2__)
  const __m128i b = _mm_loadl_epi64((const __m128i*)p);
  return (v8f)_mm256_cvtepi32_ps(kSigned ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
#else
  v8f out;
  for (int i = 0; i < 8; ++i) out[i] = kSigned ? (float)(int8_t)p[i] : (float)p[i];
  return out;
#endif
}

// 8 per-32-input factors -> the 16 per-run floats (each run of a sub-block shares its factor).
inline void spread_pairs(v8f f, float* out) {
  const v8f lo = __builtin_shufflevector(f, f, 0, 0, 1, 1, 2, 2, 3, 3);
  const v8f hi = __builtin_shufflevector(f, f, 4, 4, 5, 5, 6, 6, 7, 7);
  memcpy(out, &lo, 32), memcpy(out + 8, &hi, 32);
}

// A row of W unpacked: levels [K], scale and minimum per run [K / 16].
struct Unpacked {
  int8_t* level;
  float* scale;
  float* min;
};

#include "block_kernel_k4.h"   // Q4_K / Q5_K blocks' factors, AVX-512 dot_q4_k (in this namespace: v8f, f16_at)

// 256 weights: d * sc_j * q - dmin * m_j per 32-input sub-block j; Q5_K adds qh's bit j as q's fifth bit.
template <bool kFive, bool kSpreadScale = true>
SKIPPY_INLINE void unpack_k4(const uint8_t* __restrict b, int8_t* __restrict level, float* scale, float* min) {
  const uint8_t* qs = b + (kFive ? 48 : 16);
  const v32u8 qh = kFive ? load32(b + 16) : v32u8{};
  for (int j = 0; j < 4; ++j) {
    const v32u8 q = load32(qs + 32 * j);
    v32u8 lo = q & 15, hi = q >> 4;
    if (kFive) {   // a byte compare, not byte shifts (x86 has none: GCC emulates them)
      lo |= (v32u8)((qh & (uint8_t)(1 << (2 * j))) != 0) & 16;
      hi |= (v32u8)((qh & (uint8_t)(2 << (2 * j))) != 0) & 16;
    }
    store32(level + 64 * j, lo), store32(level + 64 * j + 32, hi);
  }
  v8f sc, mn;
  k4_factors(b, sc, mn);
  if (kSpreadScale) spread_pairs(sc, scale);
  else memcpy(scale, &sc, 32);   // per sub-block (dot_blocks' Q4_K indexes it so)
  spread_pairs(mn, min);
}

// 256 weights in two halves of 128: d * sc_r * (q - 32), q's low 4 bits in ql, high 2 in qh.
SKIPPY_INLINE void unpack_q6_k(const uint8_t* __restrict b, int8_t* __restrict level, float* scale) {
  const uint8_t *ql = b, *qh = b + 128;
#if defined(__AVX512BW__)
  // A half's 128 levels in two zmm: 16-bit shifts move qh's pairs to bits 4-5 of their own bytes (the
  // bits a shift carries over from the next byte are masked off), one ternary-logic op merges them with
  // the nibbles: 9 ops a half where the byte vectors below take ~24 ymm ops (Q6_K's decode ~1.4x faster).
  const __m512i nib = _mm512_set1_epi8(15), two = _mm512_set1_epi8(0x30), off = _mm512_set1_epi8(32);
  const __m512i up = _mm512_set_epi64(2, 2, 2, 2, 4, 4, 4, 4) * 0x0001000100010001;   // words: << 4, then << 2
  const __m512i down = _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0) * 0x0001000100010001;
  for (int h = 0; h < 2; ++h, ql += 64, qh += 32, level += 128) {
    const __m512i a = _mm512_loadu_si512(ql), t = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)qh));
    // (x | (y & 0x30)): ternary-logic table 0xF8 over (x, y, 0x30)
    const __m512i lo = _mm512_ternarylogic_epi32(_mm512_and_si512(a, nib), _mm512_sllv_epi16(t, up), two, 0xF8);
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(a, 4), nib),
                                                 _mm512_srlv_epi16(t, down), two, 0xF8);
    _mm512_storeu_si512(level, _mm512_sub_epi8(lo, off));   // levels 0..63: ql's low nibbles
    _mm512_storeu_si512(level + 64, _mm512_sub_epi8(hi, off));   // 64..127: the high ones
  }
#elif defined(__AVX2__)
  // the same with ymm and no ternary logic: 16-bit shifts, each byte's own bits kept by the masks
  const __m256i nib = _mm256_set1_epi8(15), two = _mm256_set1_epi8(0x30), off = _mm256_set1_epi8(32);
  for (int h = 0; h < 2; ++h, ql += 64, qh += 32, level += 128) {
    const __m256i a = _mm256_loadu_si256((const __m256i*)ql), c = _mm256_loadu_si256((const __m256i*)(ql + 32));
    const __m256i t = _mm256_loadu_si256((const __m256i*)qh);
    auto put = [&](int at, __m256i q, __m256i bits) __attribute__((always_inline)) {
      const __m256i v = _mm256_or_si256(_mm256_and_si256(q, nib), _mm256_and_si256(bits, two));
      _mm256_storeu_si256((__m256i*)(level + at), _mm256_sub_epi8(v, off));
    };
    put(0, a, _mm256_slli_epi16(t, 4)), put(32, c, _mm256_slli_epi16(t, 2));
    put(64, _mm256_srli_epi16(a, 4), t), put(96, _mm256_srli_epi16(c, 4), _mm256_srli_epi16(t, 2));
  }
#else
  for (int h = 0; h < 2; ++h, ql += 64, qh += 32, level += 128) {
    const v32u8 a = load32(ql), c = load32(ql + 32), t = load32(qh);
    store32(level, ((a & 15) | ((t & 3) << 4)) - 32);   // (wrapping: the int8 levels)
    store32(level + 32, ((c & 15) | (((t >> 2) & 3) << 4)) - 32);
    store32(level + 64, ((a >> 4) | (((t >> 4) & 3) << 4)) - 32);
    store32(level + 96, ((c >> 4) | (((t >> 6) & 3) << 4)) - 32);
  }
#endif
  const float d = f16_at(b + 208);
  const v8f flo = bytes_to_float<true>(b + 192) * d, fhi = bytes_to_float<true>(b + 200) * d;
  memcpy(scale, &flo, 32), memcpy(scale + 8, &fhi, 32);
}

#if defined(__AVX2__)
// Byte i all ones where bit i of the 32 bits at p is set (llama.cpp's bytes_from_bits_32).
inline __m256i bytes_from_bits(const uint8_t* p) {
  uint32_t bits;
  memcpy(&bits, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                             _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                               0x0101010101010101, 0x0000000000000000));
  return _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)), _mm256_set1_epi64x(-1));
}

// 32 weights: d * (q - 16), q's fifth bit i in the u32 qh: q - 16 where the bit is clear, else q's low
// 4 bits as they are (a mask register with AVX-512, a byte mask with AVX2).
SKIPPY_INLINE void unpack_q5_0(const uint8_t* __restrict b, int8_t* __restrict level, float* scale) {
  const __m128i q = _mm_loadu_si128((const __m128i*)(b + 6)), low = _mm_set1_epi8(15);
  const __m256i v = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), low), _mm_and_si128(q, low));
  const __m256i sixteen = _mm256_set1_epi8(16);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  uint32_t qh;
  memcpy(&qh, b + 2, 4);
  _mm256_storeu_si256((__m256i*)level, _mm256_mask_sub_epi8(v, (__mmask32)~qh, v, sixteen));
#else
  _mm256_storeu_si256((__m256i*)level, _mm256_sub_epi8(v, _mm256_andnot_si256(bytes_from_bits(b + 2), sixteen)));
#endif
  scale[0] = scale[1] = f16_at(b);
}
#else
// Byte i of kSpread[b] is 16 if bit i of b is set, else 0: a Q5_0 fifth bit, placed, 8 at a time.
struct Spread {
  uint64_t of[256];
  constexpr Spread() : of() {
    for (int b = 0; b < 256; ++b)
      for (int i = 0; i < 8; ++i) of[b] |= (uint64_t)((b >> i) & 1) << (8 * i + 4);
  }
};
constexpr Spread kSpread;

// 32 weights: d * (q - 16), q's fifth bit i in the u32 qh.
SKIPPY_INLINE void unpack_q5_0(const uint8_t* __restrict b, int8_t* __restrict level, float* scale) {
  const uint64_t spread[4] = {kSpread.of[b[2]], kSpread.of[b[3]], kSpread.of[b[4]], kSpread.of[b[5]]};
  v16u8 qs, h0, h1;
  memcpy(&qs, b + 6, 16), memcpy(&h0, spread, 16), memcpy(&h1, spread + 2, 16);
  const v16u8 lo = ((qs & 15) | h0) - 16, hi = ((qs >> 4) | h1) - 16;   // (wrapping: the int8 levels)
  memcpy(level, &lo, 16), memcpy(level + 16, &hi, 16);
  scale[0] = scale[1] = f16_at(b);
}
#endif

// 32 weights: d * q, q the block's own int8 levels.
SKIPPY_INLINE void unpack_q8_0(const uint8_t* __restrict b, int8_t* __restrict level, float* scale) {
  memcpy(level, b + 2, 32);
  scale[0] = scale[1] = f16_at(b);
}

inline bool has_min(int32_t type) {
  return type == SKIPPY_GGML_Q4_K || type == SKIPPY_GGML_Q5_K || skippy_more_has_min(type);
}

// Inputs per chunk: a row of W is unpacked and used a chunk at a time (one K block, or 8 of 32), so the
// chain of run s is s % kChains in every chunk (16 runs) and the minimums' vectors are whole.
constexpr int64_t kChunk = 256;

// Weights [k0, k0 + count) of a row (k0 and count multiples of the type's block), unpacked into u.
// The bounds are locals: stores through int8_t* may alias anything, so a bound read from the args in
// the loop was reloaded, and its division redone, per block (40% of a Q8_0 call, measured).
template <int kBlock, int kBytes, class Unpack>
SKIPPY_INLINE void unpack_blocks(const uint8_t* row, int64_t k0, int64_t count, Unpacked u, Unpack unpack) {
  row += k0 / kBlock * kBytes;
  for (int64_t i = 0; i < count / kBlock; ++i, row += kBytes)
    unpack(row, u.level + i * kBlock, u.scale + i * (kBlock / kRun), u.min + i * (kBlock / kRun));
}

SKIPPY_INLINE void unpack_span(int32_t type, const uint8_t* row, int64_t k0, int64_t count, Unpacked u) {
  int64_t more_block, more_bytes;   // Q3_K, IQ4_XS, IQ4_NL, Q5_1, Q2_K: block_kernel_more_isa.cc
  if (skippy_more_block(type, &more_block, &more_bytes))
    return skippy_unpack_more(type, row, k0, count, u.level, u.scale, u.min);
  switch (type) {
    case SKIPPY_GGML_Q4_K: return unpack_blocks<256, 144>(row, k0, count, u, unpack_k4<false>);
    case SKIPPY_GGML_Q5_K: return unpack_blocks<256, 176>(row, k0, count, u, unpack_k4<true>);
    case SKIPPY_GGML_Q6_K:
      return unpack_blocks<256, 210>(row, k0, count, u, [](const uint8_t* b, int8_t* l, float* s, float*)
                                                            __attribute__((always_inline)) { unpack_q6_k(b, l, s); });
    case SKIPPY_GGML_Q8_0:
      return unpack_blocks<32, 34>(row, k0, count, u, [](const uint8_t* b, int8_t* l, float* s, float*)
                                                          __attribute__((always_inline)) { unpack_q8_0(b, l, s); });
    default:
      return unpack_blocks<32, 22>(row, k0, count, u, [](const uint8_t* b, int8_t* l, float* s, float*)
                                                          __attribute__((always_inline)) { unpack_q5_0(b, l, s); });
  }
}

void unpack_row(const SkippyBlockArgs& a, const uint8_t* row, Unpacked u) { unpack_span(a.type, row, 0, a.K, u); }

// y[m0 .. m0 + R, n] for one row of W, whose chunks `chunk(k0)` hands over unpacked (from a staged row,
// or unpacked there and then): per row of x the same operations whatever R is and wherever the
// chunks come from, so a row's result depends neither on the rows that share its call nor on M.
template <int R, class Chunk>
SKIPPY_INLINE void dot_rows(const SkippyBlockArgs& a, int64_t m0, int64_t n, Chunk chunk) {
  vf acc[R][kChains][kVecs] = {}, mins[R] = {};
  float tails[R] = {};
  const int64_t K = a.K, runs_all = K / kRun;
  const bool with_min = has_min(a.type);
  const float *x = a.x + m0 * K, *xs = a.xsum + m0 * runs_all;
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    const Unpacked u = chunk(k0);
    const int64_t runs = (K - k0 < kChunk ? K - k0 : kChunk) / kRun, s0 = k0 / kRun;
    // run j into chain c; c is a constant wherever this is inlined (a run-time index keeps acc in memory)
    auto step = [&](int64_t j, int c) __attribute__((always_inline)) {
      vf w[kVecs];
      for (int v = 0; v < kVecs; ++v) w[v] = widen_s8(u.level + j * kRun + v * kLanes) * u.scale[j];
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < kVecs; ++v) acc[r][c][v] += loadf(x + r * K + (s0 + j) * kRun + v * kLanes) * w[v];
    };
    int64_t j = 0;
    for (; j + kChains <= runs; j += kChains)
      for (int c = 0; c < kChains; ++c) step(j + c, c);
    for (int c = 0; c < kChains; ++c)   // a last chunk of 32-blocks may hold fewer than kChains runs
      if (j + c < runs) step(j + c, c);
    if (with_min) {   // whole vectors, then the runs a last chunk of 32-blocks leaves (Q5_1, K = 576)
      int64_t i = 0;
      for (; i + kLanes <= runs; i += kLanes)
        for (int r = 0; r < R; ++r) mins[r] += loadf(u.min + i) * loadf(xs + r * runs_all + s0 + i);
      for (; i < runs; ++i)
        for (int r = 0; r < R; ++r) tails[r] += u.min[i] * xs[r * runs_all + s0 + i];
    }
  }
  for (int r = 0; r < R; ++r) {
    vf total = {};
    for (int c = 0; c < kChains; ++c)
      for (int v = 0; v < kVecs; ++v) total += acc[r][c][v];
    float y = hsum(total);
    if (with_min) y -= hsum(mins[r]) + tails[r];
    a.y[(m0 + r) * a.N + n] = y;
  }
}

// A decode call (one tile of x): each chunk of a row of W unpacked into L1 just before its use, so the
// loads of W overlap the arithmetic and nothing is staged.
template <int R>
void dot_unpacking(const SkippyBlockArgs& a, int64_t m0, int64_t n) {
  alignas(64) int8_t level[kChunk];
  alignas(64) float scale[kChunk / kRun], min[kChunk / kRun];
  const int32_t type = a.type;
  const int64_t K = a.K;
  const uint8_t* row = a.w + n * a.row_bytes;
  dot_rows<R>(a, m0, n, [&](int64_t k0) __attribute__((always_inline)) {
    const Unpacked u{level, scale, min};
    unpack_span(type, row, k0, K - k0 < kChunk ? K - k0 : kChunk, u);
    return u;
  });
}

// Q6_K (every ISA) and Q4_K (where dot_q4_k is not) in decode: a block's levels unpacked into L1 and
// read back widened, as dot_rows does, without its type switch and chunk bookkeeping between blocks,
// the scales broadcast from memory; the same products in the same chains and order (bit-identical).
// kernel_micro 576x1536, M = 1: Q6_K avx512 11.0 -> 14.9 Gweights/s, avx2 8.7 -> 11.8; Q4_K avx2 10.3 -> 12.3.
// The 16 runs unrolled (no loop counter, constant offsets) and Q4_K's scales broadcast per 32-input
// sub-block (kScaleShift 1: unpack_k4 need not spread them): AVX2 Q4_K, one thread, 1024x2048 in L2
// 5.7-6.0 -> 6.3-6.6 GB/s; 64 copies of 2048x2048 out of cache 4.8-5.3 -> 5.4-5.8 (load 5-6).
// Each block is unpacked into L1 one block ahead of its use (two buffers): the widening loads then read
// bytes stored a block's work earlier, not ones still in flight from the stores just before. One thread,
// CPU time, A/B taking turns, load 7-10: Q6_K AVX-512 30 copies of 2048x8192 7.6-8.2 -> 8.2-8.5 GB/s,
// 512x2048 in L2 10.6 -> 11.0-11.5; AVX2 7.3-7.7 -> 7.7-8.0, SmolLM2's 576x1536 6.9-7.1 -> 7.1-7.2; AVX2
// Q4_K out of cache 6.3 -> 6.3-6.45. The same operations on the same bytes: bit-identical.
template <int R, int kBytes, bool kMin, class Unpack, int kScaleShift = 0>
void dot_blocks(const SkippyBlockArgs& a, int64_t m0, int64_t n, Unpack unpack) {
  vf acc[R][kChains][kVecs] = {}, mins[R] = {};
  float tails[R] = {};   // (dot_rows' tails: none with 256-blocks, kept for its exact final sums)
  const int64_t K = a.K, runs_all = K / kRun;
  const float *x = a.x + m0 * K, *xs = a.xsum + m0 * runs_all;
  const uint8_t* b = a.w + n * a.row_bytes;
  alignas(64) int8_t levels[2][256];
  alignas(64) float scales[2][16], shifts[2][16];   // (shifts: a block's minimums, the types with them)
  unpack(b, levels[0], scales[0], shifts[0]);
  for (int64_t s0 = 0; s0 < runs_all; s0 += 16, b += kBytes) {
    const int cur = (s0 / 16) & 1;
    prefetch_ahead<kBytes>(b);
    if (s0 + 16 < runs_all) unpack(b + kBytes, levels[cur ^ 1], scales[cur ^ 1], shifts[cur ^ 1]);   // a block ahead
    __asm__("" : "+m"(levels), "+m"(scales));   // widen and broadcast from memory: loads, not shuffles
    const int8_t* level = levels[cur];
    const float *scale = scales[cur], *min = shifts[cur];
#pragma GCC unroll 16
    for (int j = 0; j < 16; j += kChains)
      for (int c = 0; c < kChains; ++c) {
        vf w[kVecs];
        for (int v = 0; v < kVecs; ++v) w[v] = widen_s8(level + (j + c) * kRun + v * kLanes) * scale[(j + c) >> kScaleShift];
        for (int r = 0; r < R; ++r)
          for (int v = 0; v < kVecs; ++v) acc[r][c][v] += loadf(x + r * K + (s0 + j + c) * kRun + v * kLanes) * w[v];
      }
    if (kMin)
      for (int i = 0; i < 16; i += kLanes)
        for (int r = 0; r < R; ++r) mins[r] += loadf(min + i) * loadf(xs + r * runs_all + s0 + i);
  }
  for (int r = 0; r < R; ++r) {
    vf total = {};
    for (int c = 0; c < kChains; ++c)
      for (int v = 0; v < kVecs; ++v) total += acc[r][c][v];
    float y = hsum(total);
    if (kMin) y -= hsum(mins[r]) + tails[r];
    a.y[(m0 + r) * a.N + n] = y;
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
// Q4_K with int8 activations (only the avx512vnni build compiles this; BlockDense sets a.xq for every
// Q4_K call there). x is quantised per 32 inputs, one Q4_K sub-block:
// x[m, k] ~ xq[m, k] * xd[m, s], xs[m, s] the block's exact float sum, so
//   y[m, n] = sum_s (d * sc_s) * xd[m, s] * isum[m, s] - sum_s (dmin * m_s) * xs[m, s]
// with isum[m, s] = sum of level * xq over the sub-block, exact in int32: vpdpbusd, the 4-bit levels the
// unsigned operand and xq the signed one (at most 32 * 15 * 127 in magnitude: no overflow).
// A zmm of 64 nibble bytes holds two j's of 32 bytes: its low nibbles are sub-blocks 2j and 2j + 2, its
// high ones 2j + 1 and 2j + 3, so lanes 0-7 of a vpdpbusd sum one sub-block and lanes 8-15 the other,
// against x's bytes of those two sub-blocks (two 32-byte halves, 64 apart, in one zmm). The int32 lanes
// are converted and multiplied, in an FMA, by their sub-block's d * sc_s * xd[m, s] (one 8-wide product,
// spread to the lanes by vpermps); the minimums are one 8-wide FMA per super-block. Each row of x runs
// the same float operations in the same order whatever R is, so its result does not depend on the rows
// that share its call (nor on which of the 4-, 2- and 1-row tiles it lands in).
// Q5_K (kFive) is the same block with qs 32 bytes later and qh [32] before it: byte l of qh holds the fifth
// bit of weight l of each sub-block s (bit s), added to the level vectors as 16 under a byte mask (vptestmb
// against the two sub-blocks' bits of each level vector); levels 0..31, so |isum| <= 32 * 31 * 127.
template <int R, bool kFive = false>
void dot_q4_k_vnni(const SkippyBlockArgs& a, int64_t m0, int64_t n) {
  constexpr int kBytes = kFive ? 176 : 144, kQs = kFive ? 48 : 16;   // block size, offset of qs
  __m512 acc[R][2];
  __m256 mins[R];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps(), mins[r] = _mm256_setzero_ps();
  const int64_t K = a.K, xblocks = K / SKIPPY_XBLOCK;
  const int8_t* xq = a.xq + m0 * K;
  const float *xd = a.xd + m0 * xblocks, *xs = a.xs + m0 * xblocks;
  const uint8_t* b = a.w + n * a.row_bytes;
  const __m512i nib = _mm512_set1_epi8(15);
  // the sub-block of each lane for the 4 level vectors: (0 | 2), (1 | 3), (4 | 6), (5 | 7)
  const __m512i lane_sub[4] = {_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2),
                               _mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3),
                               _mm512_setr_epi32(4, 4, 4, 4, 4, 4, 4, 4, 6, 6, 6, 6, 6, 6, 6, 6),
                               _mm512_setr_epi32(5, 5, 5, 5, 5, 5, 5, 5, 7, 7, 7, 7, 7, 7, 7, 7)};
  // Q5_K: the qh bit of each level vector's byte, per half (its two sub-blocks): (0 | 2), (1 | 3), (4 | 6), (5 | 7)
  auto bits = [](char lo, char hi) { return _mm512_mask_blend_epi64(0xF0, _mm512_set1_epi8(lo), _mm512_set1_epi8(hi)); };
  const __m512i fifth[4] = {bits(1, 4), bits(2, 8), bits(16, 64), bits(32, (char)128)};
  for (int64_t k0 = 0; k0 < K; k0 += 256, b += kBytes) {
    prefetch_ahead<kBytes>(b);
    v8f sc, mn;
    k4_factors(b, sc, mn);
    const __m512i q0 = _mm512_loadu_si512(b + kQs), q1 = _mm512_loadu_si512(b + kQs + 64);
    __m512i level[4] = {_mm512_and_si512(q0, nib), _mm512_and_si512(_mm512_srli_epi16(q0, 4), nib),
                        _mm512_and_si512(q1, nib), _mm512_and_si512(_mm512_srli_epi16(q1, 4), nib)};
    if (kFive) {
      const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(b + 16))), sixteen = _mm512_set1_epi8(16);
      for (int c = 0; c < 4; ++c)
        level[c] = _mm512_mask_add_epi8(level[c], _mm512_test_epi8_mask(qh, fifth[c]), level[c], sixteen);
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* x = xq + r * K + k0;
      const int64_t at = r * xblocks + k0 / SKIPPY_XBLOCK;
      const __m512 f = _mm512_castps256_ps512(_mm256_mul_ps((__m256)sc, _mm256_loadu_ps(xd + at)));   // 8 lanes used
      for (int c = 0; c < 4; ++c) {   // x's bytes of sub-blocks (c / 2) * 4 + c % 2 and + 2: 64 apart
        const int8_t* xc = x + 128 * (c / 2) + 32 * (c % 2);
        const __m512i xv = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)xc)),
                                              _mm256_loadu_si256((const __m256i*)(xc + 64)), 1);
        const __m512i isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), level[c], xv);
        acc[r][c % 2] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_permutexvar_ps(lane_sub[c], f), acc[r][c % 2]);
      }
      mins[r] = _mm256_fmadd_ps((__m256)mn, _mm256_loadu_ps(xs + at), mins[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m256 m4 = _mm256_add_ps(mins[r], _mm256_permute2f128_ps(mins[r], mins[r], 1));
    const __m128 m2 = _mm_add_ps(_mm256_castps256_ps128(m4), _mm_movehl_ps(_mm256_castps256_ps128(m4), _mm256_castps256_ps128(m4)));
    const float min_sum = _mm_cvtss_f32(_mm_add_ss(m2, _mm_movehdup_ps(m2)));
    a.y[(m0 + r) * a.N + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1])) - min_sum;
  }
}

// Q6_K with int8 activations (the avx512vnni build; BlockDense sets a.xq for every Q6_K call there). x is
// quantised per 32 inputs as for Q4_K, two of Q6_K's 16-input groups g per x block:
//   y[m, n] = sum_g (d * sc_g) * xd[m, g / 2] * isum[m, g],  isum[m, g] = sum over g of (q - 32) * xq
// exact in int32. vpdpbusd takes its unsigned operand from x (xq ^ 0x80 = xq + 128, 1..255) and its signed
// one from the levels q - 32 (-32..31); each int32 lane sums 4 products, and starts from the row of W's own
// correction -128 * sum (q - 32) over its 4 bytes (one vpdpbusd of q against -128 bytes from 16384 per
// lane, shared by the R rows of x), so the lane ends holding its exact part of isum. Bounds: the
// products' sum at most 4 * 255 * 32 = 32640 in magnitude, the correction 16384, the result 4 * 127 * 32:
// far inside int32. A half's 6-bit levels in two zmm as unpack_q6_k builds them (levels 0..63 and 64..127
// of the half, in order, without the - 32), so each zmm meets 64 consecutive bytes of xq: lanes 4i..4i+3
// are group 4c + i (c the zmm of the block). The int32 lanes are converted and multiplied, in an FMA, by
// their group's d * sc_g * xd[m, g / 2] (16 products a block, spread to the lanes by vpermps), into 2
// accumulators per row; a horizontal sum at the end. Each row of x runs the same float operations in the
// same order whatever R is (the shared correction is integer, exact), so its result does not depend on the
// rows that share its call.
template <int R>
void dot_q6_k_vnni(const SkippyBlockArgs& a, int64_t m0, int64_t n) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int64_t K = a.K, xblocks = K / SKIPPY_XBLOCK;
  const int8_t* xq = a.xq + m0 * K;
  const float* xd = a.xd + m0 * xblocks;
  const uint8_t* b = a.w + n * a.row_bytes;
  const __m512i nib = _mm512_set1_epi8(15), two = _mm512_set1_epi8(0x30), off = _mm512_set1_epi8(32);
  const __m512i up = _mm512_set_epi64(2, 2, 2, 2, 4, 4, 4, 4) * 0x0001000100010001;   // (unpack_q6_k's shifts)
  const __m512i down = _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0) * 0x0001000100010001;
  const __m512i bias = _mm512_set1_epi8((char)0x80), minus128 = _mm512_set1_epi8(-128), base = _mm512_set1_epi32(16384);
  const __m512i pairs = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);   // xd per group
  // the group of each lane for the 4 level vectors of a block: 4c + lane / 4
  const __m512i lane_group[4] = {_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                 _mm512_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7),
                                 _mm512_setr_epi32(8, 8, 8, 8, 9, 9, 9, 9, 10, 10, 10, 10, 11, 11, 11, 11),
                                 _mm512_setr_epi32(12, 12, 12, 12, 13, 13, 13, 13, 14, 14, 14, 14, 15, 15, 15, 15)};
  for (int64_t k0 = 0; k0 < K; k0 += 256, b += 210) {
    prefetch_ahead<210>(b);
    __m512i level[4], corr[4];
    for (int h = 0; h < 2; ++h) {
      const __m512i q = _mm512_loadu_si512(b + 64 * h);
      const __m512i t = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(b + 128 + 32 * h)));
      const __m512i lo = _mm512_ternarylogic_epi32(_mm512_and_si512(q, nib), _mm512_sllv_epi16(t, up), two, 0xF8);
      const __m512i hi = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(q, 4), nib),
                                                   _mm512_srlv_epi16(t, down), two, 0xF8);
      corr[2 * h] = _mm512_dpbusd_epi32(base, lo, minus128), corr[2 * h + 1] = _mm512_dpbusd_epi32(base, hi, minus128);
      level[2 * h] = _mm512_sub_epi8(lo, off), level[2 * h + 1] = _mm512_sub_epi8(hi, off);
    }
    const __m512 dsc = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 192)))),
                                     _mm512_set1_ps(f16_at(b + 208)));   // d * sc_g, as unpack_q6_k's scales
    for (int r = 0; r < R; ++r) {
      const int8_t* x = xq + r * K + k0;
      const __m256 step = _mm256_loadu_ps(xd + r * xblocks + k0 / SKIPPY_XBLOCK);   // the block's 8 xd
      const __m512 f = _mm512_mul_ps(dsc, _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(step)));
      for (int c = 0; c < 4; ++c) {
        const __m512i xu = _mm512_xor_si512(_mm512_loadu_si512(x + 64 * c), bias);
        const __m512i isum = _mm512_dpbusd_epi32(corr[c], xu, level[c]);
        acc[r][c % 2] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_permutexvar_ps(lane_group[c], f), acc[r][c % 2]);
      }
    }
  }
  for (int r = 0; r < R; ++r) a.y[(m0 + r) * a.N + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}

// Q3_K and Q2_K with int8 activations (the avx512vnni build; BlockDense sets a.xq for every call of these
// types there). Both hold 16 groups g of 16 weights a block with a scale each, so they sum as Q6_K does:
// two groups per x block of 32, isum[m, g] exact in int32, then (d * sc_g) * xd[m, g / 2] in float.
// A block's 256 2-bit fields q (both types) in four zmm, zmm c = weights 64c .. 64c + 63 in order: weight
// 128h + 32j + l is bits 2j .. 2j + 1 of qs[32h + l], so zmm c is half h = c / 2 of qs (broadcast to both
// 32-byte halves) shifted right by 4 (c % 2) in bytes 0-31 and 4 (c % 2) + 2 in bytes 32-63, then & 3
// (16-bit shifts: the bits carried over from the next byte are masked off).
SKIPPY_INLINE void two_bit_fields(const uint8_t* qs, __m512i field[4]) {
  const __m512i three = _mm512_set1_epi8(3);
  const __m512i shift[2] = {_mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0) * 0x0001000100010001,
                            _mm512_set_epi64(6, 6, 6, 6, 4, 4, 4, 4) * 0x0001000100010001};
  for (int c = 0; c < 4; ++c) {
    const __m512i t = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(qs + 32 * (c / 2))));
    field[c] = _mm512_and_si512(_mm512_srlv_epi16(t, shift[c % 2]), three);
  }
}

// One row of x (its xq and xd from the block's first input) against a block of 16 groups as four zmm of
// 64 levels in order, zmm c's int32 lanes 4i .. 4i + 3 summing group 4c + i (4 bytes each): each vpdpbusd
// lane starts from start[c] (Q3_K: W's correction, Q2_K: zero) and adds its 4 products, the unsigned
// operand xq ^ 0x80 = xq + 128 with signed levels (kBiasX) or the levels with xq signed. The lanes are
// converted and multiplied, in an FMA, by their group's dsc_g * xd[g / 2] (spread by vpermps) into acc[c % 2].
template <bool kBiasX>
SKIPPY_INLINE void groups_vnni(const int8_t* x, const float* xd, const __m512i level[4], const __m512i start[4],
                               __m512 dsc, __m512 acc[2]) {
  const __m512i bias = _mm512_set1_epi8((char)0x80);
  const __m512i pairs = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);   // xd per group
  const __m512i lane_group[4] = {_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                 _mm512_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7),
                                 _mm512_setr_epi32(8, 8, 8, 8, 9, 9, 9, 9, 10, 10, 10, 10, 11, 11, 11, 11),
                                 _mm512_setr_epi32(12, 12, 12, 12, 13, 13, 13, 13, 14, 14, 14, 14, 15, 15, 15, 15)};
  const __m512 f = _mm512_mul_ps(dsc, _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(_mm256_loadu_ps(xd))));
  for (int c = 0; c < 4; ++c) {
    const __m512i xv = _mm512_loadu_si512(x + 64 * c);
    const __m512i isum = kBiasX ? _mm512_dpbusd_epi32(start[c], _mm512_xor_si512(xv, bias), level[c])
                                : _mm512_dpbusd_epi32(start[c], level[c], xv);
    acc[c % 2] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_permutexvar_ps(lane_group[c], f), acc[c % 2]);
  }
}

// Q3_K's 16 group factors d * (sc_g - 32), as unpack_q3_k's scales: 6-bit sc_g, its low 4 bits the low
// (g < 8) or high (g >= 8) nibble of byte g % 8, its high 2 bits bits 2 (g / 4) of byte 8 + g % 4 (a dword
// shift per 4 groups). The 12 bytes by a masked load (a 16-byte one would read past the row's last block).
SKIPPY_INLINE __m512 q3_k_factors(const uint8_t* b) {
  const __m128i s = _mm_maskz_loadu_epi8(0x0FFF, b + 96), nib = _mm_set1_epi8(15);
  const __m128i low = _mm_and_si128(_mm_unpacklo_epi64(s, _mm_srli_epi16(s, 4)), nib);
  const __m128i top = _mm_shuffle_epi8(s, _mm_setr_epi8(8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11));
  const __m128i high = _mm_slli_epi32(_mm_and_si128(_mm_srlv_epi32(top, _mm_setr_epi32(0, 2, 4, 6)), _mm_set1_epi8(3)), 4);
  const __m128i sc = _mm_sub_epi8(_mm_or_si128(low, high), _mm_set1_epi8(32));   // -32..31
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)), _mm512_set1_ps(f16_at(b + 108)));
}

// Q3_K (hmask[32], qs[64], scales[12], f16 d): w = d * (sc_g - 32) * level, level = q - 4 where bit 4h + j of
// hmask[l] is clear, q where set (-4..3), so
//   y[m, n] = sum_g (d * (sc_g - 32)) * xd[m, g / 2] * isum[m, g],  isum[m, g] = sum over g of level * xq.
// As dot_q6_k_vnni: u = q + 4 * bit (0..7; zmm c's bytes 0-31 take hmask's bit 2c, 32-63 bit 2c + 1), the
// levels u - 4 the signed operand against xq + 128, each lane starting from W's correction
// -128 * sum (u - 4) over its 4 bytes (one vpdpbusd of u against -128 bytes from 4 * 4 * 128 = 2048, shared
// by the R rows). Bounds: the products' sum at most 4 * 255 * 4 = 4080 in magnitude, the correction 2048,
// the result 4 * 127 * 4: far inside int32. Each row of x runs the same float operations in the same order
// whatever R is (the shared correction is integer, exact), so its result does not depend on its company.
template <int R>
void dot_q3_k_vnni(const SkippyBlockArgs& a, int64_t m0, int64_t n) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int64_t K = a.K, xblocks = K / SKIPPY_XBLOCK;
  const uint8_t* b = a.w + n * a.row_bytes;
  const __m512i four = _mm512_set1_epi8(4), minus128 = _mm512_set1_epi8(-128), base = _mm512_set1_epi32(2048);
  // 16-bit shifts moving hmask's bit 2c (bytes 0-31 of zmm c) and 2c + 1 (32-63) to bit 2 of its own byte
  const __m512i up = _mm512_set_epi64(1, 1, 1, 1, 2, 2, 2, 2) * 0x0001000100010001;   // c = 0
  const __m512i down[3] = {_mm512_set_epi64(1, 1, 1, 1, 0, 0, 0, 0) * 0x0001000100010001,
                           _mm512_set_epi64(3, 3, 3, 3, 2, 2, 2, 2) * 0x0001000100010001,
                           _mm512_set_epi64(5, 5, 5, 5, 4, 4, 4, 4) * 0x0001000100010001};
  for (int64_t k0 = 0; k0 < K; k0 += 256, b += 110) {
    prefetch_ahead<110>(b);
    __m512i level[4], corr[4];
    two_bit_fields(b + 32, level);
    const __m512i hm = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)b));
    for (int c = 0; c < 4; ++c) {   // u = q | (bit & 4): ternary-logic table 0xF8 over (q, bit, 4)
      const __m512i bit = c == 0 ? _mm512_sllv_epi16(hm, up) : _mm512_srlv_epi16(hm, down[c - 1]);
      const __m512i u = _mm512_ternarylogic_epi32(level[c], bit, four, 0xF8);
      corr[c] = _mm512_dpbusd_epi32(base, u, minus128), level[c] = _mm512_sub_epi8(u, four);
    }
    const __m512 dsc = q3_k_factors(b);
    for (int r = 0; r < R; ++r)
      groups_vnni<true>(a.xq + (m0 + r) * K + k0, a.xd + (m0 + r) * xblocks + k0 / SKIPPY_XBLOCK, level, corr, dsc, acc[r]);
  }
  for (int r = 0; r < R; ++r) a.y[(m0 + r) * a.N + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}

// Q2_K (scales[16], qs[64], f16 d, f16 dmin): w = d * (sc_g & 15) * q - dmin * (sc_g >> 4), q 0..3, so
//   y[m, n] = sum_g (d * sc_g) * xd[m, g / 2] * isum[m, g] - sum_g (dmin * m_g) * xsum[m, g]
// with isum[m, g] = sum over g of q * xq: vpdpbusd, the levels the unsigned operand and xq the signed one,
// each lane from zero (at most 4 * 3 * 127 in magnitude, the group 16 * 3 * 127: no overflow). The minimums
// are per 16 inputs, finer than xs: they meet the glue's exact float sums of x per 16 (a.xsum, as the float
// loops), one 16-wide FMA per block and row. Each row of x runs the same float operations in the same order
// whatever R is, so its result does not depend on the rows that share its call.
template <int R>
void dot_q2_k_vnni(const SkippyBlockArgs& a, int64_t m0, int64_t n) {
  __m512 acc[R][2], mins[R];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = mins[r] = _mm512_setzero_ps();
  const int64_t K = a.K, xblocks = K / SKIPPY_XBLOCK, runs = K / 16;
  const uint8_t* b = a.w + n * a.row_bytes;
  const __m512i zero[4] = {};
  for (int64_t k0 = 0; k0 < K; k0 += 256, b += 84) {
    prefetch_ahead<84>(b);
    __m512i level[4];
    two_bit_fields(b + 16, level);
    const __m128i sc = _mm_loadu_si128((const __m128i*)b), nib = _mm_set1_epi8(15);
    const __m512 dsc = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(sc, nib))),
                                     _mm512_set1_ps(f16_at(b + 80)));   // d * sc_g, as unpack_q2_k's
    const __m512 mn = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(sc, 4), nib))),
                                    _mm512_set1_ps(f16_at(b + 82)));    // dmin * m_g
    for (int r = 0; r < R; ++r) {
      groups_vnni<false>(a.xq + (m0 + r) * K + k0, a.xd + (m0 + r) * xblocks + k0 / SKIPPY_XBLOCK, level, zero, dsc, acc[r]);
      mins[r] = _mm512_fmadd_ps(mn, _mm512_loadu_ps(a.xsum + (m0 + r) * runs + k0 / 16), mins[r]);
    }
  }
  for (int r = 0; r < R; ++r)
    a.y[(m0 + r) * a.N + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1])) - _mm512_reduce_add_ps(mins[r]);
}

// IQ4_XS / IQ4_NL with int8 activations: their levels are ggml's kvalues_iq4nl, 16 signed values
// (-127..113) picked by a 4-bit index. iq4_vnni_levels turns 64 bytes of indices, 4 runs of 16 (each run
// one 32-weight block: its low nibbles are weights 0-15, its high nibbles 16-31), into the 128 levels in
// the weights' order: vpermb looks each byte up in the table repeated 4 times (it reads an index's low 6
// bits, so the high nibble's shift needs no mask: bits 4-5 only pick a copy), one vpermt2q interleaves the
// 16-byte halves. level[0] holds blocks 0 and 1 (lanes 0-7, 8-15), level[1] blocks 2 and 3; each meets 64
// consecutive bytes of xq. As for Q6_K the levels are vpdpbusd's signed operand, x its unsigned one (xq ^
// 0x80 = xq + 128, 1..255), and each int32 lane starts from corr = -128 * (the sum of its 4 levels), one
// vpdpbusd of 128-bytes against the levels (negated), shared by the rows of x. Bounds: a lane's 4 products
// at most 4 * 255 * 127 = 129540 in magnitude, corr at most 4 * 128 * 127 = 65024, the result (sum of
// xq * level) at most 4 * 127 * 127: far inside int32.
SKIPPY_INLINE void iq4_vnni_levels(__m512i q, __m512i table, __m512i level[2], __m512i corr[2]) {
  const __m512i lo = _mm512_permutexvar_epi8(q, table), hi = _mm512_permutexvar_epi8(_mm512_srli_epi16(q, 4), table);
  level[0] = _mm512_permutex2var_epi64(lo, _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), hi);
  level[1] = _mm512_permutex2var_epi64(lo, _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15), hi);
  for (int c = 0; c < 2; ++c)
    corr[c] = _mm512_sub_epi32(_mm512_setzero_si512(),
                               _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8((char)0x80), level[c]));
}

// The IQ4 table, 4 times (vpermb's 64 entries).
SKIPPY_INLINE __m512i iq4_table() {
  return _mm512_broadcast_i32x4(_mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113));
}

// An IQ4_XS block's 8 sub-block scales d * (ls_s - 32): ls_s's low 4 bits are nibble s % 2 of scales_l's byte
// s / 2 (bits 4s of its u32), its high 2 bits 2s of scales_h (moved up by 4), each lane shifting its own.
SKIPPY_INLINE __m256 iq4_xs_scales(const uint8_t* b) {
  uint16_t high;
  uint32_t low;
  memcpy(&high, b + 2, 2), memcpy(&low, b + 4, 4);
  const __m256i lo = _mm256_srlv_epi32(_mm256_set1_epi32((int)low), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
  const __m256i hi = _mm256_srlv_epi32(_mm256_set1_epi32(high << 4), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
  const __m256i ls = _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi32(15)), _mm256_and_si256(hi, _mm256_set1_epi32(0x30)));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(ls, _mm256_set1_epi32(32))), _mm256_set1_ps(f16_at(b)));
}

// The rows of x [m0, m0 + R) against 256 weights of IQ4 levels (iq4_vnni_levels: level[c] holds 32-input
// blocks 2c and 2c + 1 in lanes 0-7 and 8-15) whose blocks' float factors are dsc: the int32 lanes of each
// vpdpbusd converted and multiplied, in an FMA, by their block's dsc * xd[m, block] (one 8-wide product per
// row, spread by vpermps), into 2 accumulators per row. With kTail only x's first `blocks` 32-input blocks
// are read (masked loads; the others zero: xq ^ 0x80 = 128, the lane's products exactly -corr, isum 0, and
// their xd 0). Each row runs the same float operations in the same order whatever R is, so its result does
// not depend on the rows that share its call.
template <int R, bool kTail = false>
SKIPPY_INLINE void iq4_rows(const SkippyBlockArgs& a, const __m512i level[4], const __m512i corr[4], __m256 dsc,
                            int64_t m0, int64_t k0, __m512 acc[][2], int blocks = 8) {
  const int64_t K = a.K, xblocks = K / SKIPPY_XBLOCK;
  const __m512i bias = _mm512_set1_epi8((char)0x80);
  const __m512i lane_sub[4] = {_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                               _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3),
                               _mm512_setr_epi32(4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5),
                               _mm512_setr_epi32(6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7)};
  for (int r = 0; r < R; ++r) {
    const int8_t* x = a.xq + (m0 + r) * K + k0;
    const float* step = a.xd + (m0 + r) * xblocks + k0 / SKIPPY_XBLOCK;
    const __m256 s = kTail ? _mm256_maskz_loadu_ps((__mmask8)((1 << blocks) - 1), step) : _mm256_loadu_ps(step);
    const __m512 f = _mm512_castps256_ps512(_mm256_mul_ps(dsc, s));
    for (int c = 0; c < 4; ++c) {
      const int bytes = 32 * blocks - 64 * c;   // (kTail: x's bytes left for this vector)
      const __m512i xv = !kTail || bytes >= 64 ? _mm512_loadu_si512(x + 64 * c)
                                               : _mm512_maskz_loadu_epi8(bytes > 0 ? ((__mmask64)1 << bytes) - 1 : 0, x + 64 * c);
      const __m512i isum = _mm512_dpbusd_epi32(corr[c], _mm512_xor_si512(xv, bias), level[c]);
      acc[r][c % 2] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_permutexvar_ps(lane_sub[c], f), acc[r][c % 2]);
    }
  }
}

// IQ4_XS with int8 activations (the avx512vnni build): x quantised per 32 inputs, one IQ4_XS sub-block s:
//   y[m, n] = sum_s (d * (ls_s - 32)) * xd[m, s] * isum[m, s],  isum[m, s] = sum over s of level * xq
// exact in int32 (iq4_vnni_levels: layout, corrections and bounds). A block's 128 index bytes are two
// iq4_vnni_levels calls, 4 level vectors c of sub-blocks 2c (lanes 0-7) and 2c + 1 (lanes 8-15), and its
// factors d * (ls_s - 32) (iq4_xs_scales) exact in float, as unpack_iq4_xs's scales; iq4_rows takes them
// to every row of x, a horizontal sum at the end.
template <int R>
void dot_iq4_xs_vnni(const SkippyBlockArgs& a, int64_t m0, int64_t n) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const __m512i table = iq4_table();
  const uint8_t* b = a.w + n * a.row_bytes;
  for (int64_t k0 = 0; k0 < a.K; k0 += 256, b += 136) {
    prefetch_ahead<136>(b);
    __m512i level[4], corr[4];
    iq4_vnni_levels(_mm512_loadu_si512(b + 8), table, level, corr);
    iq4_vnni_levels(_mm512_loadu_si512(b + 72), table, level + 2, corr + 2);
    iq4_rows<R>(a, level, corr, iq4_xs_scales(b), m0, k0, acc);
  }
  for (int r = 0; r < R; ++r) a.y[(m0 + r) * a.N + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}

// IQ4_NL with int8 activations (the avx512vnni build): a 32-weight block is one x block, so
//   y[m, n] = sum_b d_b * xd[m, b] * isum[m, b],  isum[m, b] = sum over block b of level * xq
// exact in int32 (iq4_vnni_levels). Eight blocks (144 bytes, 256 weights) a step, as IQ4_XS's: two
// vpermt2b gather their 16-byte index runs out of the 18-byte blocks (blocks 0-3 from bytes 0-127, 4-7
// from 64-143), one vpermt2w their f16 d's; iq4_rows does the rest. K need not be a multiple of 256 (576,
// 96 and 32 are rows of SmolLM2's IQ4_XS file): the last 1-7 blocks run the same step on masked loads, the
// missing blocks' bytes zero (index 0, d 0) and x's too (iq4_rows' kTail).
template <int R, bool kTail>
SKIPPY_INLINE void iq4_nl_step(const SkippyBlockArgs& a, const uint8_t* b, int64_t m0, int64_t k0, int blocks,
                               __m512 acc[][2]) {
  // byte i of blocks 0-3's indices: block i / 16's byte i % 16, at 18 * (i / 16) + 2 + i % 16 of the step
  const __m512i gather = _mm512_set_epi32(0x47464544, 0x43424140, 0x3f3e3d3c, 0x3b3a3938, 0x35343332, 0x31302f2e,
                                          0x2d2c2b2a, 0x29282726, 0x23222120, 0x1f1e1d1c, 0x1b1a1918, 0x17161514,
                                          0x11100f0e, 0x0d0c0b0a, 0x09080706, 0x05040302);
  const __m512i halves = _mm512_castsi128_si512(_mm_setr_epi16(0, 9, 18, 27, 36, 45, 54, 63));   // the d's (words)
  __m512i b0, b1, b2 = _mm512_setzero_si512();
  if (kTail) {   // (126 bytes at most)
    const int bytes = 18 * blocks;
    b0 = _mm512_maskz_loadu_epi8(bytes >= 64 ? ~(__mmask64)0 : ((__mmask64)1 << bytes) - 1, b);
    b1 = _mm512_maskz_loadu_epi8(bytes > 64 ? ((__mmask64)1 << (bytes - 64)) - 1 : 0, b + 64);
  } else {
    b0 = _mm512_loadu_si512(b), b1 = _mm512_loadu_si512(b + 64);
    b2 = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)(b + 128)));
  }
  const __m512i table = iq4_table();
  __m512i level[4], corr[4];
  iq4_vnni_levels(_mm512_permutex2var_epi8(b0, gather, b1), table, level, corr);
  iq4_vnni_levels(_mm512_permutex2var_epi8(b1, _mm512_add_epi8(gather, _mm512_set1_epi8(8)), b2), table, level + 2, corr + 2);
  const __m256 d = _mm256_cvtph_ps(_mm512_castsi512_si128(_mm512_permutex2var_epi16(b0, halves, b1)));
  iq4_rows<R, kTail>(a, level, corr, d, m0, k0, acc, blocks);
}

template <int R>
void dot_iq4_nl_vnni(const SkippyBlockArgs& a, int64_t m0, int64_t n) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int64_t K = a.K;
  const uint8_t* b = a.w + n * a.row_bytes;
  int64_t k0 = 0;
  for (; k0 + 256 <= K; k0 += 256, b += 144) {
    prefetch_ahead<144>(b);
    iq4_nl_step<R, false>(a, b, m0, k0, 8, acc);
  }
  if (k0 < K) iq4_nl_step<R, true>(a, b, m0, k0, (int)((K - k0) / 32), acc);
  for (int r = 0; r < R; ++r) a.y[(m0 + r) * a.N + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}

// 8 float16 at a stride (one a block of a group of 8 32-weight blocks: their d, or m), widened exactly.
template <int kStride>
SKIPPY_INLINE __m256 f16x8(const uint8_t* p) {
  uint16_t h[8];
  for (int i = 0; i < 8; ++i) memcpy(h + i, p + i * kStride, 2);
  return _mm256_cvtph_ps(_mm_setr_epi16(h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]));
}

// Q8_0's d of 8 blocks (272 bytes: d at 34 i, so all in the first 256), widened exactly: vpermb of two
// 128-byte windows picks each d's two bytes (fewer operations than 8 word loads and inserts).
SKIPPY_INLINE __m256 q8_0_d8(const uint8_t* b) {
  alignas(64) static constexpr uint8_t kPick[2][64] = {{0, 1, 34, 35, 68, 69, 102, 103}, {8, 9, 42, 43, 76, 77, 110, 111}};
  const __m512i lo = _mm512_permutex2var_epi8(_mm512_loadu_si512(b), _mm512_load_si512(kPick[0]), _mm512_loadu_si512(b + 64));
  const __m512i hi = _mm512_permutex2var_epi8(_mm512_loadu_si512(b + 128), _mm512_load_si512(kPick[1]),
                                              _mm512_loadu_si512(b + 192));
  return _mm256_cvtph_ps(_mm_unpacklo_epi64(_mm512_castsi512_si128(lo), _mm512_castsi512_si128(hi)));
}

// The lanes of a group's 4 level vectors (2 blocks each: lanes 0-7 block 2c, 8-15 block 2c + 1) pick
// their block's factor from the group's 8 (vpermps).
inline __m512i pair_lanes(int c) {
  return _mm512_mask_blend_epi32(0xFF00, _mm512_set1_epi32(2 * c), _mm512_set1_epi32(2 * c + 1));
}

// Sum of a ymm's 8 floats, in a fixed order.
SKIPPY_INLINE float hsum8(__m256 v) {
  const __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
  return _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
}

// Q8_0 with int8 activations (the avx512vnni build; BlockDense sets a.xq for every Q8_0 call there). A
// block is one x block (32 weights: f16 d, int8 q[32]), so
//   y[m, n] = sum_b d_b * xd[m, b] * isum[m, b],  isum[m, b] = sum over the block of q * xq
// exact in int32. q is signed (-128..127), so vpdpbusd takes its unsigned operand from x (xq ^ 0x80 =
// xq + 128, 1..255) and the levels as they are; each int32 lane sums 4 products and starts from the row
// of W's own correction -128 * sum q over its 4 bytes (vpdpbusd of 128 against q, negated; shared by the R
// rows), so it ends holding its exact part of isum. Bounds per lane: products at most 4 * 255 * 128 =
// 130560 in magnitude, the correction 65536, the result 4 * 127 * 128: far inside int32.
// 8 blocks (272 bytes) a step: 4 level vectors of two blocks' q (two 32-byte loads, 34 apart), each
// against 64 consecutive bytes of xq; the int32 lanes converted and multiplied, in an FMA, by their
// block's d_b * xd[m, b] (one 8-wide product a step, spread by vpermps), into 2 accumulators per row.
// The blocks a K not a multiple of 256 leaves (K = 576: 2) one at a time in ymm, into the first. Each row
// of x runs the same float operations in the same order whatever R is (the correction is integer, exact).
template <int R>
void dot_q8_0_vnni(const SkippyBlockArgs& a, int64_t m0, int64_t n) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int64_t K = a.K, xblocks = K / SKIPPY_XBLOCK;
  const int8_t* xq = a.xq + m0 * K;
  const float* xd = a.xd + m0 * xblocks;
  const uint8_t* b = a.w + n * a.row_bytes;
  const __m512i bias = _mm512_set1_epi8((char)0x80), zero = _mm512_setzero_si512();
  const __m512i lanes[4] = {pair_lanes(0), pair_lanes(1), pair_lanes(2), pair_lanes(3)};
  int64_t i = 0;
  for (; i + 8 <= xblocks; i += 8, b += 8 * 34) {
    prefetch_ahead<8 * 34>(b);
    __m512i level[4], corr[4];
    for (int c = 0; c < 4; ++c) {
      const uint8_t* q = b + 68 * c + 2;
      level[c] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)q)),
                                    _mm256_loadu_si256((const __m256i*)(q + 34)), 1);
      corr[c] = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, bias, level[c]));
    }
    const __m256 d = q8_0_d8(b);
    for (int r = 0; r < R; ++r) {
      const int8_t* x = xq + r * K + i * SKIPPY_XBLOCK;
      const __m512 f = _mm512_castps256_ps512(_mm256_mul_ps(d, _mm256_loadu_ps(xd + r * xblocks + i)));   // 8 lanes used
      for (int c = 0; c < 4; ++c) {
        const __m512i xu = _mm512_xor_si512(_mm512_loadu_si512(x + 64 * c), bias);
        const __m512i isum = _mm512_dpbusd_epi32(corr[c], xu, level[c]);
        acc[r][c % 2] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_permutexvar_ps(lanes[c], f), acc[r][c % 2]);
      }
    }
  }
  for (; i < xblocks; ++i, b += 34) {   // (the same arithmetic, a block at a time)
    const __m256i q = _mm256_loadu_si256((const __m256i*)(b + 2)), bias8 = _mm512_castsi512_si256(bias);
    const __m256i corr = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_dpbusd_epi32(_mm256_setzero_si256(), bias8, q));
    const float d = f16_at(b);
    for (int r = 0; r < R; ++r) {
      const __m256i xu = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(xq + r * K + i * SKIPPY_XBLOCK)), bias8);
      const __m512 isum = _mm512_cvtepi32_ps(_mm512_zextsi256_si512(_mm256_dpbusd_epi32(corr, xu, q)));   // (8 lanes)
      acc[r][0] = _mm512_fmadd_ps(isum, _mm512_set1_ps(d * xd[r * xblocks + i]), acc[r][0]);
    }
  }
  for (int r = 0; r < R; ++r) a.y[(m0 + r) * a.N + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}

// Where a pair of 5-bit blocks' qs[16] go in a level vector (32 levels a block in weight order: bytes 0-15
// and 16-31 both the first block's qs, 32-63 the second's; the high nibbles shifted down after): vpermb's
// indices into the pair's bytes, qs at kQs in blocks of kBytes.
template <int kBytes, int kQs>
struct PairPick {
  alignas(64) uint8_t at[64] = {};
  constexpr PairPick() {
    for (int j = 0; j < 64; ++j) at[j] = (j < 32 ? 0 : kBytes) + kQs + j % 16;
  }
};

// Q5_1 and Q5_0 with int8 activations (the avx512vnni build; BlockDense sets a.xq for every call of those
// there). A block is one x block (32 weights, q 0..31: weight i < 16 the low nibble of qs[i], i >= 16 the
// high one of qs[i - 16], bit i of the u32 qh its fifth bit). Q5_1 (kOffset: f16 d, f16 m, qh, qs[16];
// w = d * q + m):
//   y[m, n] = sum_b d_b * xd[m, b] * isum[m, b] + sum_b m_b * xs[m, b],  isum = sum of q * xq over the block
// isum exact in int32: vpdpbusd, the levels (0..31) the unsigned operand and xq the signed one (at most
// 32 * 31 * 127 in magnitude); the offsets m_b times x's exact block sums, as Q4_K's minimums.
// Q5_0 (f16 d, qh, qs[16]; w = d * (q - 16)): y = sum_b d_b * xd[m, b] * isum, isum = sum of (q - 16) * xq,
// the signed levels q - 16 against xq ^ 0x80 = xq + 128 from a correction -128 * sum (q - 16) per lane as
// Q6_K's (vpdpbusd of q against -128 bytes from 8192, shared by the rows); bounds per lane: products 4 * 255
// * 16, the correction 8192, the result 4 * 127 * 16.
// 8 blocks a step: a level vector holds two blocks' 32 levels in weight order (one masked load of the pair,
// vpermb doubling each qs[16] (PairPick), 64-bit shifts of 0 / 4 and a mask for the nibbles, the 64 fifth
// bits of the two qh a byte mask adding 16), against 64 consecutive bytes of xq; the int32 lanes converted
// and multiplied by d_b * xd[m, b] in an FMA (spread by vpermps) into 2 accumulators per row, Q5_1's
// offsets one 8-wide FMA a step. The blocks a K not a multiple of 256 leaves one at a time in ymm, into the
// same accumulators (lanes 0-7; an offset in lane 0). Each row of x runs the same float operations in the
// same order whatever R is (Q5_0's correction is integer, exact).
template <int R, bool kOffset>
void dot_q5_vnni(const SkippyBlockArgs& a, int64_t m0, int64_t n) {
  constexpr int kBytes = kOffset ? 24 : 22, kQh = kOffset ? 4 : 2, kQs = kQh + 4;
  static constexpr PairPick<kBytes, kQs> kPick;
  __m512 acc[R][2];
  __m256 mins[R];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps(), mins[r] = _mm256_setzero_ps();
  const int64_t K = a.K, xblocks = K / SKIPPY_XBLOCK;
  const int8_t* xq = a.xq + m0 * K;
  const float *xd = a.xd + m0 * xblocks, *xs = a.xs + m0 * xblocks;
  const uint8_t* b = a.w + n * a.row_bytes;
  const __m512i nib = _mm512_set1_epi8(15), sixteen = _mm512_set1_epi8(16), pick = _mm512_load_si512(kPick.at);
  const __m512i shift = _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0);   // (per 64-bit lane: the high nibbles down)
  const __m512i bias = _mm512_set1_epi8((char)0x80), minus128 = bias, base = _mm512_set1_epi32(8192);   // (Q5_0)
  const __m512i lanes[4] = {pair_lanes(0), pair_lanes(1), pair_lanes(2), pair_lanes(3)};
  int64_t i = 0;
  for (; i + 8 <= xblocks; i += 8, b += 8 * kBytes) {
    prefetch_ahead<8 * kBytes>(b);
    __m512i level[4], corr[4];
    for (int c = 0; c < 4; ++c) {
      const uint8_t* p = b + 2 * kBytes * c;
      const __m512i q = _mm512_permutexvar_epi8(pick, _mm512_maskz_loadu_epi8((1ull << 2 * kBytes) - 1, p));   // (the pair)
      uint32_t h0, h1;
      memcpy(&h0, p + kQh, 4), memcpy(&h1, p + kBytes + kQh, 4);
      const __m512i lv = _mm512_and_si512(_mm512_srlv_epi64(q, shift), nib);
      level[c] = _mm512_mask_add_epi8(lv, _cvtu64_mask64(h0 | (uint64_t)h1 << 32), lv, sixteen);
      if (!kOffset) corr[c] = _mm512_dpbusd_epi32(base, level[c], minus128), level[c] = _mm512_sub_epi8(level[c], sixteen);
    }
    const __m256 d = f16x8<kBytes>(b), off = kOffset ? f16x8<kBytes>(b + 2) : _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const int8_t* x = xq + r * K + i * SKIPPY_XBLOCK;
      const __m512 f = _mm512_castps256_ps512(_mm256_mul_ps(d, _mm256_loadu_ps(xd + r * xblocks + i)));   // 8 lanes used
      for (int c = 0; c < 4; ++c) {
        const __m512i xc = _mm512_loadu_si512(x + 64 * c);
        const __m512i isum = kOffset ? _mm512_dpbusd_epi32(_mm512_setzero_si512(), level[c], xc)
                                     : _mm512_dpbusd_epi32(corr[c], _mm512_xor_si512(xc, bias), level[c]);
        acc[r][c % 2] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_permutexvar_ps(lanes[c], f), acc[r][c % 2]);
      }
      if (kOffset) mins[r] = _mm256_fmadd_ps(off, _mm256_loadu_ps(xs + r * xblocks + i), mins[r]);
    }
  }
  for (; i < xblocks; ++i, b += kBytes) {   // (the same arithmetic, a block at a time)
    const __m128i q = _mm_loadu_si128((const __m128i*)(b + kQs)), nib4 = _mm512_castsi512_si128(nib);
    uint32_t h;
    memcpy(&h, b + kQh, 4);
    const __m256i lv = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), nib4), _mm_and_si128(q, nib4));
    __m256i level = _mm256_mask_add_epi8(lv, _cvtu32_mask32(h), lv, _mm512_castsi512_si256(sixteen)), corr;
    if (!kOffset) {
      corr = _mm256_dpbusd_epi32(_mm512_castsi512_si256(base), level, _mm512_castsi512_si256(minus128));
      level = _mm256_sub_epi8(level, _mm512_castsi512_si256(sixteen));
    }
    const float d = f16_at(b);
    const __m256 off = _mm256_zextps128_ps256(_mm_set_ss(kOffset ? f16_at(b + 2) : 0.0f));   // (lane 0; the others 0)
    for (int r = 0; r < R; ++r) {
      const __m256i x = _mm256_loadu_si256((const __m256i*)(xq + r * K + i * SKIPPY_XBLOCK));
      const __m256i isum8 = kOffset ? _mm256_dpbusd_epi32(_mm256_setzero_si256(), level, x)
                                    : _mm256_dpbusd_epi32(corr, _mm256_xor_si256(x, _mm512_castsi512_si256(bias)), level);
      const __m512 isum = _mm512_cvtepi32_ps(_mm512_zextsi256_si512(isum8));
      acc[r][0] = _mm512_fmadd_ps(isum, _mm512_set1_ps(d * xd[r * xblocks + i]), acc[r][0]);
      if (kOffset) mins[r] = _mm256_fmadd_ps(off, _mm256_set1_ps(xs[r * xblocks + i]), mins[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const float y = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
    a.y[(m0 + r) * a.N + n] = kOffset ? y + hsum8(mins[r]) : y;
  }
}
#endif

#include "block_kernel_avx2int8.h"   // the avx2int8 build's int8 loops (dot_int8_avx2)

// The rows of x [m0, m0 + R) against row n of W on int8 activations (a.xq set: the avx512vnni build, a type
// skippy_int8_block_type lists, or the avx2int8 build, skippy_int8_block_type_avx2); one case per type.
template <int R>
void dot_int8(const SkippyBlockArgs& a, int64_t m0, int64_t n) {
#if defined(SKIPPY_INT8_AVX2) && defined(__AVX2__)
  if (dot_int8_avx2<R>(a, m0, n)) return;
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
  switch (a.type) {
    case SKIPPY_GGML_Q4_K: dot_q4_k_vnni<R>(a, m0, n); return;
    case SKIPPY_GGML_Q6_K: dot_q6_k_vnni<R>(a, m0, n); return;
    case SKIPPY_GGML_Q3_K: dot_q3_k_vnni<R>(a, m0, n); return;
    case SKIPPY_GGML_Q2_K: dot_q2_k_vnni<R>(a, m0, n); return;
    case SKIPPY_GGML_IQ4_XS: dot_iq4_xs_vnni<R>(a, m0, n); return;
    case SKIPPY_GGML_IQ4_NL: dot_iq4_nl_vnni<R>(a, m0, n); return;
    case SKIPPY_GGML_Q8_0: dot_q8_0_vnni<R>(a, m0, n); return;
    case SKIPPY_GGML_Q5_K: dot_q4_k_vnni<R, true>(a, m0, n); return;
    case SKIPPY_GGML_Q5_1: dot_q5_vnni<R, true>(a, m0, n); return;
    case SKIPPY_GGML_Q5_0: dot_q5_vnni<R, false>(a, m0, n); return;
  }
#endif
  for (int r = 0; r < R; ++r) a.y[(m0 + r) * a.N + n] = __builtin_nanf("");   // (never: the glue's list)
}

// A decode call's rows of x against row n of a Q4_K or Q6_K W (float activations).
template <int R>
void dot_k_decode(const SkippyBlockArgs& a, int64_t m0, int64_t n) {
  if (a.type == SKIPPY_GGML_Q6_K) {
    dot_blocks<R, 210, false>(a, m0, n, [](const uint8_t* b, int8_t* l, float* s, float*)
                                            __attribute__((always_inline)) { unpack_q6_k(b, l, s); });
    return;
  }
#if defined(__AVX512F__)
  dot_q4_k<R>(a, m0, n);
#else   // each sub-block's scale broadcast for its 2 runs: unpack_k4 need not spread them
  dot_blocks<R, 144, true, decltype(&unpack_k4<false, false>), 1>(a, m0, n, unpack_k4<false, false>);
#endif
}

// Rows of x [0, M) against row n of W in tiles of kRows, 2 and 1 rows, each row the same operations.
template <class Dot>
SKIPPY_INLINE void tiles(const SkippyBlockArgs& a, int64_t n, Dot dot) {
  int64_t m = 0;
  for (; m + kRows <= a.M; m += kRows) dot(std::integral_constant<int, kRows>{}, m);
  if (kRows > 2 && m + 2 <= a.M) dot(std::integral_constant<int, 2>{}, m), m += 2;
  for (; m < a.M; ++m) dot(std::integral_constant<int, 1>{}, m);
}

// Q8_0 in decode (the head and embedding of SmolLM2's Q4_K_M file): the levels widened straight from
// the blocks, not copied into L1 chunk by chunk through unpack_span's switch, and the blocks ahead
// prefetched (dot_unpacking asked for none). Run r into chain r % kChains as dot_rows (its chunks start
// at multiples of 16 runs), the same products and final sums: bit-identical. K a multiple of kQ8Step runs.
constexpr int kQ8Step = kChains > 2 ? kChains : 2;   // runs a step: whole blocks, whole rounds of the chains
template <int R>
void dot_q8_0(const SkippyBlockArgs& a, int64_t m0, int64_t n) {
  vf acc[R][kChains][kVecs] = {};
  const int64_t K = a.K;
  const float* x = a.x + m0 * K;
  const uint8_t* b = a.w + n * a.row_bytes;
  for (int64_t k0 = 0; k0 < K; k0 += kQ8Step * kRun, b += kQ8Step / 2 * 34) {
    prefetch_ahead<kQ8Step / 2 * 34>(b);
    for (int t = 0; t < kQ8Step; ++t) {   // run t of the step: half t % 2 of block t / 2, into chain t % kChains
      const float d = f16_at(b + t / 2 * 34);
      vf w[kVecs];
      for (int v = 0; v < kVecs; ++v) w[v] = widen_s8((const int8_t*)b + t / 2 * 34 + 2 + t % 2 * kRun + v * kLanes) * d;
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < kVecs; ++v) acc[r][t % kChains][v] += loadf(x + r * K + k0 + t * kRun + v * kLanes) * w[v];
    }
  }
  for (int r = 0; r < R; ++r) {
    vf total = {};
    for (int c = 0; c < kChains; ++c)
      for (int v = 0; v < kVecs; ++v) total += acc[r][c][v];
    a.y[(m0 + r) * a.N + n] = hsum(total);
  }
}

// The same product from a row unpacked ahead (prefill: its tiles of x all read it).
template <int R>
void dot_unpacked(const SkippyBlockArgs& a, int64_t m0, int64_t n, const Unpacked& u) {
  dot_rows<R>(a, m0, n, [&](int64_t k0) __attribute__((always_inline)) {
    return Unpacked{u.level + k0, u.scale + k0 / kRun, u.min + k0 / kRun};
  });
}

// Scratch for a task's unpacked rows, one per thread, grown as needed and kept for later calls.
struct Scratch {
  int8_t* level = nullptr;
  float* runs = nullptr;
  int64_t k = 0;
  bool fit(int64_t need) {
    if (need <= k) return true;
    free(level), free(runs);
    level = (int8_t*)malloc(need), runs = (float*)malloc(2 * (need / kRun) * sizeof(float));
    k = level && runs ? need : 0;
    return k != 0;
  }
};

// Rows of x up to which Q4_K / Q6_K run their decode loops (dot_k_decode) rather than the prefill path
// (rows unpacked once for every tile). kernel_micro 576x1536 against that path, us, load 8-11: avx512
// M = 2 135 -> 66 (Q4_K), 156 -> 76 (Q6_K); M = 3 203 -> 118, 228 -> 137; M = 6 236 -> 179, 218 -> 194;
// M = 8 259 -> 260, 232 -> 251 (so 8 stays there); avx2 M = 2 106 -> 98, 118 -> 98; M = 4 210 -> 189, 205 -> 189.
constexpr int64_t kDecodeRows = kRows > 2 ? 6 : 4;

// A task's first kPrefetch bytes, prefetched as it starts: the loops prefetch kPrefetch ahead of each
// block, past a task's end into the next task's rows, but the pool's threads claim tasks one at a time, so
// a thread's next task is seldom that one. Bit-identical. 1B Q4_K_M step, AVX-512, taking turns, load
// 1.5-2.3, 13-14 runs each: medians wall 66.3 -> 65.2 ms, CPU 121.0 -> 119.5 (the same tokens).
inline void prefetch_task(const SkippyBlockArgs& a, int64_t n0, int64_t rows) {
  const uint8_t* p = a.w + n0 * a.row_bytes;
  const int64_t bytes = rows * a.row_bytes < kPrefetch ? rows * a.row_bytes : kPrefetch;
  for (int64_t l = 0; l < bytes; l += 64) __builtin_prefetch(p + l);
}

void block_rows(const SkippyBlockArgs& a, int64_t task) {
  const int64_t n0 = task * SKIPPY_BLOCK_ROWS;
  const int64_t rows = a.N - n0 < SKIPPY_BLOCK_ROWS ? a.N - n0 : SKIPPY_BLOCK_ROWS;
  if (rows <= 0) return;
  if (a.xq) {   // int8 activations (any size): the type's own loop
    prefetch_task(a, n0, rows);
    for (int64_t i = 0; i < rows; ++i)
      tiles(a, n0 + i, [&](auto r, int64_t m) __attribute__((always_inline)) { dot_int8<decltype(r)::value>(a, m, n0 + i); });
    return;
  }
  if ((a.type == SKIPPY_GGML_Q4_K || a.type == SKIPPY_GGML_Q6_K) && a.M <= kDecodeRows) {   // decode-sized
    prefetch_task(a, n0, rows);
    for (int64_t i = 0; i < rows; ++i)
      tiles(a, n0 + i, [&](auto r, int64_t m) __attribute__((always_inline)) { dot_k_decode<decltype(r)::value>(a, m, n0 + i); });
    return;
  }
  if (a.M <= kRows && a.type == SKIPPY_GGML_Q8_0 && a.K % (kQ8Step * kRun) == 0) {   // (dot_unpacking's tiles)
    for (int64_t i = 0; i < rows; ++i) {
      if (a.M == kRows) dot_q8_0<kRows>(a, 0, n0 + i);
      else
        for (int64_t m = 0; m < a.M; ++m) dot_q8_0<1>(a, m, n0 + i);
    }
    return;
  }
  if (a.M <= kRows) {   // decode: one tile of x meets each row of W, unpacked chunk by chunk
    for (int64_t i = 0; i < rows; ++i) {
      if (a.M == kRows) dot_unpacking<kRows>(a, 0, n0 + i);
      else
        for (int64_t m = 0; m < a.M; ++m) dot_unpacking<1>(a, m, n0 + i);
    }
    return;
  }
  static thread_local Scratch scratch;
  if (!scratch.fit(SKIPPY_BLOCK_ROWS * a.K)) {   // out of memory: NaN outputs say so, never stale ones
    for (int64_t m = 0; m < a.M; ++m)
      for (int64_t i = 0; i < rows; ++i) a.y[m * a.N + n0 + i] = __builtin_nanf("");
    return;
  }
  Unpacked u[SKIPPY_BLOCK_ROWS];
  for (int64_t i = 0; i < rows; ++i) {
    u[i] = {scratch.level + i * a.K, scratch.runs + 2 * i * (a.K / kRun), scratch.runs + (2 * i + 1) * (a.K / kRun)};
    unpack_row(a, a.w + (n0 + i) * a.row_bytes, u[i]);
  }
  // rows of x outer, W's unpacked rows inner: a tile of x stays in L1 while it meets every row
  int64_t m = 0;
  for (; m + kRows <= a.M; m += kRows)
    for (int64_t i = 0; i < rows; ++i) dot_unpacked<kRows>(a, m, n0 + i, u[i]);
  for (; m < a.M; ++m)
    for (int64_t i = 0; i < rows; ++i) dot_unpacked<1>(a, m, n0 + i, u[i]);
}

}  // namespace

extern "C" void SKIPPY_CAT(skippy_blocks_, SKIPPY_ISA)(const SkippyBlockArgs* a, int64_t task) {
  block_rows(*a, task);
}
