// GGUF blocks read in place, for one instruction set: y[M, N] = x[M, K] @ W.T with W [N, K] held as
// the file's own rows of Q4_K, Q5_K, Q6_K, Q5_0 or Q8_0 blocks (layout and arguments: quant_kernel.h).
// Built per ISA like quant_kernel_isa.cc, linked with the FFI glue (quant_kernel.cc), which splits
// W's rows over XLA's pool; only the one entry point has external linkage.
//
// The float approach, not llama.cpp's int8 activations: a task unpacks its SKIPPY_BLOCK_ROWS rows of W
// once into int8 levels plus one float scale (and minimum) per 16 inputs, exactly the factors of
// gguf-py's dequantiser (d * sc, dmin * m), then every row of x takes float dot products with them:
//   y[m, n] = sum_s scale[n, s] * (x[m, s] . level[n, s]) - sum_s min[n, s] * xsum[m, s]
// over the 16-input runs s. So a result differs from the f32 product of the dequantised weights only
// by float rounding (the order of the sums), as the QTensor float loops do; the greedy ids of a
// Q4_K_M model stay those of its dequantised weights. Each row of x runs the same operations whatever
// the tile height, so a row's result does not depend on the rows that share its call.

#include "quant_kernel.h"
#include "quant_kernel_simd.h"
#include "block_kernel_more.h"   // Q3_K, IQ4_XS, IQ4_NL, Q5_1, Q2_K: block_kernel_more_isa.cc

#include <stdlib.h>
#include <string.h>

namespace {

constexpr int kRun = 16;                 // inputs per scale (Q6_K's own; Q4_K / Q5_K / Q5_0 scales repeat)
constexpr int kVecs = kRun / kLanes;     // vectors per run: 1 (AVX-512), 2 (AVX2), 4
constexpr int kChains = 4 / kVecs;       // independent accumulators per row, so FMAs overlap their latency
#if defined(__AVX512F__)
constexpr int kRows = 4;                 // rows of x sharing each scaled weight vector
#else
constexpr int kRows = 2;                 // (16 ymm / xmm registers)
#endif

typedef uint8_t v16u8 __attribute__((vector_size(16)));   // 16 bytes: SSE2 / NEON on any 64-bit CPU

inline float f16_at(const uint8_t* p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return half_to_float(h);
}

// A row of W unpacked: levels [K], scale and minimum per run [K / 16].
struct Unpacked {
  int8_t* level;
  float* scale;
  float* min;
};

// Q4_K / Q5_K's 6-bit scale and minimum of sub-block j (of 8), packed in 12 bytes.
inline void scale_min_k4(int j, const uint8_t* q, int* sc, int* m) {
  if (j < 4) {
    *sc = q[j] & 63, *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// 256 weights: d * sc_j * q - dmin * m_j per 32-input sub-block j; Q5_K adds qh's bit j as q's fifth bit.
template <bool kFive>
void unpack_k4(const uint8_t* __restrict b, int8_t* __restrict level, float* scale, float* min) {
  const float d = f16_at(b), dmin = f16_at(b + 2);
  const uint8_t *qh = b + 16, *qs = b + (kFive ? 48 : 16);
  for (int j = 0; j < 4; ++j) {
    for (int l = 0; l < 32; ++l) {
      const int lo = qs[32 * j + l] & 15, hi = qs[32 * j + l] >> 4;
      level[64 * j + l] = (int8_t)(kFive ? lo | (((qh[l] >> (2 * j)) & 1) << 4) : lo);
      level[64 * j + 32 + l] = (int8_t)(kFive ? hi | (((qh[l] >> (2 * j + 1)) & 1) << 4) : hi);
    }
  }
  for (int j = 0; j < 8; ++j) {
    int sc, m;
    scale_min_k4(j, b + 4, &sc, &m);
    scale[2 * j] = scale[2 * j + 1] = d * (float)sc;
    min[2 * j] = min[2 * j + 1] = dmin * (float)m;
  }
}

// 256 weights in two halves of 128: d * sc_r * (q - 32), q's low 4 bits in ql, high 2 in qh.
void unpack_q6_k(const uint8_t* __restrict b, int8_t* __restrict level, float* scale) {
  const uint8_t *ql = b, *qh = b + 128;
  const int8_t* sc = (const int8_t*)(b + 192);
  const float d = f16_at(b + 208);
  for (int h = 0; h < 2; ++h, ql += 64, qh += 32, level += 128) {
    for (int l = 0; l < 32; ++l) {
      level[l] = (int8_t)(((ql[l] & 15) | ((qh[l] & 3) << 4)) - 32);
      level[l + 32] = (int8_t)(((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32);
      level[l + 64] = (int8_t)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
      level[l + 96] = (int8_t)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
    }
  }
  for (int r = 0; r < 16; ++r) scale[r] = d * (float)sc[r];
}

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
void unpack_q5_0(const uint8_t* __restrict b, int8_t* __restrict level, float* scale) {
  const uint64_t spread[4] = {kSpread.of[b[2]], kSpread.of[b[3]], kSpread.of[b[4]], kSpread.of[b[5]]};
  v16u8 qs, h0, h1;
  memcpy(&qs, b + 6, 16), memcpy(&h0, spread, 16), memcpy(&h1, spread + 2, 16);
  const v16u8 lo = ((qs & 15) | h0) - 16, hi = ((qs >> 4) | h1) - 16;   // (wrapping: the int8 levels)
  memcpy(level, &lo, 16), memcpy(level + 16, &hi, 16);
  scale[0] = scale[1] = f16_at(b);
}

// 32 weights: d * q, q the block's own int8 levels.
void unpack_q8_0(const uint8_t* __restrict b, int8_t* __restrict level, float* scale) {
  memcpy(level, b + 2, 32);
  scale[0] = scale[1] = f16_at(b);
}

bool has_min(int32_t type) {
  return type == SKIPPY_GGML_Q4_K || type == SKIPPY_GGML_Q5_K || skippy_more_has_min(type);
}

void unpack_row(const SkippyBlockArgs& a, const uint8_t* row, Unpacked u) {
  int64_t more_block, more_bytes;
  if (skippy_more_block(a.type, &more_block, &more_bytes)) return skippy_unpack_more(&a, row, u.level, u.scale, u.min);
  const int64_t block = a.type == SKIPPY_GGML_Q5_0 || a.type == SKIPPY_GGML_Q8_0 ? 32 : 256;
  const int64_t bytes = a.row_bytes / (a.K / block);
  for (int64_t i = 0; i < a.K / block; ++i, row += bytes) {
    int8_t* level = u.level + i * block;
    float *scale = u.scale + i * (block / kRun), *min = u.min + i * (block / kRun);
    switch (a.type) {
      case SKIPPY_GGML_Q4_K: unpack_k4<false>(row, level, scale, min); break;
      case SKIPPY_GGML_Q5_K: unpack_k4<true>(row, level, scale, min); break;
      case SKIPPY_GGML_Q6_K: unpack_q6_k(row, level, scale); break;
      case SKIPPY_GGML_Q8_0: unpack_q8_0(row, level, scale); break;
      default: unpack_q5_0(row, level, scale); break;
    }
  }
}

// y[m0 .. m0 + R, n] for one unpacked row of W: per row of x the same operations whatever R is.
template <int R>
void dot_rows(const SkippyBlockArgs& a, int64_t m0, int64_t n, const Unpacked& u) {
  vf acc[R][kChains][kVecs] = {};
  const int64_t runs = a.K / kRun;
  // the chain index c is a constant in the unrolled loop: a run-time index would keep acc in memory
  for (int64_t s0 = 0; s0 < runs; s0 += kChains) {
    for (int c = 0; c < kChains && s0 + c < runs; ++c) {
      const int64_t s = s0 + c;
      vf w[kVecs];
      for (int v = 0; v < kVecs; ++v) w[v] = widen_s8(u.level + s * kRun + v * kLanes) * u.scale[s];
      for (int r = 0; r < R; ++r) {
        const float* x = a.x + (m0 + r) * a.K + s * kRun;
        for (int v = 0; v < kVecs; ++v) acc[r][c][v] += loadf(x + v * kLanes) * w[v];
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    vf total = {};
    for (int c = 0; c < kChains; ++c)
      for (int v = 0; v < kVecs; ++v) total += acc[r][c][v];
    float y = hsum(total);
    if (has_min(a.type)) {   // whole vectors, then the runs left by K of 32-blocks (Q5_1)
      const float* xs = a.xsum + (m0 + r) * runs;
      vf mins = {};
      int64_t s = 0;
      for (; s + kLanes <= runs; s += kLanes) mins += loadf(u.min + s) * loadf(xs + s);
      float tail = 0.0f;
      for (; s < runs; ++s) tail += u.min[s] * xs[s];
      y -= hsum(mins) + tail;
    }
    a.y[(m0 + r) * a.N + n] = y;
  }
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

void block_rows(const SkippyBlockArgs& a, int64_t task) {
  const int64_t n0 = task * SKIPPY_BLOCK_ROWS;
  const int64_t rows = a.N - n0 < SKIPPY_BLOCK_ROWS ? a.N - n0 : SKIPPY_BLOCK_ROWS;
  static thread_local Scratch scratch;
  if (rows <= 0) return;
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
    for (int64_t i = 0; i < rows; ++i) dot_rows<kRows>(a, m, n0 + i, u[i]);
  for (; m < a.M; ++m)
    for (int64_t i = 0; i < rows; ++i) dot_rows<1>(a, m, n0 + i, u[i]);
}

}  // namespace

extern "C" void SKIPPY_CAT(skippy_blocks_, SKIPPY_ISA)(const SkippyBlockArgs* a, int64_t task) {
  block_rows(*a, task);
}
