// Weight-only int8 dense layer for XLA CPU, called through the XLA FFI.
//
//   y[M, Np] = x[M, K] @ W,  W[k, n] = q[k, n] * s[g, n] + z[g, n],  g = k / group
//
// Packed in 64-column panels: q int8 [Np / 64][K][64], s and z float32
// [Np / 64][K / group][64].
//
// Why a kernel at all: XLA CPU cannot fuse an int8->f32 convert into a dot.
// It materialises the converted f32 weight (4 bytes per weight written and
// read back, plus page faults on the fresh buffer), which is ~10x slower than
// the plain f32 dot. Here the int8 weights are widened in registers, so a
// decode step reads 1 byte per weight from memory instead of 4.
//
// Why the packed layout: a 64-column panel (and its scales) is contiguous
// over K, so a tile streams memory linearly. With [K, N] rows the tile strides
// by N bytes per k, a new page every step for the 49152-wide head, and the
// prefetcher gives up: a decode step measured 3.5x slower with q as [K, N],
// 1.5x slower with s and z as [groups, N]. The panel stays in L2 while row
// blocks of a prefill reuse it.
//
// Built by skippy_zmq/model/quant.py with -march=native on first use.

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

typedef float v16f __attribute__((vector_size(64)));
constexpr int64_t kPanel = 64;             // columns per packed panel: 4 vectors of 16
constexpr int64_t kMinParallel = 4 << 20;  // multiply-adds below which the caller does it all

// 16 int8 -> 16 f32 in registers (GCC's generic vector convert goes scalar).
static inline v16f load_w(const int8_t* p) {
#if defined(__AVX512F__)
  return (v16f)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
#elif defined(__AVX2__)
  __m256 h[2] = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))),
                 _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8))))};
  v16f out;
  __builtin_memcpy(&out, h, 64);
  return out;
#else
  v16f out;
  for (int i = 0; i < 16; ++i) out[i] = p[i];
  return out;
#endif
}

// R rows x one 64-column panel over the whole K; accumulators stay in registers.
// Weights are widened and scaled in registers (one FMA per weight vector,
// shared by the R rows), so per-group scales cost no extra accumulators.
template <int R>
static void tile(const float* x, const int8_t* panel, const float* s, const float* z, float* y,
                 int64_t K, int64_t Np, int64_t group, int64_t m0, int64_t n0) {
  v16f acc[R][4] = {};
  const int8_t* qp = panel;
  for (int64_t g0 = 0; g0 < K; g0 += group) {
    v16f sc[4], zc[4];
    const int64_t at = (g0 / group) * kPanel;
    for (int c = 0; c < 4; ++c) {
      __builtin_memcpy(&sc[c], s + at + 16 * c, 64);
      __builtin_memcpy(&zc[c], z + at + 16 * c, 64);
    }
    for (int64_t k = g0; k < g0 + group; ++k, qp += kPanel) {
      v16f w[4];
      for (int c = 0; c < 4; ++c) w[c] = load_w(qp + 16 * c) * sc[c] + zc[c];
      for (int r = 0; r < R; ++r) {
        float xv = x[(m0 + r) * K + k];
        for (int c = 0; c < 4; ++c) acc[r][c] += xv * w[c];
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) __builtin_memcpy(y + (m0 + r) * Np + n0 + 16 * c, &acc[r][c], 64);
}

// One panel for every row, rows in register blocks of 4.
static void panel_rows(const float* x, const int8_t* q, const float* s, const float* z, float* y,
                       int64_t M, int64_t K, int64_t Np, int64_t group, int64_t p) {
  const int8_t* panel = q + p * K * kPanel;
  const int64_t groups = K / group;
  s += p * groups * kPanel;
  z += p * groups * kPanel;
  int64_t n0 = p * kPanel, m = 0;
  for (; m + 4 <= M; m += 4) tile<4>(x, panel, s, z, y, K, Np, group, m, n0);
  switch (M - m) {
    case 3: tile<3>(x, panel, s, z, y, K, Np, group, m, n0); break;
    case 2: tile<2>(x, panel, s, z, y, K, Np, group, m, n0); break;
    case 1: tile<1>(x, panel, s, z, y, K, Np, group, m, n0); break;
  }
}

struct Progress {
  std::atomic<int64_t> next{0}, done{0};
};

static ffi::Error Int8Dense(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                            ffi::Buffer<ffi::F32> s, ffi::Buffer<ffi::F32> z,
                            ffi::ResultBuffer<ffi::F32> y) {
  auto qd = q.dimensions();
  if (qd.size() != 3 || qd[2] != kPanel) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "q must be packed as [Np/64, K, 64]");
  }
  const int64_t panels = qd[0], K = qd[1], Np = panels * kPanel;
  auto sd = s.dimensions();
  if (sd.size() != 3 || sd[0] != panels || sd[1] <= 0 || K % sd[1] || sd[2] != kPanel ||
      z.element_count() != s.element_count()) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "s and z must be [Np/64, groups dividing K, 64]");
  }
  const int64_t group = K / sd[1];
  const int64_t M = K ? x.element_count() / K : 0;
  const float* xp = x.typed_data();
  const int8_t* qp = q.typed_data();
  const float* sp = s.typed_data();
  const float* zp = z.typed_data();
  float* yp = y->typed_data();
  // Panels are claimed from a shared counter. The caller works too and takes
  // whatever the pool has not started, so a pool busy with other thunks slows
  // this call down but can never deadlock it. Late helpers find nothing left;
  // the shared_ptr keeps the counters alive for them.
  auto progress = std::make_shared<Progress>();
  auto run = [=]() {
    for (int64_t p; (p = progress->next.fetch_add(1, std::memory_order_relaxed)) < panels;) {
      panel_rows(xp, qp, sp, zp, yp, M, K, Np, group, p);
      progress->done.fetch_add(1, std::memory_order_release);
    }
  };
  // A sleeping pool thread takes ~25-50 us to wake (measured), as long as a
  // whole decode-step projection on one core, and one core nearly saturates
  // memory here (33 vs 38 GB/s for two). So decode projections stay on the
  // caller; the head and prefill chunks (compute-bound) use the pool.
  const int64_t helpers = M * K * Np < kMinParallel ? 0 : std::min<int64_t>(pool.num_threads() - 1, panels - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([run] { run(); });
  run();
  while (progress->done.load(std::memory_order_acquire) < panels) std::this_thread::yield();
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(skippy_int8_dense, Int8Dense,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
