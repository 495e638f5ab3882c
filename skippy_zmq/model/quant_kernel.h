// Shared between the FFI glue (quant_kernel.cc, built for the baseline CPU)
// and the matmul loops (quant_kernel_isa.cc, built once per instruction set).
// Plain C on purpose: the per-ISA objects share no C++ inline functions with
// the glue, so the linker can never pick an AVX-512 copy of a helper for a
// CPU that only has AVX2.
#pragma once
#include <stdint.h>

#define SKIPPY_PANEL 64  // output columns per packed weight panel

// One dense call, y[M, Np] = x[M, K] @ W, W[k, n] = level(k, n) * s[g, n] + z[g, n], g = k / group.
// Levels are packed in 64-column panels: int8 [Np / 64][K][64], 4-bit [Np / 64][K][32]
// (byte j: column j in the low nibble, column j + 32 in the high one), or 5-bit [Np / 64][K][40]
// (the 4-bit row, then 8 bytes: bit c the fifth bit of column c).
// s and z are float16 (IEEE binary16 bits) [Np / 64][K / group][64], widened once per group;
// z is null where no offsets are stored: 0 (int8: GGUF Q8_0) or -16 s (5-bit: GGUF Q5_0).
//
// With int8 activations (the VNNI loops), xq holds x quantised per row in blocks of
// SKIPPY_XBLOCK inputs: x[m, k] ~ xq[m, k] * xd[m, b], b = k / SKIPPY_XBLOCK, xq in -127..127,
// and xs[m, b] the exact float sum of the block (for the offsets z). xq is null when the
// call runs the float loops (the ISA has none, or K or the group is not a multiple of the block).
#define SKIPPY_XBLOCK 32
typedef struct {
  const float* x;
  const void* q;
  const uint16_t* s;
  const uint16_t* z;
  float* y;
  int64_t M, K, Np, group;
  const int8_t* xq;
  const float* xd;
  const float* xs;
} SkippyDenseArgs;

// Quantises x [M, K] (K a multiple of SKIPPY_XBLOCK) into xq, xd, xs as above.
typedef void (*SkippyQuantizeFn)(const float* x, int64_t M, int64_t K, int8_t* xq, float* xd, float* xs);

// Decode attention (one query token per row) over the row's lane of one layer's f32 KV arena:
// out[b, h] = softmax_j(scale * q[b, h] . k[lane_b, h / G, j]) @ v[lane_b, h / G, j] over the keys
// j < min(positions[b] + 1, limit), G = H / KVH query heads per KV head. q and out are [B, H, D];
// k and v [lanes, KVH, C, D]. Lanes and positions are clamped to the arena.
typedef struct {
  const float* q;
  const float* k;
  const float* v;
  float* out;
  const int32_t* lanes;
  const int32_t* positions;
  int64_t B, H, KVH, lanes_n, C, D, limit;
  float scale;
} SkippyAttendArgs;
#define SKIPPY_ATTEND_MAX_GROUP 32   // query heads per KV head
#define SKIPPY_ATTEND_MAX_DIM 256    // head dimension

// Computes task = b * KVH + kv head.
typedef void (*SkippyAttendFn)(const SkippyAttendArgs* args, int64_t task);

// GGUF blocks read in place (block_kernel_isa.cc): y[M, N] = x[M, K] @ W.T, W [N, K] held as rows of
// row_bytes bytes of GGML type `type` (SKIPPY_GGML_*), exactly as the file stores them. xsum [M, K / 16]:
// x's sums per 16 inputs, for the types whose blocks subtract a minimum (Q4_K, Q5_K); null under
// int8 activations for every type but Q2_K (the int8 loops meet minimums with xs).
// With int8 activations (the avx512vnni ISA, the types skippy_int8_block_type lists, every M; the avx2int8
// ISA, skippy_int8_block_type_avx2's), xq, xd
// and xs hold x quantised per row in blocks of SKIPPY_XBLOCK inputs exactly as SkippyDenseArgs' do; null
// everywhere else (the float loops).
#define SKIPPY_GGML_Q5_0 6
#define SKIPPY_GGML_Q5_1 7
#define SKIPPY_GGML_Q8_0 8
#define SKIPPY_GGML_Q4_K 12
#define SKIPPY_GGML_Q5_K 13
#define SKIPPY_GGML_Q6_K 14
// (block_kernel_more.h's types too, here for skippy_int8_block_type)
#define SKIPPY_GGML_Q2_K 10
#define SKIPPY_GGML_Q3_K 11
#define SKIPPY_GGML_IQ4_NL 20
#define SKIPPY_GGML_IQ4_XS 23
#define SKIPPY_BLOCK_ROWS 16   // rows of W per task

// The GGUF types the avx512vnni build runs on int8 activations (block_kernel_isa.cc's dot_int8); the glue
// quantises x for exactly these (model/ggml.py's INT8_BLOCK_TYPES says the same to the tests).
static inline int skippy_int8_block_type(int32_t type) {
  switch (type) {
    case SKIPPY_GGML_Q4_K:
    case SKIPPY_GGML_Q6_K:
    case SKIPPY_GGML_Q3_K:
    case SKIPPY_GGML_Q2_K:
    case SKIPPY_GGML_IQ4_XS:
    case SKIPPY_GGML_IQ4_NL:
    case SKIPPY_GGML_Q8_0:
    case SKIPPY_GGML_Q5_K:
    case SKIPPY_GGML_Q5_1:
    case SKIPPY_GGML_Q5_0:
      return 1;
    default:
      return 0;
  }
}

// The ones the avx2int8 build runs on int8 activations (block_kernel_avx2int8.h; model/ggml.py's
// INT8_BLOCK_TYPES_AVX2): a Q4_K_M / Q5_K_M / Q6_K file's types.
static inline int skippy_int8_block_type_avx2(int32_t type) {
  switch (type) {
    case SKIPPY_GGML_Q4_K:
    case SKIPPY_GGML_Q5_K:
    case SKIPPY_GGML_Q6_K:
    case SKIPPY_GGML_Q8_0:
    case SKIPPY_GGML_Q5_0:
      return 1;
    default:
      return 0;
  }
}

typedef struct {
  const float* x;
  const float* xsum;
  const uint8_t* w;
  float* y;
  int64_t M, K, N, row_bytes;
  int32_t type;
  const int8_t* xq;
  const float* xd;
  const float* xs;
} SkippyBlockArgs;

// Computes rows [task * SKIPPY_BLOCK_ROWS, + SKIPPY_BLOCK_ROWS) of W (clipped to N) for every row of x.
typedef void (*SkippyBlockFn)(const SkippyBlockArgs* args, int64_t task);

// Computes every row of output panel p.
typedef void (*SkippyPanelFn)(const SkippyDenseArgs* args, int64_t p);

#define SKIPPY_DECLARE_ISA(isa)                                                 \
  extern "C" void skippy_int8_panel_##isa(const SkippyDenseArgs* args, int64_t p); \
  extern "C" void skippy_q4_panel_##isa(const SkippyDenseArgs* args, int64_t p);        \
  extern "C" void skippy_q5_panel_##isa(const SkippyDenseArgs* args, int64_t p);        \
  extern "C" void skippy_attend_##isa(const SkippyAttendArgs* args, int64_t task); \
  extern "C" void skippy_blocks_##isa(const SkippyBlockArgs* args, int64_t task);
#define SKIPPY_DECLARE_QUANTIZE(isa) \
  extern "C" void skippy_quantize_x_##isa(const float* x, int64_t M, int64_t K, int8_t* xq, float* xd, float* xs);
