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
#include "quant_kernel_simd.h"

#include <math.h>

#if defined(__x86_64__) && defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

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

// ---- decode attention (quant_kernel.h): one pass over the keys in chunks, online softmax.
constexpr int kChunk = 128;

typedef int32_t vi __attribute__((vector_size(4 * SKIPPY_LANES)));

// exp(x) for x <= 0 (Cephes' expf polynomial, ~1 ulp): 2^n * p(r), x = n ln2 + r.
inline vf vexp(vf x) {
  const vf lo = vf{} - 87.0f, magic = vf{} + 12582912.0f;   // 1.5 * 2^23: adding it rounds to an integer
  x = x < lo ? lo : x;
  const vf n = (x * 1.44269504088896341f + magic) - magic;
  const vf r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  vf p = vf{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  __builtin_memcpy(&scale, &bits, sizeof(vf));
  return p * scale;
}

void attend(const SkippyAttendArgs& a, int64_t task) {
  const int64_t b = task / a.KVH, kh = task % a.KVH, G = a.H / a.KVH, D = a.D, V = D / kLanes;
  const int64_t lane = a.lanes[b] < 0 ? 0 : (a.lanes[b] >= a.lanes_n ? a.lanes_n - 1 : a.lanes[b]);
  int64_t n = (int64_t)a.positions[b] + 1;
  n = n < 1 ? 1 : (n > a.limit ? a.limit : n);
  const float* keys = a.k + (lane * a.KVH + kh) * a.C * D;
  const float* vals = a.v + (lane * a.KVH + kh) * a.C * D;
  const float* q = a.q + (b * a.H + kh * G) * D;
  vf acc[SKIPPY_ATTEND_MAX_GROUP][SKIPPY_ATTEND_MAX_DIM / kLanes];
  float mx[SKIPPY_ATTEND_MAX_GROUP], sum[SKIPPY_ATTEND_MAX_GROUP], s[SKIPPY_ATTEND_MAX_GROUP][kChunk];
  for (int64_t g = 0; g < G; ++g) {
    mx[g] = -INFINITY, sum[g] = 0.0f;
    for (int64_t i = 0; i < V; ++i) acc[g][i] = vf{};
  }
  for (int64_t j0 = 0; j0 < n; j0 += kChunk) {
    const int64_t nj = n - j0 < kChunk ? n - j0 : kChunk;
    for (int64_t j = 0; j < nj; ++j) {
      const float* kr = keys + (j0 + j) * D;
      for (int64_t g = 0; g < G; ++g) {
        vf d = {};
        for (int64_t i = 0; i < V; ++i) d += loadf(q + g * D + i * kLanes) * loadf(kr + i * kLanes);
        s[g][j] = a.scale * hsum(d);
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t j = nj; j < kChunk && j % kLanes; ++j) s[g][j] = 0.0f;   // the last vector's tail
      float m = mx[g];
      for (int64_t j = 0; j < nj; ++j) m = s[g][j] > m ? s[g][j] : m;
      const float corr = expf(mx[g] - m);   // 0 on the first chunk (mx = -inf)
      float l = sum[g] * corr;
      for (int64_t i = 0; i < V; ++i) acc[g][i] *= corr;
      for (int64_t j = 0; j < nj; j += kLanes) {   // the tail past nj (zeroed above) is exp'd, never summed
        const vf e = vexp(loadf(&s[g][j]) - m);
        __builtin_memcpy(&s[g][j], &e, sizeof(vf));
      }
      for (int64_t j = 0; j < nj; ++j) l += s[g][j];
      mx[g] = m, sum[g] = l;
    }
    for (int64_t j = 0; j < nj; ++j) {
      const float* vr = vals + (j0 + j) * D;
      for (int64_t i = 0; i < V; ++i) {
        const vf vv = loadf(vr + i * kLanes);
        for (int64_t g = 0; g < G; ++g) acc[g][i] += s[g][j] * vv;
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = 1.0f / sum[g];
    for (int64_t i = 0; i < V; ++i) {
      const vf o = acc[g][i] * inv;
      __builtin_memcpy(a.out + (b * a.H + kh * G + g) * D + i * kLanes, &o, sizeof(vf));
    }
  }
}

// Column block j (columns j * kLanes onwards) of one packed panel row, as float levels.
struct Int8 {
  static constexpr int64_t kRowBytes = kPanel;
  static constexpr bool kOffsetOfScale = false;   // z read from its array, or 0 where none (Q5: z = -16 s)
  static inline vf block(const uint8_t* row, int j) { return widen_s8((const int8_t*)row + kLanes * j); }
  static constexpr bool kRowLevels = false;
  static constexpr int kRowVecs = kVecs;   // vectors tile_one takes per row: one pass's
  static inline void row_bytes(const uint8_t*, int, uint8_t*) {}
  static inline vf level_block(const uint8_t*, int) { return vf{}; }
};
struct Q4 {  // byte i holds column i (low nibble) and column i + 32 (high nibble)
  static constexpr int64_t kRowBytes = kPanel / 2;
  static constexpr bool kOffsetOfScale = false;
  static inline vf block(const uint8_t* row, int j) {
    return widen_u4(row + (kLanes * j) % (kPanel / 2), kLanes * j >= kPanel / 2);
  }
  static constexpr bool kRowLevels = false;
  static constexpr int kRowVecs = kVecs;   // vectors tile_one takes per row: one pass's
  static inline void row_bytes(const uint8_t*, int, uint8_t*) {}
  static inline vf level_block(const uint8_t*, int) { return vf{}; }
};

// 5-bit levels (Q5_0's, kept exactly): a panel row is the 32 bytes of Q4's nibbles, then 64 bits, bit c
// the fifth bit of column c; w = s * level + z with z = -16 s (exact in float), so no z is stored and the
// panels hold Q5_0's own 5.5 bits a weight. Q5_0 blocks read as rows took ~2x these loops' time, measured:
// the panel applies a scale per 32 inputs shared by 64 columns, the rows one per 16 (ggml.PANEL_TYPES).
struct Q5 {
  static constexpr int64_t kRowBytes = kPanel / 2 + kPanel / 8;
  static constexpr bool kOffsetOfScale = true;
  // The levels of pass h of a row at once (the decode loops' hot path; kRowLevels): nibbles split on the
  // whole bytes, fifth bits added as bytes, the bytes spilled once and widened a vector at a time. Port 5
  // bound either way, this takes ~15 vector ops a row on AVX-512 (~25 with block(): a mask move, shift and
  // masked add per vector) and ~20 a pass on AVX2 (~35), for the very same integer levels.
#if defined(__AVX512BW__)
  static constexpr bool kRowLevels = true;
  static constexpr int kRowVecs = kVecs;
  static inline void row_bytes(const uint8_t* row, int, uint8_t bytes[64]) {   // (one pass: the whole row)
    const __m512i both = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)row));
    const __m512i shift = _mm512_set_epi64(0x0004000400040004, 0x0004000400040004, 0x0004000400040004,
                                           0x0004000400040004, 0, 0, 0, 0);   // words 16..31: high nibbles
    __m512i lv = _mm512_and_si512(_mm512_srlv_epi16(both, shift), _mm512_set1_epi8(15));
    __mmask64 fifth;
    __builtin_memcpy(&fifth, row + kPanel / 2, 8);
    lv = _mm512_mask_add_epi8(lv, fifth, lv, _mm512_set1_epi8(16));
    _mm512_store_si512(bytes, lv);
  }
  static inline vf level_block(const uint8_t* bytes, int c) {
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128((const __m128i*)(bytes + 16 * c))));
  }
#elif defined(__AVX2__)
  // The whole row (both passes, kRowVecs 8): tile_one then reads, broadcasts and sums each x[k] once
  // and keeps 8 FMA chains in flight where two passes of 4 each took the row twice (from L2 the second
  // time). One 64-bit broadcast load feeds both halves' fifth bits.
  static constexpr bool kRowLevels = true;
  static constexpr int kRowVecs = 2 * kVecs;
  static inline void row_bytes(const uint8_t* row, int, uint8_t bytes[64]) {
    int64_t bits;
    __builtin_memcpy(&bits, row + kPanel / 2, 8);
    const __m256i raw = _mm256_loadu_si256((const __m256i*)row), fifths = _mm256_set1_epi64x(bits);
    const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201);
    for (int h = 0; h < 2; ++h) {   // h: columns 32 h .. 32 h + 31 (high nibbles for h = 1)
      const __m256i lv = _mm256_and_si256(h ? _mm256_srli_epi16(raw, 4) : raw, _mm256_set1_epi8(15));
      // bit i of the pass's 32 -> byte i: byte i / 8 copied to bytes 8 (i / 8) .. + 7, each testing its own bit
      const int64_t b = 0x0404040404040404 * h;
      const __m256i spread = _mm256_shuffle_epi8(fifths, _mm256_setr_epi64x(b, b + 0x0101010101010101,
                                                                            b + 0x0202020202020202, b + 0x0303030303030303));
      const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
      _mm256_store_si256((__m256i*)(bytes + 32 * h), _mm256_or_si256(lv, _mm256_and_si256(set, _mm256_set1_epi8(16))));
    }
  }
  static inline vf level_block(const uint8_t* bytes, int c) {
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(bytes + 8 * c))));
  }
#else
  static constexpr bool kRowLevels = false;
  static constexpr int kRowVecs = kVecs;   // vectors tile_one takes per row: one pass's
  static inline void row_bytes(const uint8_t*, int, uint8_t*) {}
  static inline vf level_block(const uint8_t*, int) { return vf{}; }
#endif
  static inline vf block(const uint8_t* row, int j) {
    uint64_t bits;
    __builtin_memcpy(&bits, row + kPanel / 2, 8);
    bits >>= kLanes * j;
#if defined(__AVX512F__)
    __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(row + (kLanes * j) % (kPanel / 2))));
    a = kLanes * j >= kPanel / 2 ? _mm512_srli_epi32(a, 4) : _mm512_and_si512(a, _mm512_set1_epi32(15));
    a = _mm512_mask_add_epi32(a, (__mmask16)bits, a, _mm512_set1_epi32(16));
    return (vf)_mm512_cvtepi32_ps(a);
#elif defined(__AVX2__)
    __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(row + (kLanes * j) % (kPanel / 2))));
    a = kLanes * j >= kPanel / 2 ? _mm256_srli_epi32(a, 4) : _mm256_and_si256(a, _mm256_set1_epi32(15));
    const __m256i bit = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)(bits & 0xff)),
                                                           _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
                                         _mm256_set1_epi32(1));
    return (vf)_mm256_cvtepi32_ps(_mm256_or_si256(a, _mm256_slli_epi32(bit, 4)));
#else
    vf out;
    for (int i = 0; i < kLanes; ++i) {
      const uint8_t b = row[(kLanes * j + i) % (kPanel / 2)];
      out[i] = (kLanes * j + i >= kPanel / 2 ? b >> 4 : b & 15) | ((bits >> i) & 1) << 4;
    }
    return out;
#endif
  }
};

// R rows x the kVecs column blocks of pass h, over the whole K. Each weight
// vector is scaled once in registers (one FMA) and shared by the R rows.
template <class F, int R>
void tile_rows(const SkippyDenseArgs& a, const uint8_t* panel, const uint16_t* s, const uint16_t* z,
               int64_t m0, int64_t n0, int h) {
  vf acc[R][kVecs] = {};
  const uint8_t* row = panel;
  for (int64_t g0 = 0, at = kLanes * kVecs * h; g0 < a.K; g0 += a.group, at += kPanel) {
    vf sc[kVecs], zc[kVecs];
    for (int c = 0; c < kVecs; ++c)
      sc[c] = loadh(s + at + kLanes * c), zc[c] = F::kOffsetOfScale ? sc[c] * -16.0f : z ? loadh(z + at + kLanes * c) : vf{};
    for (int64_t k = g0; k < g0 + a.group; ++k, row += F::kRowBytes) {
      // block by block here, not row_bytes: with R rows' accumulators live, the whole-row spill
      // cost prefill a quarter of its speed (bench peers, SmolLM2 Q4_K_M: 157 -> 116 tok/s)
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
  constexpr int V = F::kRowVecs;   // kVecs, or the whole row (AVX2 Q5: passes h and h + 1 at once)
  vf acc[V] = {};
  const float* x = a.x + m * a.K;
  const uint8_t* row = panel;
  for (int64_t g0 = 0, at = kLanes * kVecs * h; g0 < a.K; g0 += a.group, at += kPanel) {
    vf part[V] = {};
    float xsum = 0.0f;   // its own loop (the same sums): in the row loop, AVX2 Q5's 8 chains spilled it
    for (int64_t k = g0; k < g0 + a.group; ++k) xsum += x[k];
    for (int64_t k = g0; k < g0 + a.group; ++k, row += F::kRowBytes) {
      prefetch_ahead<1>(row);   // (rows of 32, 40 or 64 bytes: a line asked for twice at most)
      // kRowLevels: the row's levels decoded at once as bytes, each block widened right before its FMA
      // (8 widened blocks held at once spilled two of AVX2 Q5's 8 accumulators: a store-load chain a row)
      alignas(64) uint8_t bytes[64];
      if (F::kRowLevels) {
        F::row_bytes(row, h, bytes);
        __asm__("" : "+m"(bytes));   // reload from memory: GCC would widen through extracts (port 5 again)
      }
      for (int c = 0; c < V; ++c) part[c] += x[k] * (F::kRowLevels ? F::level_block(bytes, c) : F::block(row, h * kVecs + c));
    }
    for (int c = 0; c < V; ++c) {
      const vf sc = loadh(s + at + kLanes * c);
      acc[c] += part[c] * sc + xsum * (F::kOffsetOfScale ? sc * -16.0f : z ? loadh(z + at + kLanes * c) : vf{});
    }
  }
  for (int c = 0; c < V; ++c) __builtin_memcpy(a.y + m * a.Np + n0 + kLanes * (h * kVecs + c), &acc[c], sizeof(vf));
}

// Every row of output panel p; the panel stays in cache while row tiles reuse it.
template <class F>
void panel_rows(const SkippyDenseArgs* a, int64_t p) {
  const uint8_t* panel = (const uint8_t*)a->q + p * a->K * F::kRowBytes;
  const int64_t at = p * (a->K / a->group) * kPanel, n0 = p * kPanel;
  const uint16_t *s = a->s + at, *z = a->z ? a->z + at : nullptr;   // no z: offsets 0 (Q8_0) or of s (Q5)
  for (int h = 0; h < kPasses; ++h) {
    int64_t m = 0;
    for (; m + kRows <= a->M; m += kRows) tile_rows<F, kRows>(*a, panel, s, z, m, n0, h);
    if (kRows > 2 && m + 2 <= a->M) tile_rows<F, 2>(*a, panel, s, z, m, n0, h), m += 2;
    if (m < a->M && h % (F::kRowVecs / kVecs) == 0) tile_one<F>(*a, panel, s, z, m, n0, h);
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
// ---- int8 activations (AVX512-VNNI): x is quantised per row in blocks of 32 inputs
// (quant_kernel.h); a block's products are summed exactly in int32 by vpdpbusd (4 inputs
// per 32-bit lane), then scaled by the block's step xd. Per row, every output is the same
// sequence of float operations whatever the tile height, so a row's result does not depend
// on which rows share its call (batch invariance, as with the float loops' decode path).
//
// The weights stay in the float loops' layout (a panel row holds one k); vpermt2b gathers the
// 4 consecutive k of a column into one 32-bit lane on the fly.
#define SKIPPY_VNNI 1
constexpr int kXBlock = SKIPPY_XBLOCK;

inline __m512i byte_index(int (*f)(int)) {
  alignas(64) int8_t idx[64];
  for (int i = 0; i < 64; ++i) idx[i] = (int8_t)f(i);
  return _mm512_load_si512(idx);
}

// 4-bit: rows k..k+3 are 128 contiguous bytes (32 each; byte i: column i low, i + 32 high).
struct VQ4 {
  static constexpr int64_t kRowBytes = kPanel / 2;
  static constexpr bool kSigned = false, kOffsetOfScale = false;
  // lane c of the gather: row k..k+3 bytes of column c (c < 16) or c + 16 (hi).
  struct Index {
    __m512i lo = byte_index([](int i) { return (i % 4 / 2) * 64 + (i % 2) * 32 + i / 4; });
    __m512i hi = byte_index([](int i) { return (i % 4 / 2) * 64 + (i % 2) * 32 + 16 + i / 4; });
  };
  static inline void load4(const uint8_t* rows, __m512i w[4], const Index& ix) {
    nibbles(_mm512_loadu_si512(rows), _mm512_loadu_si512(rows + 64), w, ix);
  }
  // a: rows k, k + 1's 32 bytes each; b: rows k + 2, k + 3's
  static inline void nibbles(__m512i a, __m512i b, __m512i w[4], const Index& ix) {
    const __m512i lo = ix.lo, hi = ix.hi, m = _mm512_set1_epi8(15);
    const __m512i p0 = _mm512_permutex2var_epi8(a, lo, b), p1 = _mm512_permutex2var_epi8(a, hi, b);
    w[0] = _mm512_and_si512(p0, m);                           // columns 0..15
    w[1] = _mm512_and_si512(p1, m);                           // 16..31
    w[2] = _mm512_and_si512(_mm512_srli_epi16(p0, 4), m);     // 32..47
    w[3] = _mm512_and_si512(_mm512_srli_epi16(p1, 4), m);     // 48..63
  }
};

// 5-bit (Q5_0's levels, 0..31): rows k..k+3 are 4 x 40 bytes, each Q4's 32 bytes of nibbles, then 64 bits
// (bit c: column c's fifth). The nibbles are gathered into VQ4's two registers; the fifth bits are
// gathered as bytes (lane l of w[c], byte j: byte 8 j + 2 c + l / 8 of the four rows' bit words, tested
// against bit l % 8) and added as 16 where set.
struct VQ5 {
  static constexpr int64_t kRowBytes = kPanel / 2 + kPanel / 8;
  static constexpr bool kSigned = false, kOffsetOfScale = true;   // z = -16 s, as Q5's
  struct Index {
    VQ4::Index nib;
    // from (bytes 0..63, 64..127): rows 0, 1's nibbles (at 0 and 40); their bit words into qwords 0..2
    __m512i rows01 = byte_index([](int i) { return i < 32 ? i : i + 8; });
    __m512i words = byte_index([](int i) { return i < 8 ? 32 + i : i < 16 ? 64 + i : i < 24 ? 96 + i : 0; });
    // from (bytes 64..127, 96..159): rows 2, 3's nibbles (at 80 and 120)
    __m512i rows23 = byte_index([](int i) { return i < 32 ? 16 + i : 56 + i; });
    __m512i fifth[4] = {byte_index([](int i) { return 8 * (i % 4) + 0 + i / 32; }),
                        byte_index([](int i) { return 8 * (i % 4) + 2 + i / 32; }),
                        byte_index([](int i) { return 8 * (i % 4) + 4 + i / 32; }),
                        byte_index([](int i) { return 8 * (i % 4) + 6 + i / 32; })};
    __m512i bit = byte_index([](int i) { return 1 << (i / 4 % 8); });
  };
  static inline void load4(const uint8_t* rows, __m512i w[4], const Index& ix) {
    const __m512i r0 = _mm512_loadu_si512(rows), r1 = _mm512_loadu_si512(rows + 64);
    const __m512i r2 = _mm512_loadu_si512(rows + 96);   // (ends at the fourth row's last byte, 159)
    VQ4::nibbles(_mm512_permutex2var_epi8(r0, ix.rows01, r1), _mm512_permutex2var_epi8(r1, ix.rows23, r2), w,
                 ix.nib);
    // the four bit words in qwords 0..3 (the fourth: bytes 152..159, r2's last qword)
    const __m512i words = _mm512_mask_permutexvar_epi64(_mm512_permutex2var_epi8(r0, ix.words, r1), 0x08,
                                                         _mm512_set1_epi64(7), r2);
    const __m512i sixteen = _mm512_set1_epi8(16);
    for (int c = 0; c < 4; ++c) {
      const __mmask64 set = _mm512_test_epi8_mask(_mm512_permutexvar_epi8(ix.fifth[c], words), ix.bit);
      w[c] = _mm512_mask_add_epi8(w[c], set, w[c], sixteen);
    }
  }
};

// int8: rows k..k+3 are 4 x 64 bytes; pair rows into 16-bit units, then pairs into lanes.
struct VInt8 {
  static constexpr int64_t kRowBytes = kPanel;
  static constexpr bool kSigned = true, kOffsetOfScale = false;
  struct Index {
    __m512i lo = byte_index([](int i) { return (i % 2) * 64 + i / 2; });        // word c: rows 0, 1 of column c
    __m512i hi = byte_index([](int i) { return (i % 2) * 64 + 32 + i / 2; });   // of column c + 32
    __m512i w0 = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                  39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);   // lane c: words c, 32 + c
    __m512i w1 = _mm512_add_epi16(w0, _mm512_set1_epi16(16));
  };
  static inline void load4(const uint8_t* rows, __m512i w[4], const Index& ix) {
    const __m512i lo = ix.lo, hi = ix.hi, w0 = ix.w0, w1 = ix.w1;
    const __m512i r0 = _mm512_loadu_si512(rows), r1 = _mm512_loadu_si512(rows + 64);
    const __m512i r2 = _mm512_loadu_si512(rows + 128), r3 = _mm512_loadu_si512(rows + 192);
    const __m512i p_lo = _mm512_permutex2var_epi8(r0, lo, r1), p_hi = _mm512_permutex2var_epi8(r0, hi, r1);
    const __m512i q_lo = _mm512_permutex2var_epi8(r2, lo, r3), q_hi = _mm512_permutex2var_epi8(r2, hi, r3);
    w[0] = _mm512_permutex2var_epi16(p_lo, w0, q_lo);
    w[1] = _mm512_permutex2var_epi16(p_lo, w1, q_lo);
    w[2] = _mm512_permutex2var_epi16(p_hi, w0, q_hi);
    w[3] = _mm512_permutex2var_epi16(p_hi, w1, q_hi);
  }
};

// R rows x the panel's 64 columns over the whole K.
template <class F, int R>
void vtile(const SkippyDenseArgs& a, const uint8_t* panel, const uint16_t* s, const uint16_t* z, int64_t m0,
           int64_t n0) {
  const int64_t blocks = a.K / kXBlock, per_group = a.group / kXBlock;
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  const uint8_t* row = panel;
  const __m512i ones = _mm512_set1_epi8(1), flip = _mm512_set1_epi8((char)0x80);
  const typename F::Index ix;
  for (int64_t g = 0; g < a.K / a.group; ++g) {
    __m512 part[R][4];
    float xsum[R];
    for (int r = 0; r < R; ++r) {
      xsum[r] = 0.0f;
      for (int c = 0; c < 4; ++c) part[r][c] = _mm512_setzero_ps();
    }
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
      __m512i isum[R][4], wsum[4];
      for (int c = 0; c < 4; ++c) {
        wsum[c] = _mm512_setzero_si512();
        for (int r = 0; r < R; ++r) isum[r][c] = _mm512_setzero_si512();
      }
      for (int t = 0; t < kXBlock; t += 4, row += 4 * F::kRowBytes) {
        __m512i w[4];
        F::load4(row, w, ix);
        for (int r = 0; r < R; ++r) {
          int32_t x4;
          __builtin_memcpy(&x4, a.xq + (m0 + r) * a.K + b * kXBlock + t, 4);
          const __m512i xb = _mm512_set1_epi32(x4);
          // vpdpbusd multiplies unsigned bytes by signed ones: 4-bit levels are the unsigned
          // side; int8 weights are signed, so x goes unsigned as xq + 128 (corrected below).
          for (int c = 0; c < 4; ++c)
            isum[r][c] = F::kSigned ? _mm512_dpbusd_epi32(isum[r][c], _mm512_xor_si512(xb, flip), w[c])
                                    : _mm512_dpbusd_epi32(isum[r][c], w[c], xb);
        }
        if (F::kSigned)
          for (int c = 0; c < 4; ++c) wsum[c] = _mm512_dpbusd_epi32(wsum[c], ones, w[c]);
      }
      for (int r = 0; r < R; ++r) {
        const __m512 d = _mm512_set1_ps(a.xd[(m0 + r) * blocks + b]);
        xsum[r] += a.xs[(m0 + r) * blocks + b];
        for (int c = 0; c < 4; ++c) {
          const __m512i exact = F::kSigned ? _mm512_sub_epi32(isum[r][c], _mm512_slli_epi32(wsum[c], 7)) : isum[r][c];
          part[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), d, part[r][c]);
        }
      }
    }
    for (int c = 0; c < 4; ++c) {
      // offsets: stored (z), -16 s (5-bit panels) or none (GGUF Q8_0's int8 panels: z null)
      const __m512 sc = loadh(s + g * kPanel + kLanes * c);
      const __m512 zc = F::kOffsetOfScale ? _mm512_mul_ps(sc, _mm512_set1_ps(-16.0f))
                        : z               ? loadh(z + g * kPanel + kLanes * c)
                                          : _mm512_setzero_ps();
      for (int r = 0; r < R; ++r)
        acc[r][c] = _mm512_fmadd_ps(part[r][c], sc, _mm512_fmadd_ps(_mm512_set1_ps(xsum[r]), zc, acc[r][c]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(a.y + (m0 + r) * a.Np + n0 + kLanes * c, acc[r][c]);
}

template <class F>
void vpanel_rows(const SkippyDenseArgs* a, int64_t p) {
  const uint8_t* panel = (const uint8_t*)a->q + p * a->K * F::kRowBytes;
  const int64_t at = p * (a->K / a->group) * kPanel, n0 = p * kPanel;
  const uint16_t *s = a->s + at, *z = a->z ? a->z + at : nullptr;
  int64_t m = 0;
  for (; m + 4 <= a->M; m += 4) vtile<F, 4>(*a, panel, s, z, m, n0);
  for (; m < a->M; ++m) vtile<F, 1>(*a, panel, s, z, m, n0);
}
#endif

}  // namespace

#if defined(SKIPPY_INT8_AVX2) && defined(__AVX2__)
// The avx2int8 build's x [M, K] -> int8 blocks of 32: the avx512vnni build's quantiser below, value for
// value (the same amax, step and round-to-nearest-even levels; each block's sum in _mm512_reduce_add_ps's
// order: halves, then quarters, pairs, the last two), in ymm registers.
extern "C" void SKIPPY_CAT(skippy_quantize_x_, SKIPPY_ISA)(const float* x, int64_t M, int64_t K, int8_t* xq,
                                                           float* xd, float* xs) {
  const int64_t blocks = K / SKIPPY_XBLOCK;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t i = 0; i < M * blocks; ++i) {
    const float* v = x + i * SKIPPY_XBLOCK;
    const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8), v2 = _mm256_loadu_ps(v + 16),
                 v3 = _mm256_loadu_ps(v + 24);
    const __m256 big = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                     _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(big), _mm256_extractf128_ps(big, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    // the zmm sum: lanes 0-15 of v0v1 + v2v3, then its upper 8 + lower 8, 4 + 4, [2, 3, 0, 1], lane 0 + 1
    const __m256 t = _mm256_add_ps(_mm256_add_ps(v1, v3), _mm256_add_ps(v0, v2));
    const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t, 1), _mm256_castps256_ps128(t));
    const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    xs[i] = _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_movehdup_ps(t8));
    xd[i] = amax / 127.0f;
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    const __m256i w0 = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v0, inv)), _mm256_cvtps_epi32(_mm256_mul_ps(v1, inv)));
    const __m256i w1 = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v2, inv)), _mm256_cvtps_epi32(_mm256_mul_ps(v3, inv)));
    // packs work within 128-bit lanes: the dwords come out holding x's 4-byte runs 0 2 4 6 1 3 5 7; one
    // dword permute puts them back in order
    const __m256i b = _mm256_packs_epi16(w0, w1);
    _mm256_storeu_si256((__m256i*)(xq + i * SKIPPY_XBLOCK), _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }
}
#endif

#if defined(SKIPPY_VNNI)
// x [M, K] -> int8 blocks of 32 (round to nearest even, step amax / 127), their steps and sums.
extern "C" void SKIPPY_CAT(skippy_quantize_x_, SKIPPY_ISA)(const float* x, int64_t M, int64_t K, int8_t* xq,
                                                           float* xd, float* xs) {
  const int64_t blocks = K / kXBlock;
  for (int64_t i = 0; i < M * blocks; ++i) {
    const float* v = x + i * kXBlock;
    const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    xs[i] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
    xd[i] = amax / 127.0f;
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    _mm_storeu_si128((__m128i*)(xq + i * kXBlock), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, inv))));
    _mm_storeu_si128((__m128i*)(xq + i * kXBlock + 16),
                     _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, inv))));
  }
}
#endif

extern "C" void SKIPPY_CAT(skippy_attend_, SKIPPY_ISA)(const SkippyAttendArgs* a, int64_t task) {
  attend(*a, task);
}
extern "C" void SKIPPY_CAT(skippy_int8_panel_, SKIPPY_ISA)(const SkippyDenseArgs* a, int64_t p) {
#if defined(SKIPPY_VNNI)
  if (a->xq) return vpanel_rows<VInt8>(a, p);
#endif
  panel_rows<Int8>(a, p);
}
extern "C" void SKIPPY_CAT(skippy_q4_panel_, SKIPPY_ISA)(const SkippyDenseArgs* a, int64_t p) {
#if defined(SKIPPY_VNNI)
  if (a->xq) return vpanel_rows<VQ4>(a, p);
#endif
  panel_rows<Q4>(a, p);
}
extern "C" void SKIPPY_CAT(skippy_q5_panel_, SKIPPY_ISA)(const SkippyDenseArgs* a, int64_t p) {
#if defined(SKIPPY_VNNI)
  if (a->xq) return vpanel_rows<VQ5>(a, p);
#endif
  panel_rows<Q5>(a, p);
}
